"""The fused attention op over one compressed layer: ``torch.ops.moend.packed_attention``.

One op, three implementations behind it:

* CPU tensors: the C++ kernel (``moend_attn.cpp``, built once and cached by :mod:`moend_fx.kernels.cpu`);
  if it did not build, the reference (with one warning). Never crashes for want of a compiler.
* CUDA tensors: the Triton decode kernel (:mod:`moend_fx.kernels.triton_decode`).
* The reference (dequantize the layer, then ``moend_fx.attention.reference.attention_dense``): the oracle the other
  two are tested against, also used for inputs a fast path does not cover.

``packed_attention(q, layer)`` is the Python entry point that takes a :class:`~moend_fx.storage.packed.PackedKV`.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable

import torch

from moend_fx.attention.reference import attention_dense
from moend_fx.common.checks import check_bits, check_choice, check_power_of_two
from moend_fx.common.errors import MoendError
from moend_fx.common.options import Kernel, QuantMode
from moend_fx.kernels import cpu
from moend_fx.kernels.variants import BITS
from moend_fx.storage.packed import PackedKV
from moend_fx.storage.quant import OP_MODE, dequantize_reference, packed_width, scale_shape

_RAW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_inputs(
    q: torch.Tensor, k_packed: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_packed: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, k_res: torch.Tensor,
    v_res: torch.Tensor, k_bits: int, v_bits: int, group_size: int, scale: float, causal: bool,
    mask: torch.Tensor | None = None,
) -> None:
    """Raise :class:`MoendError` naming the first tensor whose shape or dtype does not fit the layout.

    Takes the op's arguments as they are (shapes as in :func:`packed_attention_op`); any float ``scale`` fits."""
    check_bits("k_bits", k_bits, allowed=BITS, error=MoendError)
    check_bits("v_bits", v_bits, allowed=BITS, error=MoendError)
    check_power_of_two("group_size", group_size, error=MoendError)
    if q.dim() != 4:
        raise MoendError(f"q must be [B, H, L, D]; got shape {tuple(q.shape)}")
    b, h, l, d = q.shape
    if k_res.dim() != 4 or v_res.dim() != 4:
        raise MoendError(f"k_res and v_res must both be [B, Hkv, R, D]; got {tuple(k_res.shape)} and "
                         f"{tuple(v_res.shape)}")
    _, hkv, r, _ = k_res.shape
    if k_res.shape[0] != b or k_res.shape[3] != d:
        raise MoendError(f"k_res {tuple(k_res.shape)} does not fit q {tuple(q.shape)} (batch, head_dim)")
    if hkv == 0 or h % hkv:
        raise MoendError(f"query heads ({h}) must be a multiple of KV heads ({hkv})")
    p = k_packed.shape[2] if k_packed.dim() == 4 else -1
    # V is split like K (R residual tokens) or, packed on arrival, has no residual (P + R packed tokens)
    if v_res.shape not in ((b, hkv, r, d), (b, hkv, 0, d)):
        raise MoendError(f"v_res must be [B, Hkv, R, D] = {(b, hkv, r, d)} (V split like K) or {(b, hkv, 0, d)} "
                         f"(V packed on arrival); got {tuple(v_res.shape)}")
    pv = p + r - v_res.shape[2]
    for side, bits, packed, sc, ze, res, mode, n in (
            ("k", k_bits, k_packed, k_scale, k_zero, k_res, QuantMode.CHANNEL, p),
            ("v", v_bits, v_packed, v_scale, v_zero, v_res, QuantMode.TOKEN, pv)):
        if bits == 16:
            want = (b, hkv, n, d)
            if tuple(packed.shape) != want:
                raise MoendError(f"{side}_packed (16-bit, raw) must be [B, Hkv, P, D] = {want}; "
                                 f"got {tuple(packed.shape)}")
            # the kernels read one raw type per side (a cache stores both in the same 16-bit type)
            if packed.dtype not in _RAW_DTYPES or (n and packed.dtype != res.dtype):
                raise MoendError(f"{side}_packed (16-bit, raw) must be a float type, that of {side}_res "
                                 f"({res.dtype}); got {packed.dtype}")
            continue
        want = (b, hkv, n, packed_width(d, bits))
        if tuple(packed.shape) != want or packed.dtype != torch.uint8:
            raise MoendError(f"{side}_packed ({bits}-bit codes) must be uint8 {want}; got {packed.dtype} "
                             f"{tuple(packed.shape)}")
        want_s = scale_shape(mode, b, hkv, n, d, group_size)
        for name, t in ((f"{side}_scale", sc), (f"{side}_zero", ze)):
            if tuple(t.shape) != want_s:
                raise MoendError(f"{name} must be {want_s}; got {tuple(t.shape)}")
    if p % group_size:
        raise MoendError(f"packed tokens P={p} must be a multiple of group_size={group_size}")
    if causal and l > 1 and l > p + r:
        raise MoendError(f"a chunk of {l} queries cannot be the newest tokens of only {p + r} held tokens")
    _check_mask(mask, q, p + r)


