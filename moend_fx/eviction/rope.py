"""RoPE helpers: rotate, un-rotate and pre-RoPE query statistics (HF "rotate_half" layout).

In the HF Llama / Qwen2 / Mistral layout dims ``i`` and ``i + D/2`` form one pair, rotated by the angle
``pos * inv_freq[i]`` and multiplied by ``attention_scaling``. Seen as a complex number
``z_i = x[i] + 1j * x[i + D/2]`` (:func:`to_complex`) the rotation is ``z_i * exp(1j * pos * inv_freq[i])``,
so for a query at ``t`` and a key at ``p`` (both pre-RoPE, scaling 1)::

    q_rot . k_rot = sum_i Re(q_i * conj(k_i) * exp(1j * inv_freq[i] * (t - p)))

which is what the ``trig`` eviction score (``moend_fx.eviction.scorers.trig``) averages over future ``t``.

Angles are computed exactly as HF does (float32 ``pos * inv_freq``, cos/sin in float32), so
:func:`apply_rope` reproduces the model's rotated keys and :func:`invert_rope` undoes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from moend_fx.common.errors import MoendError


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one model: ``inv_freq`` ([D/2] floats) and HF's ``attention_scaling``."""

    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    layout: str = "rotate_half"

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
        if self.layout != "rotate_half":
            raise MoendError(f"RopeSpec.layout={self.layout!r} is not supported; allowed: ['rotate_half']")

    @property
    def head_dim(self) -> int:
        return 2 * len(self.inv_freq)

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
    """Read the RoPE of an HF Llama-family model from ``model.model.rotary_emb`` (or ``model.rotary_emb``)."""
    rot = None
    for owner in (getattr(model, "model", None), model):
        rot = getattr(owner, "rotary_emb", None) if owner is not None else None
        if rot is not None:
            break
    # Per-layer-type RoPE (Gemma 2 / 3: ``sliding_attention_inv_freq`` and ``full_attention_inv_freq``): only the
    # full-attention layers evict (a sliding layer keeps its whole window, moend_fx.cache.sliding), so theirs.
    if rot is not None and not hasattr(rot, "inv_freq") and hasattr(rot, "full_attention_inv_freq"):
        inv = rot.full_attention_inv_freq.detach().float().cpu()
        return RopeSpec(tuple(inv.tolist()), float(getattr(rot, "full_attention_attention_scaling", 1.0)))
    if rot is None or not hasattr(rot, "inv_freq"):
        raise MoendError(
            f"model {type(model).__name__} has no rotary embedding at model.model.rotary_emb.inv_freq; "
            "only RoPE models in the HF rotate_half layout (Llama, Qwen2, Mistral) are supported"
        )
    inv = rot.inv_freq.detach().float().cpu()
    return RopeSpec(tuple(inv.tolist()), float(getattr(rot, "attention_scaling", 1.0)))


