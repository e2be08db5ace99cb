"""Shared test settings: small hypothesis budgets keep the suite fast on 2 cores; the session-wide real models."""

import os
import tempfile

import pytest
import torch
from hypothesis import settings

settings.register_profile("moend", max_examples=25, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "moend"))

# Each pytest-xdist worker (and the subprocesses it starts) gets its own inductor cache: two workers writing
# the same compiled .so at once left truncated files ("file too short") on this machine.
# (Workers inherit the controller's environment, so the worker id is appended to whatever is set there.)
_base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "moend-inductor")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{_base}-{os.environ['PYTEST_XDIST_WORKER']}"

# Two pytest workers share two cores: one intra-op thread each avoids oversubscription. The processes tests start
# (the README example, CLI calls) inherit it through OMP_NUM_THREADS: at torch's default of one thread per core,
# the README example beside a busy worker took 238 s instead of 184 s (its calibration 124 s instead of 71 s).
_threads = os.environ.get("MOEND_TEST_THREADS", "1")
torch.set_num_threads(int(_threads))
os.environ["OMP_NUM_THREADS"] = _threads


@pytest.fixture(autouse=True)
def _threads_restored():
    """Fails a test that leaves torch at another thread count than the suite's (and restores it). Leaked, it
    oversubscribes the two cores for the rest of that worker: one in-process `moend bench` call left 2 threads
    behind, the tests after it took 6-13x their time alone (tests/cache/test_bytes_walk.py: 369 s against 49 s)
    and the suite 23-26 minutes instead of 13."""
    yield
    n = torch.get_num_threads()
    if n != int(_threads):
        torch.set_num_threads(int(_threads))
        pytest.fail(f"the test left torch at {n} intra-op threads; the suite runs at {_threads} "
                    "(restore it, as moend_fx.cli.main does)")


@pytest.fixture(scope="session")
def qwen():
    """``(model, tokenizer)`` of the embedded Qwen2.5-Coder-0.5B-Instruct (fp32, ~2.5 GB), loaded once per session
    (per xdist worker); the first use on a fresh cache converts it (~90 s), `make install` does that already."""
    from moend_fx.models import load_model

    return load_model("qwen2.5-0.5b")


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the embedded SmolLM2-135M-Instruct (fp32), loaded once per session (per xdist
    worker). A test that prepares or compiles it must undo that (``unprepare``) before it returns."""
    from moend_fx.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3():
    """``(model, tokenizer)`` of the embedded Gemma 3 270M (fp32, the sliding-window hybrid), loaded once per session
    (per xdist worker); the first use on a fresh cache converts it (~90 s), `make install` does that already. A test
    that prepares or compiles it must undo that (``unprepare``) before it returns."""
    from moend_fx.models import load_model

    return load_model("gemma3-270m")


def pytest_collection_modifyitems(session, config, items):
    """Files holding real-model (``slow``) tests run first. Under ``--dist loadfile --no-loadscope-reorder`` (the
    Makefile's; without the second flag pytest-xdist 3.x hands files out by test count, largest first, and this
    order is lost) a file is one unit and units are handed out in collection order; alphabetically the
    costliest files (``test_readme.py``, ``test_pinned_behaviour.py``, ~3 min each) came last, so one worker ran
    them while the other sat idle. Started first, the many short files fill in around them. Stable: the order
    inside each group is kept."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
