"""Model steps of the evaluation: tokenising, the query-recording attention hook, prefill and greedy decode."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from moend_fx.cache.hf_attention import moend_attention
from moend_fx.common.errors import MoendError
from moend_fx.eval.methods import (
    PrefillState,
)
from moend_fx.eval.tasks.registry import Example, candidates

EVAL_ATTN = "moend_eval"


# --------------------------------------------------------------------------------------------- tokens


def encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    """Token ids of ``text`` (``special``: add the tokenizer's special tokens, as for a prompt's start)."""
    if callable(tokenizer):
        ids = tokenizer(text, add_special_tokens=special)["input_ids"]
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)
    if hasattr(tokenizer, "encode"):
        return list(tokenizer.encode(text))
    raise MoendError(f"tokenizer {type(tokenizer).__name__} has neither __call__ nor encode")


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


# --------------------------------------------------------------------------------------------- attention hook


class QueryRecorder:
    """Keeps the last ``window`` post-RoPE queries [B, H, W, D] of every layer across forward chunks."""

    def __init__(self, num_layers: int, window: int, initial: Sequence[torch.Tensor | None] | None = None):
        self.window = window
        self.q: list[torch.Tensor | None] = list(initial) if initial is not None else [None] * num_layers

    def record(self, layer: int, query: torch.Tensor) -> None:
        q = query[:, :, -self.window:].detach()
        prev = self.q[layer]
        if prev is not None and q.shape[2] < self.window:
            q = torch.cat([prev, q], dim=2)[:, :, -self.window:]
        self.q[layer] = q


_RECORDER: QueryRecorder | None = None


def eval_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The "moend" attention function (SDPA for plain caches, packed attention for MoENDCache) that also
    records the queries of a prefill when a :class:`QueryRecorder` is active. query: [B, H, L, D]."""
    if _RECORDER is not None:
        _RECORDER.record(module.layer_idx, query)
    if "moend_layer" not in kwargs and attention_mask is not None and query.shape[2] > BAND_ROWS:
        return banded_attention(module, query, key, value, attention_mask, **kwargs)
    return moend_attention(module, query, key, value, attention_mask, **kwargs)


# Query rows per block of :func:`banded_attention`.
BAND_ROWS = 512


