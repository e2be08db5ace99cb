"""The GPU-only entry points behave on a CPU machine: `.ci/gpu` parses, and the end-to-end GPU benchmark exits
with a clear error instead of a traceback (it cannot run here; .ci/gpu runs it on a device)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from moend_fx.common.errors import MoendError
from moend_fx.kernels import bench_cuda_model

ROOT = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def test_ci_gpu_script_parses():
    proc = subprocess.run(["bash", "-n", str(ROOT / ".ci" / "gpu")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@no_cuda
def test_gpu_benchmarks_fail_cleanly_without_cuda(tmp_path, capsys):
    assert bench_cuda_model.main(["--out", str(tmp_path)]) == 2
    assert "need a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing half-written
    with pytest.raises(MoendError, match="CUDA"):
        bench_cuda_model.plan_step((1024,))


def test_plan_step_plan_covers_every_layer():
    plan = bench_cuda_model.plan_for("14x", 4096)
    assert len(plan.layers) == bench_cuda_model.LAYERS
    assert any(c.k_bits < 16 or c.keep_ratio < 1 for c in plan.layers)  # 14x cannot keep every layer lossless
