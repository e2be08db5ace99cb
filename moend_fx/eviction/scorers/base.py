"""The scorer interface: one frozen dataclass per scorer with one method to implement (kvpress style).

``score(keys, values, *, queries=None, key_positions, query_positions=None) -> [B, Hkv, T] float32``, higher =
more worth keeping. Shapes:

* keys, values: [B, Hkv, T, D] post-RoPE, as stored in the HF cache (values may have another last dim).
* queries: [B, H, W, D] post-RoPE queries of the last W tokens, H = Hkv * group. Query head ``h`` reads
  KV head ``h // group`` (HF ``repeat_kv`` order).
* key_positions: [B, Hkv, T] int64 original positions (not contiguous after an earlier eviction);
  [T] and [B, T] are broadcast.
* query_positions: [B, W] (or [W]) int64.

Options are dataclass fields, checked in ``__post_init__``. A scorer says itself whether it reads queries
(:attr:`Scorer.needs_queries`: a cache layer keeps a window of recent queries only for those that do) and what
it takes from the layer it scores for (:meth:`Scorer.layer_options`: the RoPE, calibrated statistics, the
query window), so neither the cache nor calibration branches on scorer names. A scorer that reads keys only
subclasses :class:`KeysOnlyScorer` and implements ``score_keys(keys, key_positions)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moend_fx.common.options import Setting
from moend_fx.eviction.query_stats import QueryStats
from moend_fx.eviction.rope import RopeSpec
from moend_fx.eviction.scorers.inputs import as_key_positions, check_keys

Tensor = torch.Tensor


@dataclass(frozen=True)
class Scorer:
    """Base: subclasses set ``name`` and implement :meth:`score`."""

    name: ClassVar[str] = ""
    # the setting it is made for: query_aware scorers read the prompt's last queries (the question, when the
    # prompt ends with it); query_agnostic ones score without knowing what will be asked
    setting: ClassVar[str] = Setting.QUERY_AGNOSTIC

    @property
    def needs_queries(self) -> bool:
        """Whether :meth:`score` reads ``queries``. True unless a scorer says otherwise."""
        return True

    @property
    def decode_queries(self) -> bool:
        """Whether it reads queries at a decode-time re-eviction too (then the layer keeps its window after the
        prompt); :attr:`needs_queries` by default. False: the window is dropped once the prompt is compressed."""
        return self.needs_queries

    @classmethod
    def reads_queries(cls, *, calibrated: bool) -> bool:
        """Whether a scorer of this class built for a layer reads queries (so the layer keeps a query window);
        ``calibrated``: the layer has calibrated query statistics. What the memory model prices a plan by; an
        instance's :attr:`decode_queries` agrees (what a layer keeps once its prompt is compressed)."""
        return True

    @classmethod
    def state_bytes(cls, *, num_heads: int, head_dim: int, calibrated: bool) -> int:
        """Bytes of the tensors a scorer of this class holds for one layer (not counting the query window), for
        a model with ``num_heads`` query heads of ``head_dim``; :meth:`nbytes` of an instance agrees."""
        return 0

    @property
    def calibrated(self) -> bool:
        """Whether this scorer holds calibrated query statistics (what :meth:`state_bytes` is asked about)."""
        return False

    def nbytes(self) -> int:
        """Bytes of the tensors this scorer holds (a cache layer that holds it keeps them alive)."""
        return 0

    @classmethod
    def layer_options(cls, *, rope: RopeSpec | None, stats: QueryStats | None, query_window: int) -> dict[str, Any]:
        """The options this scorer is built with for one cache layer (and for calibration, which must score the
        same way), from that layer's RoPE, calibrated query ``stats`` and ``query_window``. Default: none."""
        return {}

    def score(self, keys: Tensor, values: Tensor, *, queries: Tensor | None = None, key_positions: Tensor,
              query_positions: Tensor | None = None) -> Tensor:
        """Scores [B, Hkv, T] float32 of keys [B, Hkv, T, D] (shapes as in the module docstring)."""
        raise NotImplementedError


@dataclass(frozen=True)
class KeysOnlyScorer(Scorer):
    """A scorer that reads keys and their positions only (never queries): implement :meth:`score_keys`."""

    @property
    def needs_queries(self) -> bool:
        return False

    @classmethod
    def reads_queries(cls, *, calibrated: bool) -> bool:
        return False

    def score(self, keys: Tensor, values: Tensor, *, queries: Tensor | None = None, key_positions: Tensor,
              query_positions: Tensor | None = None) -> Tensor:
        """keys, values: [B, Hkv, T, D]; key_positions: [B, Hkv, T] ([T], [B, T] broadcast); queries and
        query_positions are not read. Returns :meth:`score_keys` [B, Hkv, T] float32."""
        check_keys(keys, values)
        return self.score_keys(keys, as_key_positions(key_positions, keys.shape))

    def score_keys(self, keys: Tensor, key_positions: Tensor) -> Tensor:
        """Scores [B, Hkv, T] float32 of checked keys [B, Hkv, T, D] at key_positions [B, Hkv, T] int64."""
        raise NotImplementedError
