"""cleanup: dead nodes go, the graph lints, forward is regenerated; live nodes stay."""

import torch
import torch.fx as fx
from moend_fx.passes.cleanup import cleanup


def test_cleanup_removes_dead_nodes_and_recompiles():
    def fn(x):
        unused = torch.ops.moend.dequantize  # noqa: F841 (the op registry is not a node)
        y = x * 2
        _dead = torch.cat([x, y], dim=0)  # noqa: F841
        return y + 1

    import moend_fx.storage.quant  # noqa: F401  (registers moend::dequantize)

    gm = fx.symbolic_trace(fn)
    assert any(n.target is torch.cat for n in gm.graph.nodes)
    old_code = gm.code
    out = cleanup(gm)
    assert out is gm
    assert not any(n.target is torch.cat for n in gm.graph.nodes)
    assert gm.code != old_code and "cat" not in gm.code
    x = torch.arange(3.0)
    torch.testing.assert_close(gm(x), x * 2 + 1)