def banded_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA of query: [B, H, L, D] over key, value: [B, Hkv, S, D] under the bool mask [B, 1, L, S] (True = may
    attend), :data:`BAND_ROWS` query rows at a time, each block over only the key columns its rows may attend
    (from the first to the last True column of the block's mask rows). A column no row of the block may attend
    adds exp(-inf) = 0 to each row's softmax, so leaving it out changes nothing but the order of the sums; what it
    saves is a sliding layer's prefill: a 16k-token prompt's window of 512 makes each block's span ~1k columns
    instead of 16k (the dense mask SDPA's math path runs over every column otherwise). Returns ([B, L, H, D], None)
    as ``moend_attention``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return moend_attention(module, query, key, value, attention_mask, **kwargs)
    outs = []
    n_q = query.shape[2]
    for r0 in range(0, n_q, BAND_ROWS):
        rows = attention_mask[:, :, r0:r0 + BAND_ROWS]
        cols = rows.any(dim=2).any(dim=1).any(dim=0).nonzero()  # every column some row of the block may attend
        c0, c1 = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, key.shape[2])
        out, _ = sdpa_attention_forward(module, query[:, :, r0:r0 + BAND_ROWS], key[:, :, c0:c1], value[:, :, c0:c1],
                                        rows[..., c0:c1], **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


def register_eval_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EVAL_ATTN, eval_attention)
    AttentionMaskInterface.register(EVAL_ATTN, sdpa_mask)


register_eval_attention()


@contextmanager
def eval_attention_on(model: Any, attention: str = EVAL_ATTN) -> Iterator[None]:
    """Run ``model`` with the registered ``attention`` (default "moend_eval") inside the block (restored after;
    no-op if already on)."""
    prev = model.config._attn_implementation
    if prev == attention:
        yield
        return
    model.set_attn_implementation(attention)
    try:
        yield
    finally:
        model.set_attn_implementation(prev)


# --------------------------------------------------------------------------------------------- model steps


def model_device(model: Any) -> torch.device:
    """Where the model's parameters are (inputs are built there)."""
    return next(model.parameters()).device


@torch.inference_mode()
def prefill(model: Any, ids: Sequence[int], *, window: int = 32, base: PrefillState | None = None) -> PrefillState:
    """Full-precision prefill of ``ids`` (after ``base``'s tokens, if given) into a new :class:`PrefillState`.

    Every layer's K/V is kept whole, sliding-window layers included: the prefill runs through a cache of plain
    ``DynamicLayer``s (no config), while the model still builds each layer's mask from its own config (a sliding
    layer's queries see only their window), so the attention is the model's and each method then cuts its own
    cache from the same tokens (the full method's sliding layers keep their window, as ``DynamicCache(config)``
    would: :func:`moend_fx.eval.methods.build_cache`)."""
    from transformers import DynamicCache

    global _RECORDER
    if not ids:
        raise MoendError("nothing to prefill: the token list is empty")
    # no config: a DynamicCache(config=...) would keep only the window on a sliding layer, and the layers of one
    # state must all hold the same tokens (MoENDCache.from_prefill, build_cache)
    cache = DynamicCache(ddp_cache_data=base.kv) if base is not None else DynamicCache()
    n_layers = model.config.num_hidden_layers
    _RECORDER = QueryRecorder(n_layers, window, base.queries if base is not None else None)
    try:
        with eval_attention_on(model):
            model(input_ids=torch.tensor([list(ids)], device=model_device(model)), cache=cache, use_cache=True,
                  logits_to_keep=1)
        queries = _RECORDER.q
    finally:
        _RECORDER = None
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    return PrefillState(kv, queries, kv[0][0].shape[2])


def _extends(match: str, ch: str) -> bool:
    """Whether character ``ch`` could continue the answer-shaped string it ends."""
    return ch.isdigit() if match == "number" else ch.isalpha()


def stop_reason(example: Example, text: str) -> str | None:
    """Why decoding may stop after ``text`` (None = go on): a newline once the answer started, or every
    expected answer-shaped string complete (strict scoring reads only those)."""
    if "\n" in text.lstrip():
        return "newline"
    if text and len(candidates(example, text)) >= len(example.answers) and not _extends(example.match, text[-1]):
        return "answers"
    return None


@torch.inference_mode()
def greedy_decode(model: Any, cache: Any, suffix_ids: Sequence[int], max_new_tokens: int, *,
                  tokenizer: Any = None, stop: Callable[[str], str | None] | None = None,
                  eos_token_id: int | None = None, attention: str = EVAL_ATTN,
                  after_step: Callable[[], None] | None = None) -> tuple[list[int], str]:
    """Feed ``suffix_ids`` through ``cache`` then decode greedily with the registered ``attention``. Returns
    (new token ids, stop reason: "eos", "max_new_tokens" or what ``stop(decoded text)`` said). ``after_step``
    is called after every forward pass (the suffix's, then each fed token's), e.g. to track the cache's peak
    bytes (:class:`moend_fx.eval.peak_bytes.PeakBytes`)."""
    dev = model_device(model)
    ids = torch.tensor([list(suffix_ids)], device=dev)
    out: list[int] = []
    for _ in range(max_new_tokens):
        with eval_attention_on(model, attention):
            logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        if after_step is not None:
            after_step()
        nxt = int(logits[0, -1].argmax())
        if eos_token_id is not None and nxt == eos_token_id:
            return out, "eos"
        out.append(nxt)
        if stop is not None:
            why = stop(decode(tokenizer, out))
            if why:
                return out, why
        ids = torch.tensor([[nxt]], device=dev)
    return out, "max_new_tokens"