def _cos_sin(positions: torch.Tensor, spec: RopeSpec, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [..., T, D/2] float32 for positions [..., T]."""
    freqs = positions.to(device=device).float()[..., None] * spec.inv_freq_tensor(device)
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
    cos, sin = cos * spec.attention_scaling, sin * spec.attention_scaling
    # HF casts cos/sin to the input dtype before the multiply; do the same for bit-identical keys
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return _rotate(x, cos, sin)


def invert_rope(x_rot: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Exact inverse of :func:`apply_rope` (up to float rounding): rotate back and undo the scaling.

    x_rot: [..., T, D]; positions as in :func:`apply_rope`. Computed in float32 (float64 inputs stay
    float64); returns x_rot's dtype.
    """
    pos = _check(x_rot, positions, spec)
    work = torch.float64 if x_rot.dtype == torch.float64 else torch.float32
    cos, sin = _cos_sin(pos, spec, x_rot.device)
    cos, sin = cos.to(work), sin.to(work)
    out = _rotate(x_rot.to(work), cos, -sin) / spec.attention_scaling
    return out.to(x_rot.dtype)


def to_complex(x: torch.Tensor) -> torch.Tensor:
    """Pair dims (i, i + D/2) into complex numbers: x [..., D] real -> [..., D/2] complex."""
    if x.shape[-1] % 2:
        raise MoendError(f"to_complex needs an even last dim; got {x.shape[-1]}")
    h = x.shape[-1] // 2
    x = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return torch.complex(x[..., :h], x[..., h:])


@dataclass
class QueryStats:
    """Streaming per-head statistics of one layer's PRE-RoPE queries.

    Holds sums so that calibration can stream sequences and merge workers: ``sum`` [H, D/2, 2]
    (real and imaginary parts of the summed complex query, float64), ``abs_sum`` [H, D/2] (summed
    magnitude per frequency, float64) and ``count`` (queries seen per head). ``mean`` and ``abs_mean``
    give the complex mean ``qbar_f`` and ``E|q_f|`` the ``trig`` scorer uses.
    """

    sum: torch.Tensor
    abs_sum: torch.Tensor
    count: int = 0

    def __post_init__(self) -> None:
        if self.sum.dim() != 3 or self.sum.shape[-1] != 2:
            raise MoendError(f"QueryStats.sum must be [H, D/2, 2]; got {tuple(self.sum.shape)}")
        if tuple(self.abs_sum.shape) != tuple(self.sum.shape[:2]):
            raise MoendError(
                f"QueryStats.abs_sum {tuple(self.abs_sum.shape)} must be [H, D/2] = {tuple(self.sum.shape[:2])}"
            )
        if int(self.count) < 0:
            raise MoendError(f"QueryStats.count={self.count!r}; must be >= 0")
        self.sum = self.sum.detach().to(torch.float64)
        self.abs_sum = self.abs_sum.detach().to(torch.float64)
        self.count = int(self.count)

    @classmethod
    def empty(cls, num_heads: int, head_dim: int) -> QueryStats:
        if num_heads <= 0 or head_dim <= 0 or head_dim % 2:
            raise MoendError(f"QueryStats.empty({num_heads}, {head_dim}): heads > 0, head_dim even > 0")
        f = head_dim // 2
        return cls(torch.zeros(num_heads, f, 2, dtype=torch.float64), torch.zeros(num_heads, f, dtype=torch.float64))

    @property
    def num_heads(self) -> int:
        return self.sum.shape[0]

    @property
    def head_dim(self) -> int:
        return 2 * self.sum.shape[1]

    @staticmethod
    def bytes_for(num_heads: int, head_dim: int) -> int:
        """Bytes a QueryStats of ``num_heads`` heads holds: ``sum`` [H, D/2, 2] and ``abs_sum`` [H, D/2] float64."""
        return num_heads * (head_dim // 2) * 3 * 8

    def nbytes(self) -> int:
        """Bytes of its tensors (what a scorer that holds these statistics keeps alive)."""
        return sum(t.numel() * t.element_size() for t in (self.sum, self.abs_sum))

    def accumulate(self, q_pre: torch.Tensor, mask: torch.Tensor | None = None) -> QueryStats:
        """Add pre-RoPE queries in place and return self.

        q_pre: [B, H, T, D]; mask: optional [B, T] bool (True = a real token; padding is skipped).
        """
        if q_pre.dim() != 4 or q_pre.shape[1] != self.num_heads or q_pre.shape[-1] != self.head_dim:
            raise MoendError(f"q_pre must be [B, H={self.num_heads}, T, D={self.head_dim}]; got {tuple(q_pre.shape)}")
        z = to_complex(q_pre.detach().to(torch.float64))  # [B, H, T, F]
        if mask is not None:
            if tuple(mask.shape) != (q_pre.shape[0], q_pre.shape[2]):
                raise MoendError(f"mask must be [B, T] = {(q_pre.shape[0], q_pre.shape[2])}; got {tuple(mask.shape)}")
            w = mask.to(device=z.device, dtype=torch.float64)[:, None, :, None]
            n = int(mask.sum())
        else:
            w = torch.ones((), dtype=torch.float64, device=z.device)
            n = q_pre.shape[0] * q_pre.shape[2]
        s = (z * w).sum(dim=(0, 2)).cpu()  # [H, F]
        self.sum += torch.stack((s.real, s.imag), dim=-1)
        self.abs_sum += (z.abs() * w).sum(dim=(0, 2)).cpu()
        self.count += n
        return self

    def accumulate_rotated(
        self, q_rot: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, mask: torch.Tensor | None = None
    ) -> QueryStats:
        """Un-rotate post-RoPE queries q_rot [B, H, T, D] at positions ([T] or [B, T]) and accumulate."""
        return self.accumulate(invert_rope(q_rot.to(torch.float64), positions, spec), mask)

    def merge(self, other: QueryStats) -> QueryStats:
        """A new QueryStats holding both sets of queries."""
        if self.sum.shape != other.sum.shape:
            raise MoendError(f"cannot merge QueryStats of shapes {tuple(self.sum.shape)} and {tuple(other.sum.shape)}")
        return QueryStats(self.sum + other.sum, self.abs_sum + other.abs_sum, self.count + other.count)

    def _need_data(self) -> None:
        if self.count == 0:
            raise MoendError("QueryStats is empty (count=0): accumulate queries before reading means")

    @property
    def mean(self) -> torch.Tensor:
        """Complex mean pre-RoPE query per head and frequency, qbar: [H, D/2] complex128."""
        self._need_data()
        s = self.sum / self.count
        return torch.complex(s[..., 0], s[..., 1])

    @property
    def abs_mean(self) -> torch.Tensor:
        """Mean magnitude per head and frequency, E|q_f|: [H, D/2] float64."""
        self._need_data()
        return self.abs_sum / self.count

    def to_tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Plain tensors for safetensors: ``{prefix}sum`` [H, D/2, 2], ``{prefix}abs_sum`` [H, D/2] (float64),
        ``{prefix}count`` [] int64."""
        return {
            f"{prefix}sum": self.sum.clone(),
            f"{prefix}abs_sum": self.abs_sum.clone(),
            f"{prefix}count": torch.tensor(self.count, dtype=torch.int64),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, Any], prefix: str = "") -> QueryStats:
        """Inverse of :meth:`to_tensors` (numpy arrays are accepted too)."""
        keys = [f"{prefix}sum", f"{prefix}abs_sum", f"{prefix}count"]
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise MoendError(f"query stats tensors missing {missing}; present: {sorted(tensors)[:10]}")
        s, a, c = (torch.as_tensor(tensors[k]) for k in keys)
        return cls(s, a, int(c.reshape(-1)[0]) if c.numel() else 0)
