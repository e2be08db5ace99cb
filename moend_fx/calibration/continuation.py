"""End-to-end loss of a plan on one sequence: KL of the next-token distributions of a teacher-forced continuation.

The context is prefilled once at full precision, capturing every layer's K/V and last-``window`` queries (the
prefill itself is never compressed, as in the cache). For a plan, each layer's context K/V is compressed as
the cache does (the table's scorer and statistics, ``keep_count`` tokens per KV head: sinks, recent window,
best scores; :class:`~moend_fx.storage.packed.PackedKV` quantization, dequantized), and the continuation
tokens (positions ``T .. T+M-1``) run through the model attending to the compressed context plus, causally,
their own K/V at full precision: decoding the continuation against the compressed prefill cache with teacher
forcing, except that the new tokens stay unquantized and no re-eviction happens (M <= 128). The measured loss
is the mean over continuation positions of ``KL(p_full || p_plan)``.

Used by the proxy validation (:mod:`moend_fx.eval.proxy`), the measured plan search (:mod:`moend_fx.search`)
and calibration's per-layer gains (:mod:`moend_fx.calibration.gains`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from moend_fx.attention.reference import attention_dense
from moend_fx.calibration.capture import AttentionCapture, LayerCapture, attention_override
from moend_fx.calibration.prefill import kept_tokens, model_body
from moend_fx.calibration.sensitivity import SensitivityTable
from moend_fx.common.defaults import RECENT_TOKENS, SINK_TOKENS
from moend_fx.common.options import ScorerName
from moend_fx.eviction.rope import rope_from_model
from moend_fx.eviction.scorers import build_scorer
from moend_fx.plan.routing import LayerConfig
from moend_fx.storage.packed import PackedKV

__all__ = ["ContinuationKL", "compressed_kv", "continuation_logits"]


def compressed_kv(cap: LayerCapture, config: LayerConfig, scores: torch.Tensor | None, *, group_size: int,
                  sink_tokens: int, recent_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The context K, V [B, Hkv, n, D] a layer with ``config`` holds after the prefill, dequantized."""
    k, v, pos = kept_tokens(cap, scores, config.keep_ratio, sink_tokens, recent_tokens)
    if not config.quantized:
        return k, v
    if pos is None:  # a context no longer than the keep floor: nothing was evicted, the same codes as keep 1.0
        config = LayerConfig(1.0, config.k_bits, config.v_bits)
    return PackedKV.from_dense(k, v, config, group_size, pos).dequantize(k.dtype)


def continuation_logits(model: Any, cont_ids: torch.Tensor, start: int,
                        kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Logits [B, M, V] of cont_ids [B, M] at positions start.. attending to per-layer context ``kv`` + itself."""

    def attend(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
               scaling: float | None = None, **kw: Any) -> tuple[torch.Tensor, None]:
        k0, v0 = kv[int(module.layer_idx)]
        # the M new queries are the newest M of the n + M keys: bottom-right causal mask
        out = attention_dense(q, torch.cat([k0, k], 2), torch.cat([v0, v], 2), scale=scaling,
                              causal_chunk=True)
        return out.transpose(1, 2).contiguous(), None

    m = cont_ids.shape[1]
    pos = torch.arange(start, start + m, device=cont_ids.device)[None].expand(cont_ids.shape[0], m)
    with attention_override(model, attend):
        return model(input_ids=cont_ids, position_ids=pos, use_cache=False).logits


class ContinuationKL:
    """One token sequence, its ``context`` prefilled at full precision: per-layer captures and eviction scores,
    and the reference log-probs of the rest (the continuation). :meth:`kl` measures a plan against them."""

    def __init__(self, model: Any, table: SensitivityTable, ids: torch.Tensor, context: int, window: int):
        self.model = model
        self.table = table
        self.context = context
        cal = table.calibration
        self.group_size = table.group_size
        self.sink = int(cal.get("sink_tokens", SINK_TOKENS))
        self.recent = int(cal.get("recent_tokens", RECENT_TOKENS))
        scorer_name = str(cal.get("scorer", ScorerName.TRIG))
        device = next(model.parameters()).device
        self.cont = ids[None, context:].to(device)
        cap = AttentionCapture(model, window=window)
        with torch.no_grad(), cap:
            model_body(model)(input_ids=ids[None, :context].to(device), use_cache=False)
        self.layers = [cap.pop(l) for l in range(table.num_layers)]
        # Built as calibration builds it (build_scorer takes what each scorer needs: trig and snapkv_trig the
        # RoPE and the calibrated statistics, snapkv its default observation window).
        rope = rope_from_model(model)
        self.scores: list[torch.Tensor] = []
        with torch.no_grad():
            for l, c in enumerate(self.layers):
                stats = table.layer_stats(l) if table.has_stats() else None
                scorer = build_scorer(scorer_name, rope, stats)
                b, hkv, t, _ = c.keys.shape
                kp = c.key_positions[:, None, :].expand(b, hkv, t)
                self.scores.append(scorer.score(c.keys, c.values, queries=c.queries, key_positions=kp,
                                                query_positions=c.query_positions))
        lossless = LayerConfig(1.0, 16, 16)
        self.decoder_layers = list(getattr(model_body(model), "layers", []))
        self.outputs: list[Any] = []  # each decoder layer's output in the full-precision continuation
        hooks = [layer.register_forward_hook(lambda _m, _a, out: self.outputs.append(out))
                 for layer in self.decoder_layers]
        try:
            self.ref_logp = self.log_probs((lossless,) * table.num_layers)
        finally:
            for h in hooks:
                h.remove()
        if len(self.outputs) != len(self.decoder_layers):
            self.decoder_layers, self.outputs = [], []  # not one call per layer: replay nothing

    def log_probs(self, layers: tuple[LayerConfig, ...]) -> torch.Tensor:
        """log p [M, V] float64 of the continuation under a plan."""
        with torch.no_grad(), self._replayed(layers):
            kv = [compressed_kv(c, cfg, s, group_size=self.group_size, sink_tokens=self.sink,
                                recent_tokens=self.recent)
                  for c, cfg, s in zip(self.layers, layers, self.scores)]
            logits = continuation_logits(self.model, self.cont, self.context, kv)
        return torch.log_softmax(logits[0].double(), dim=-1)

    @contextmanager
    def _replayed(self, layers: tuple[LayerConfig, ...]) -> Iterator[None]:
        """Within: the decoder layers before the plan's first lossy one return their recorded full-precision
        outputs instead of running. They hold the same K/V as in the reference pass and see the same input, so
        their outputs are the same, bit for bit; skipping them makes a one-layer probe (calibration's gains)
        ~2x cheaper on average."""
        first = next((i for i, c in enumerate(layers) if not c.lossless), len(layers))
        skipped = self.decoder_layers[: min(first, len(self.outputs))]
        for layer, out in zip(skipped, self.outputs):
            layer.forward = lambda *_a, _out=out, **_k: _out
        try:
            yield
        finally:
            for layer in skipped:
                del layer.forward

    def kl(self, layers: tuple[LayerConfig, ...]) -> float:
        """Mean over continuation positions of KL(p_full || p_plan)."""
        lp = self.log_probs(layers)
        kl = (self.ref_logp.exp() * (self.ref_logp - lp)).sum(dim=-1)
        return float(kl.mean())
