"""RoPE helpers: rotate, un-rotate and pre-RoPE query statistics.

In the HF Llama / Qwen2 / Mistral layout dims ``i`` and ``i + D/2`` form one pair, rotated by the angle
``pos * inv_freq[i]`` and multiplied by ``attention_scaling``. Seen as a complex number
``z_i = x[i] + 1j * x[i + D/2]`` (:func:`to_complex`) the rotation is ``z_i * exp(1j * pos * inv_freq[i])``,
so for a query at ``t`` and a key at ``p`` (both pre-RoPE, scaling 1)::

    q_rot . k_rot = sum_i Re(q_i * conj(k_i) * exp(1j * inv_freq[i] * (t - p)))

which is what the ``trig`` eviction score (``moend_fx.eviction.scorers.trig``) averages over future ``t``.

Angles are computed exactly as HF does (float32 ``pos * inv_freq``, cos/sin in float32), so
:func:`apply_rope` reproduces the model's rotated keys and :func:`invert_rope` undoes them.

Other families (``moend_fx.eviction.rope_layout``): partial rotary embeddings (Phi-2, StableLM, GPT-NeoX) rotate only
the first ``2 * len(inv_freq)`` channels (``pass_dims`` more pass through), and Cohere pairs ``2i`` with ``2i + 1``
(``layout="interleaved"``). A :class:`RopeSpec` maps any of them onto the canonical order above over the whole head
(:meth:`RopeSpec.to_canonical`; passed-through channels as frequency-0 pairs), where every formula here holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from moend_fx.common.errors import MoendError
from moend_fx.eviction.rope_layout import ROPE_LAYOUTS, find_rotary, head_dim_of, pair_index, rope_layout_of


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one model: ``inv_freq`` (one float per rotated pair), HF's ``attention_scaling``, the
    pairing of rotated channels (``layout``: "rotate_half" or "interleaved") and ``pass_dims``, the channels after
    the rotated ones that RoPE leaves alone (partial rotary; 0 when the whole head rotates)."""

    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    layout: str = "rotate_half"
    pass_dims: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.inv_freq, torch.Tensor):
            object.__setattr__(self, "inv_freq", tuple(float(v) for v in self.inv_freq.flatten().tolist()))
        else:
            object.__setattr__(self, "inv_freq", tuple(float(v) for v in self.inv_freq))
        if len(self.inv_freq) == 0:
            raise MoendError("RopeSpec.inv_freq is empty; expected head_dim / 2 frequencies")
        if not all(math.isfinite(v) and v >= 0 for v in self.inv_freq):
            raise MoendError("RopeSpec.inv_freq must be finite and >= 0")
        if not (math.isfinite(self.attention_scaling) and self.attention_scaling > 0):
            raise MoendError(f"RopeSpec.attention_scaling={self.attention_scaling!r}; must be finite and > 0")
        if self.layout not in ROPE_LAYOUTS:
            raise MoendError(f"RopeSpec.layout={self.layout!r} is not supported; allowed: {list(ROPE_LAYOUTS)}")
        pair_index(len(self.inv_freq), self.pass_dims, self.layout)  # checks pass_dims

    @property
    def head_dim(self) -> int:
        return 2 * len(self.inv_freq) + self.pass_dims

    @property
    def canonical(self) -> bool:
        """Whether the model's channel order is already the canonical one (full rotate_half RoPE)."""
        return self.pass_dims == 0 and self.layout == "rotate_half"

    def to_canonical(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] in the model's channel order -> the canonical order (module docstring); x itself if equal."""
        if self.canonical:
            return x
        return x[..., torch.tensor(pair_index(len(self.inv_freq), self.pass_dims, self.layout), device=x.device)]

    def from_canonical(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_canonical`: x [..., D] canonical -> the model's channel order."""
        if self.canonical:
            return x
        index = torch.tensor(pair_index(len(self.inv_freq), self.pass_dims, self.layout), device=x.device)
        return x[..., torch.argsort(index)]

    def pair_freq_tensor(self, device: Any = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The frequency of every canonical pair: [D/2], ``inv_freq`` then 0 for the passed-through pairs."""
        freq = torch.tensor(self.inv_freq + (0.0,) * (self.pass_dims // 2), dtype=torch.float32)
        return freq.to(device=device, dtype=dtype)

    def pair_scaling(self, device: Any = None, dtype: torch.dtype = torch.float64) -> torch.Tensor | float:
        """``attention_scaling`` of every canonical pair ([D/2]; 1 for passed-through pairs, which HF does not
        scale), or the plain float when every pair rotates."""
        if not self.pass_dims:
            return self.attention_scaling
        scale = (self.attention_scaling,) * len(self.inv_freq) + (1.0,) * (self.pass_dims // 2)
        return torch.tensor(scale, dtype=dtype, device=device)

    def inv_freq_tensor(self, device: Any = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """inv_freq as a tensor: [D/2]. Built on each call (eviction is rare) rather than held, so a cache that keeps
        a RopeSpec keeps no tensor for it; float32 first, like HF's rotary module, so the angles match the model's
        bit for bit."""
        return torch.tensor(self.inv_freq, dtype=torch.float32).to(device=device, dtype=dtype)

    @classmethod
    def default(cls, head_dim: int, theta: float = 10000.0) -> RopeSpec:
        """Plain RoPE (``theta ** (-2i/D)``), as HF's default rope type computes it."""
        if head_dim <= 0 or head_dim % 2:
            raise MoendError(f"head_dim={head_dim!r}; must be a positive even number")
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return cls(tuple(inv.tolist()))


def rope_from_model(model: Any) -> RopeSpec:
    """Read the RoPE of an HF model from its rotary module, wherever the family keeps it (``model.model.rotary_emb``,
    GPT-NeoX's ``model.gpt_neox.rotary_emb``, ...: :func:`~moend_fx.eviction.rope_layout.find_rotary`); a rotary
    module narrower than the heads is a partial rotary embedding (``pass_dims``), and the family table gives the
    pairing (``layout``)."""
    found = find_rotary(model)
    rot = None if found is None else found[1]
    # Per-layer-type RoPE (Gemma 2 / 3: ``sliding_attention_inv_freq`` and ``full_attention_inv_freq``): only the
    # full-attention layers evict (a sliding layer keeps its whole window, moend_fx.cache.sliding), so theirs.
    if rot is not None and not hasattr(rot, "inv_freq") and hasattr(rot, "full_attention_inv_freq"):
        inv, scaling = rot.full_attention_inv_freq, getattr(rot, "full_attention_attention_scaling", 1.0)
    elif rot is None or not isinstance(getattr(rot, "inv_freq", None), torch.Tensor):
        raise MoendError(
            f"model {type(model).__name__} has no rotary embedding (no submodule with an inv_freq buffer, such as "
            "model.model.rotary_emb); the trig scorer needs RoPE: pick a scorer that does not (e.g. scorer='snapkv')"
        )
    else:
        inv, scaling = rot.inv_freq, getattr(rot, "attention_scaling", 1.0)
    inv = tuple(inv.detach().float().cpu().tolist())
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    head_dim = head_dim_of(cfg) if cfg is not None and hasattr(cfg, "num_attention_heads") else 2 * len(inv)
    return RopeSpec(inv, float(scaling), rope_layout_of(model), pass_dims=head_dim - 2 * len(inv))


def _cos_sin(positions: torch.Tensor, spec: RopeSpec, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [..., T, D/2] float32 for positions [..., T]."""
    freqs = positions.to(device=device).float()[..., None] * spec.pair_freq_tensor(device)
    return freqs.cos(), freqs.sin()


def _check(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    if x.dim() < 2:
        raise MoendError(f"RoPE input must be [..., T, D]; got shape {tuple(x.shape)}")
    if x.shape[-1] != spec.head_dim:
        raise MoendError(f"RoPE input head_dim {x.shape[-1]} != spec head_dim {spec.head_dim}")
    if positions.shape[-1] != x.shape[-2]:
        raise MoendError(f"positions {tuple(positions.shape)} must end in T={x.shape[-2]} (input {tuple(x.shape)})")
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise MoendError(f"positions must be an integer tensor; got {positions.dtype}")
    pos = positions
    # [B, T] positions broadcast over the head dim of [B, H, T, D] inputs, as HF's unsqueeze_dim=1
    if pos.dim() == 2 and x.dim() == 4:
        pos = pos[:, None, :]
    return pos


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate pre-RoPE ``x`` as HF does.

    x: [..., T, D]; positions: [T], [B, T] (broadcast over heads of a [B, H, T, D] input) or [..., T]
    matching x's leading dims. Returns [..., T, D] in x's dtype.
    """
    pos = _check(x, positions, spec)
    cos, sin = _cos_sin(pos, spec, x.device)
    scale = spec.pair_scaling(x.device, torch.float32)
    cos, sin = cos * scale, sin * scale
    # HF casts cos/sin to the input dtype before the multiply; do the same for bit-identical keys
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return spec.from_canonical(_rotate(spec.to_canonical(x), cos, sin))


def invert_rope(x_rot: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Exact inverse of :func:`apply_rope` (up to float rounding): rotate back and undo the scaling.

    x_rot: [..., T, D]; positions as in :func:`apply_rope`. Computed in float32 (float64 inputs stay
    float64); returns x_rot's dtype.
    """
    pos = _check(x_rot, positions, spec)
    work = torch.float64 if x_rot.dtype == torch.float64 else torch.float32
    cos, sin = _cos_sin(pos, spec, x_rot.device)
    cos, sin = cos.to(work), sin.to(work)
    scale = spec.pair_scaling(x_rot.device, work)
    if isinstance(scale, torch.Tensor):
        scale = torch.cat((scale, scale))  # canonical order: the real halves, then the imaginary ones
    out = _rotate(spec.to_canonical(x_rot.to(work)), cos, -sin) / scale
    return spec.from_canonical(out).to(x_rot.dtype)


def to_complex(x: torch.Tensor, spec: RopeSpec | None = None) -> torch.Tensor:
    """Pair dims (i, i + D/2) into complex numbers: x [..., D] real -> [..., D/2] complex; with ``spec``, the pairs
    of its canonical order (:meth:`RopeSpec.to_canonical`), so that a partial or interleaved RoPE pairs right."""
    if x.shape[-1] % 2:
        raise MoendError(f"to_complex needs an even last dim; got {x.shape[-1]}")
    if spec is not None:
        x = spec.to_canonical(x)
    h = x.shape[-1] // 2
    x = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return torch.complex(x[..., :h], x[..., h:])

