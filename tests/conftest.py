"""Shared test settings: small hypothesis budgets keep the suite fast on 2 cores."""

import os
import tempfile

import torch
from hypothesis import settings

settings.register_profile("moend", max_examples=25, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "moend"))

# Each pytest-xdist worker (and the subprocesses it starts) gets its own inductor cache: two workers writing
# the same compiled .so at once left truncated files ("file too short") on this machine.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"moend-inductor-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"),
)

# Two pytest workers share two cores: one intra-op thread each avoids oversubscription.
torch.set_num_threads(int(os.environ.get("MOEND_TEST_THREADS", "1")))
