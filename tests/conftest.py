"""Shared test settings: small hypothesis budgets keep the suite fast on 2 cores."""

import os

import torch
from hypothesis import settings

settings.register_profile("moend", max_examples=25, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "moend"))

# Two pytest workers share two cores: one intra-op thread each avoids oversubscription.
torch.set_num_threads(int(os.environ.get("MOEND_TEST_THREADS", "1")))
