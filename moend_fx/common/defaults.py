"""The one home of the defaults every stage shares (group size, sinks, recent window, eviction cadence).

A literal ``32`` for the group size or ``4`` for the sinks anywhere else is a bug waiting to diverge: import the
name from here instead.
"""

from __future__ import annotations

GROUP_SIZE = 32
"""Quantization group: K groups this many tokens per channel, V this many channels per token."""

SINK_TOKENS = 4
"""Leading tokens every evicting layer keeps (attention sinks)."""

RECENT_TOKENS = 32
"""Newest tokens every evicting layer keeps."""

QUERY_WINDOW = 32
"""Queries a query-reading scorer (snapkv, h2o, trig without stats) keeps to score keys, in the cache and in
calibration alike."""

EVICT_EVERY = 128
"""Decode steps between re-evictions (the paper's cadence)."""

CALIBRATION_TOKENS = 2048
"""Tokens of calibration text the default table is measured on."""

DEFAULT_MODEL = "smollm2-135m"
"""The embedded real model the demo, the evaluation and the slow tests run."""

CALIBRATION_WINDOW = 64
"""Last queries of a calibration sequence whose attention-output error S[layer, config] measures."""

PREFILL_CHUNK = 2048
"""Tokens per prefill chunk ``moend_fx.prepare`` feeds a long prompt in (docs/cache.md, "Long prompts"): one
chunk's full-precision K/V and activations are the prefill's transient memory instead of the whole prompt's."""

PREFILL_CHUNK_ABOVE = 4096
"""Prompts longer than this many tokens are prefilled in chunks by default; shorter ones in one pass (where
chunking would save little memory and still cost accuracy: docs/cache.md, "Long prompts")."""