def _check_mask(mask: torch.Tensor | None, q: torch.Tensor, s: int) -> None:
    """MoendError unless ``mask`` is None or bool [B, 1 or H, L, S] on q's device (S = P + R held tokens)."""
    if mask is None:
        return
    b, h, l, _ = q.shape
    fits = mask.dim() == 4 and mask.shape[0] == b and mask.shape[1] in (1, h) and tuple(mask.shape[2:]) == (l, s)
    if mask.dtype != torch.bool or not fits or mask.device != q.device:
        raise MoendError(f"mask must be bool [B, 1 or H, L, S] = [{b}, 1 or {h}, {l}, {s}] (True = may attend; "
                         f"S = P + R held tokens) on {q.device}; got {mask.dtype} {tuple(mask.shape)} on "
                         f"{mask.device}")


def reference_packed_attention(
    q: torch.Tensor, k_packed: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_packed: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, k_res: torch.Tensor,
    v_res: torch.Tensor, k_bits: int, v_bits: int, group_size: int, scale: float, causal: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize the whole layer, then fp32 attention (``reference_attention`` semantics: a query row the mask
    hides every token from gives 0)."""
    d = q.shape[-1]

    def dense(packed: torch.Tensor, sc: torch.Tensor, ze: torch.Tensor, bits: int, mode: QuantMode) -> torch.Tensor:
        if bits == 16:
            return packed.float()
        return dequantize_reference(packed, sc, ze, bits, group_size, OP_MODE[mode], d, torch.float32)

    k = torch.cat([dense(k_packed, k_scale, k_zero, k_bits, QuantMode.CHANNEL), k_res.float()], dim=2)
    v = torch.cat([dense(v_packed, v_scale, v_zero, v_bits, QuantMode.TOKEN), v_res.float()], dim=2)
    return attention_dense(q, k, v, scale=scale, causal_chunk=causal, mask=mask)


def cpu_kernel_supports(q: torch.Tensor, k_res: torch.Tensor, k_bits: int, v_bits: int, group_size: int) -> bool:
    """Whether the C++ kernel covers these inputs (else the reference runs)."""
    d = q.shape[-1]
    kper = 1 if k_bits == 16 else 8 // k_bits
    vper = 1 if v_bits == 16 else 8 // v_bits
    return (q.device.type == "cpu" and k_res.dtype in _RAW_DTYPES and d % kper == 0 and d % vper == 0
            and min(group_size, d) % vper == 0)


def _cpu_impl(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_res, v_res, k_bits, v_bits,
              group_size, scale, causal, mask=None, num_splits: int = 0) -> torch.Tensor:
    """The C++ kernel where it covers the inputs and built, else the reference (arguments as the op's)."""
    args = (q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_res, v_res, k_bits, v_bits,
            group_size, scale, causal, mask)
    if cpu_kernel_supports(q, k_res, k_bits, v_bits, group_size) and cpu.available():
        return cpu.packed_attention_cpu(*args, num_splits=num_splits).to(q.dtype)
    return reference_packed_attention(*args)


def _triton_impl(*args, num_splits: int = 0) -> torch.Tensor:
    """The Triton decode kernel (arguments as the op's); imported on first use, so CPU-only runs never load it.
    Groups under 16 tokens (narrower than a tensor-core dot's K) take the reference."""
    if args[11] < 16:  # group_size
        return reference_packed_attention(*args).to(args[0].dtype)
    from moend_fx.kernels import triton_decode

    return triton_decode.packed_attention_triton(*args, num_splits=num_splits)


def _checked(impl: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``impl`` behind :func:`check_inputs`, so every implementation of the op rejects a bad layout alike."""

    def kernel(*args, **kwargs) -> torch.Tensor:
        check_inputs(*args, **kwargs)
        return impl(*args, **kwargs)

    return kernel


@torch.library.custom_op("moend::packed_attention", mutates_args=())
def packed_attention_op(
    q: torch.Tensor, k_packed: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_packed: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, k_res: torch.Tensor,
    v_res: torch.Tensor, k_bits: int, v_bits: int, group_size: int, scale: float, causal: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q: [B, H, L, D] over one compressed layer (P packed + R residual tokens of K).

    k_packed: uint8 codes [B, Hkv, P, D*k_bits/8] (or raw [B, Hkv, P, D] when k_bits == 16);
    k_scale, k_zero: fp16 [B, Hkv, P/G, D] (empty when 16-bit); v_packed likewise over Pv tokens, Pv = P (V split
    like K) or P + R (V packed on arrival: v_res then holds no token);
    v_scale, v_zero: fp16 [B, Hkv, Pv, D/min(G, D)]; k_res: [B, Hkv, R, D], v_res: [B, Hkv, P + R - Pv, D] as
    stored (fp16, or bf16 for a bf16 model; any float type is read), a raw side in its residual's type.
    causal: the L queries are the newest L of the S = P + R held tokens (bottom-right mask).
    mask: None, or bool [B, 1 or H, L, S] (True = may attend, e.g. left padding; broadcast over heads when 1),
    ANDed with ``causal``; a query row that may attend no token gives 0.
    Returns [B, H, L, D] in q's dtype. This body is the fallback for devices without a kernel.
    """
    return _checked(reference_packed_attention)(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_res,
                                                v_res, k_bits, v_bits, group_size, scale, causal, mask)


@packed_attention_op.register_fake
def _(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_res, v_res, k_bits, v_bits, group_size,
      scale, causal, mask=None):
    # contiguous like every implementation's output (empty_like would copy a transposed q's strides, and inductor
    # checks the real output's strides against these)
    return q.new_empty(q.shape)


packed_attention_op.register_kernel("cpu")(_checked(_cpu_impl))
packed_attention_op.register_kernel("cuda")(_checked(_triton_impl))


def layer_tensors(layer: PackedKV) -> tuple[torch.Tensor, ...]:
    """The op's tensor arguments of a layer: (k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_res,
    v_res); a 16-bit side passes its raw [B, Hkv, P, D] tensor and empty fp16 scales/zeros."""
    out: list[torch.Tensor] = []
    for block in layer.blocks():
        if isinstance(block, torch.Tensor):
            # The op's schema wants tensors on every side, so a raw side gets empty stand-ins.
            empty = torch.empty(0, dtype=torch.float16, device=block.device)
            out += [block, empty, empty]
        else:
            out += block.tensors()
    return (*out, *layer.residuals())


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA, or anywhere under TRITON_INTERPRET=1 (tests)."""
    mod = sys.modules.get("moend_fx.kernels.triton_decode")
    interpreted = bool(getattr(mod, "INTERPRETED", False)) if mod is not None else False
    return device.type == "cuda" or interpreted or os.environ.get("TRITON_INTERPRET") == "1"


def _direct_cpu(q: torch.Tensor) -> bool:
    """Whether an "auto" call may run the CPU kernel directly: eager (a traced graph needs the op node), a plain
    CPU tensor (fake and other subclasses go through the dispatcher) and no autograd to record."""
    return (q.device.type == "cpu" and type(q) is torch.Tensor and not q.requires_grad
            and not torch.compiler.is_compiling())


def packed_attention(
    q: torch.Tensor, layer: PackedKV, *, scale: float | None = None, causal: bool = True,
    mask: torch.Tensor | None = None, kernel: Kernel | str = Kernel.AUTO, num_splits: int = 0,
) -> torch.Tensor:
    """Attention of q: [B, H, L, D] over every token ``layer`` holds; returns [B, H, L, D] in q's dtype.

    kernel: "auto" (the op: C++ on CPU, Triton on CUDA), "cpu", "triton" or "reference".
    causal: the L queries are the newest L held tokens (append the chunk to the layer first).
    mask: None or bool [B, 1 or H, L, n] over the n held tokens (True = may attend), ANDed with ``causal``.
    num_splits: token splits for "cpu"/"triton" (0 = chosen from the length); for tests and benchmarks.
    """
    kernel = check_choice("kernel", kernel, Kernel, error=MoendError)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cfg = layer.config
    args = (q, *layer_tensors(layer), cfg.k_bits, cfg.v_bits, layer.group_size, scale, causal, mask)
    if kernel == Kernel.AUTO:
        if _direct_cpu(q):
            # the op's own CPU kernel, called without the dispatcher: the custom-op wrapping (autograd and
            # dynamo-disable layers) costs ~0.4 ms a call, more than the kernel itself on an eager decode step
            return _checked(_cpu_impl)(*args)
        return torch.ops.moend.packed_attention(*args)
    check_inputs(*args)
    if kernel == Kernel.REFERENCE:
        return reference_packed_attention(*args)
    if kernel == Kernel.CPU:
        if q.device.type != "cpu":
            raise MoendError(f"kernel='cpu' needs CPU tensors; got q on {q.device} (use 'auto' or 'triton')")
        return _cpu_impl(*args, num_splits=num_splits)
    if not triton_usable(q.device):
        raise MoendError(f"kernel='triton' needs CUDA tensors (got {q.device}) or TRITON_INTERPRET=1 set "
                         "before moend_fx.kernels.triton_decode is imported; use kernel='auto' or 'cpu'")
    return _triton_impl(*args, num_splits=num_splits)
