import torch

from moend_fx.models import is_compiled, tiny_model, uncompile


def test_uncompile_restores_eager_calls():
    model = tiny_model("llama", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert not is_compiled(model)
    model.compile(backend="eager")
    assert is_compiled(model)
    assert uncompile(model) is model and not is_compiled(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    uncompile(model)  # a module that is not compiled: nothing to undo
    assert not is_compiled(model)
