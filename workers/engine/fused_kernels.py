"""Fused Triton kernels for the elementwise parts of a decoder layer (the model's CUDA path).

- ``rms_norm``: RMSNorm of each row.
- ``add_rms_norm``: adds a layer's output into the residual stream (in place) and RMS-normalises
  the sum, in one pass over memory instead of three.
- ``apply_rope``: rotary embedding of q and k in place, "rotate half" layout (dimension ``i``
  pairs with ``i + head_dim / 2``). It takes q and k as ONE ``[tokens, heads, head_dim]`` view:
  in the fused qkv projection the q heads and the k heads sit next to each other, so grouped-query
  attention (fewer k heads than q heads) needs nothing special.
- ``silu_and_mul``: ``silu(gate) * up`` of a ``[tokens, 2 * I]`` row laid out ``[gate | up]``.
- ``quantize_fp8``: activations to e4m3 with a scale per row or per tensor (the FP8 matmul's
  input, see ``fp8.py``) in one kernel instead of the six small ones the PyTorch ops launch;
  CUDA only (the interpreter has no FP8).
- ``scale_rows_and_columns``: ``y[r, c] * row_scale[r] * col_scale[c]`` cast to the model dtype,
  the epilogue of an FP8 matmul made with unit scales (see ``fp8.fp8_linear``).

These functions have the same names and signatures as the model's plain PyTorch ops
(``model.TorchOps``), which are their reference. Each kernel reproduces the reference's rounding
steps: math in float32, a cast to the model dtype wherever PyTorch rounds (an elementwise op in
bfloat16 computes in float32 and rounds its result). So the fused path differs from the plain
one only by the order of the RMS sum and by the exp in SiLU. Launches turn FMA contraction off:
these kernels are memory-bound, and contraction would change float32 results by an ulp.

With ``TRITON_INTERPRET=1`` set while this module is imported, the kernels run on CPU tensors in
Triton's interpreter (how the tests check them without a GPU). For that, the kernels use only
Triton builtins (``tl.reduce`` with the standard combine function rather than ``tl.sum``, which
is itself a ``@triton.jit`` function decorated in the other mode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


class FusedKernelInputError(ValueError):
    """Tensors handed to a fused kernel do not fit together (shape, dtype, device, layout)."""


SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Triton decided at decoration time (at import) whether these kernels are interpreted. Triton
# 3.9's interpreter truncates float32 to bfloat16 where a GPU rounds to nearest even, so
# interpreted kernels round the bits themselves first (see ``_round``); compiled ones never do.
_INTERPRETED = bool(triton.knobs.runtime.interpret)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _round(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` (to nearest even, as PyTorch and the GPU round)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)  # now exact in bfloat16: the cast only drops zeros
    return x.to(dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_residual, stride_out,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Rounded to the model dtype before it is normalised, as the plain path's sum is.
        summed = _round(x + residual.to(tl.float32), dtype, INTERPRETED)
        tl.store(residual_ptr + row * stride_residual + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_square = tl.reduce(x * x, 0, tl.standard._sum_combine) / N
    # Normalised in float32, rounded to the model dtype, then scaled by the weight in that dtype.
    normed = _round(x * tl.rsqrt(mean_square + eps), dtype, INTERPRETED).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, _round(normed * weight, dtype, INTERPRETED),
             mask=mask)


@triton.jit
def _rope_kernel(
    qk_ptr, cos_ptr, sin_ptr,
    stride_qk_t, stride_qk_h, stride_cos, stride_sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim / 2
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < HALF
    mask = (heads < NUM_HEADS)[:, None] & dim_mask[None, :]
    dtype = qk_ptr.dtype.element_ty

    # The cos/sin rows hold each angle twice ([a, a]); both halves are read, as the reference does.
    cos_row = cos_ptr + token * stride_cos + dims
    sin_row = sin_ptr + token * stride_sin + dims
    cos_lo = tl.load(cos_row, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(cos_row + HALF, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(sin_row, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(sin_row + HALF, mask=dim_mask, other=0.0).to(tl.float32)[None, :]

    lo_ptrs = qk_ptr + token * stride_qk_t + heads[:, None] * stride_qk_h + dims[None, :]
    x_lo = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(lo_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = [-x_hi, x_lo]; each product is rounded
    # to the model dtype before the sum, as PyTorch rounds each op of the reference.
    out_lo = (_round(x_lo * cos_lo, dtype, INTERPRETED).to(tl.float32)
              + _round(-x_hi * sin_lo, dtype, INTERPRETED).to(tl.float32))
    out_hi = (_round(x_hi * cos_hi, dtype, INTERPRETED).to(tl.float32)
              + _round(x_lo * sin_hi, dtype, INTERPRETED).to(tl.float32))
    tl.store(lo_ptrs, _round(out_lo, dtype, INTERPRETED), mask=mask)
    tl.store(lo_ptrs + HALF, _round(out_hi, dtype, INTERPRETED), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr,
    stride_in, stride_out,
    N: tl.constexpr,  # the intermediate size I (half of the input row)
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + token * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + token * stride_in + N + cols, mask=mask, other=0.0).to(tl.float32)
    # silu is rounded to the model dtype before the product, as F.silu(gate) * up rounds it.
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRETED).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, _round(act * up, dtype, INTERPRETED), mask=mask)


# --------------------------------------------------------------------------------------------
# Host wrappers (the ops the model calls)
# --------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [tokens, hidden], scaled by ``weight`` [hidden]."""
    _check_rows("x", x)
    _check_weight(weight, x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch_rms_norm(x, None, weight, out, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` (in place), then RMSNorm of the new residual.

    Returns ``(normed, residual)``; ``residual`` is the tensor passed in, now holding the sum.
    """
    _check_rows("x", x)
    _check_rows("residual", residual)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise FusedKernelInputError(
            f"residual is {tuple(residual.shape)} {residual.dtype} on {residual.device}; expected "
            f"{tuple(x.shape)} {x.dtype} on {x.device} like x")
    _check_weight(weight, x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch_rms_norm(x, residual, weight, out, eps)
    return out, residual


def apply_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``qk`` [tokens, heads, head_dim] in place by each token's ``cos``/``sin`` rows
    [tokens, head_dim] ("rotate half" layout). Returns ``qk``.

    ``qk`` may be a view into a wider tensor (the q and k heads of the fused qkv projection);
    only its own heads are touched.
    """
    if qk.dim() != 3:
        raise FusedKernelInputError(
            f"qk has shape {tuple(qk.shape)}; expected [tokens, heads, head_dim]")
    num_tokens, num_heads, head_dim = qk.shape
    if head_dim % 2:
        raise FusedKernelInputError(f"rotary embedding needs an even head_dim, got {head_dim}")
    _check_dtype_device("qk", qk, qk.device)
    if qk.stride(-1) != 1:
        raise FusedKernelInputError("qk must be contiguous in its last dimension")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (num_tokens, head_dim):
            raise FusedKernelInputError(
                f"{name} has shape {tuple(table.shape)}; expected [{num_tokens}, {head_dim}] "
                "(one row per token of qk)")
        if table.dtype != qk.dtype:
            raise FusedKernelInputError(f"{name} is {table.dtype} but qk is {qk.dtype}")
        _check_dtype_device(name, table, qk.device)
        if table.stride(-1) != 1:
            raise FusedKernelInputError(f"{name} must be contiguous in its last dimension")
    if num_tokens == 0 or num_heads == 0:
        return qk
    half = head_dim // 2
    # Up to 1K rotation pairs per program: enough heads to amortise the cos/sin loads, enough
    # programs that a single decode token still spreads over a few SMs.
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 1024 // block_half))
    _rope_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        qk, cos, sin,
        qk.stride(0), qk.stride(1), cos.stride(0), sin.stride(0),
        NUM_HEADS=num_heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        INTERPRETED=_INTERPRETED,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return qk


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [tokens, 2 * I] laid out ``[gate | up]``: [tokens, I]."""
    _check_rows("gate_up", gate_up)
    num_tokens, width = gate_up.shape
    if width % 2:
        raise FusedKernelInputError(
            f"gate_up has {width} columns; expected an even number ([gate | up])")
    size = width // 2
    out = torch.empty((num_tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or size == 0:
        return out
    block = min(triton.next_power_of_2(size), 1024)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
        gate_up, out, gate_up.stride(0), out.stride(0),
        N=size,
        BLOCK=block,
        INTERPRETED=_INTERPRETED,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out


@triton.jit
def _quantize_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, amax_ptr,
    stride_x, stride_q,
    fp8_max, min_scale,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    PER_ROW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if PER_ROW:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < N, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, 0) / fp8_max, min_scale)
        tl.store(scale_ptr + row, scale)
    else:
        # Every program stores the same scale: whichever lands last, the value is the same.
        scale = tl.maximum(tl.load(amax_ptr) / fp8_max, min_scale)
        tl.store(scale_ptr, scale)
    for start in range(0, N, BLOCK):
        mask = start + cols < N
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        # Clamped first: a quotient a rounding step above the largest value saturates.
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
        tl.store(q_ptr + row * stride_q + start + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(x: torch.Tensor, *, per_row: bool, fp8_max: float,
                 min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, features] -> (e4m3 ``x / scale`` clamped to ``fp8_max``, float32 scales:
    [rows, 1] with ``scale = max(amax / fp8_max, min_scale)`` of each row, or 0-d of the whole
    tensor). Matches ``fp8.quantize_activation_reference`` element for element (the division
    rounds to nearest, as PyTorch's does)."""
    _check_rows("x", x)
    if not x.is_cuda:
        raise FusedKernelInputError("quantize_fp8 runs on CUDA tensors only")
    rows, width = x.shape
    q = torch.empty((rows, width), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1) if per_row else (), dtype=torch.float32, device=x.device)
    if rows == 0 or width == 0:
        return q, scale.fill_(min_scale)
    amax = scale if per_row else \
        torch.linalg.vector_norm(x, ord=float("inf"), dtype=torch.float32)  # one reduction
    block = min(triton.next_power_of_2(width), 2048)
    _quantize_fp8_kernel[(rows,)](
        x, q, scale, amax, x.stride(0), q.stride(0), fp8_max, min_scale,
        N=width,
        BLOCK=block,
        PER_ROW=per_row,
        num_warps=4 if block >= 1024 else 1,
    )
    return q, scale


@triton.jit
def _scale_rows_and_columns_kernel(
    y_ptr, row_scale_ptr, col_scale_ptr, out_ptr,
    stride_y, stride_out,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
    scaled = y * tl.load(row_scale_ptr + row) * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, scaled.to(out_ptr.dtype.element_ty), mask=mask)


def scale_rows_and_columns(y: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
    """float32 ``y`` [rows, cols] times ``row_scale`` [rows, 1] and ``col_scale`` [cols] (float32),
    in ``dtype``: ``(y * row_scale * col_scale).to(dtype)`` in one pass."""
    _check_rows("y", y)
    rows, cols = y.shape
    if y.dtype != torch.float32 or row_scale.dtype != torch.float32 \
            or col_scale.dtype != torch.float32:
        raise FusedKernelInputError("y and both scales must be float32")
    if row_scale.numel() != rows or col_scale.shape != (cols,) or not col_scale.is_contiguous() \
            or not row_scale.is_contiguous():
        raise FusedKernelInputError(
            f"scales of shape {tuple(row_scale.shape)} and {tuple(col_scale.shape)} do not fit "
            f"y {tuple(y.shape)}; expected contiguous [{rows}, 1] and [{cols}]")
    out = torch.empty((rows, cols), dtype=dtype, device=y.device)
    if rows == 0 or cols == 0:
        return out
    block = min(triton.next_power_of_2(cols), 1024)
    _scale_rows_and_columns_kernel[(rows, triton.cdiv(cols, block))](
        y, row_scale, col_scale, out, y.stride(0), out.stride(0),
        N=cols,
        BLOCK=block,
        num_warps=4,
    )
    return out


def _launch_rms_norm(x, residual, weight, out, eps) -> None:
    num_tokens, hidden = x.shape
    if num_tokens == 0 or hidden == 0:
        return
    # One program per row, the whole row in registers (hidden sizes reach a few thousand).
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x, residual if residual is not None else x, weight, out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        eps,
        N=hidden,
        BLOCK=block,
        ADD_RESIDUAL=residual is not None,
        INTERPRETED=_INTERPRETED,
        num_warps=8 if block >= 4096 else (4 if block >= 1024 else 1),
        enable_fp_fusion=False,
    )


# --------------------------------------------------------------------------------------------
# Input checks (host side only)
# --------------------------------------------------------------------------------------------


def _check_dtype_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise FusedKernelInputError(
            f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
    if t.device != device:
        raise FusedKernelInputError(f"{name} is on {t.device}, expected {device}")


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise FusedKernelInputError(
            f"{name} has shape {tuple(t.shape)}; expected [tokens, features]")
    _check_dtype_device(name, t, t.device)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise FusedKernelInputError(f"{name} must be contiguous in its last dimension")


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    if weight.shape != (x.shape[1],):
        raise FusedKernelInputError(
            f"weight has shape {tuple(weight.shape)}; expected [{x.shape[1]}] to match x")
    if weight.dtype != x.dtype:
        raise FusedKernelInputError(f"weight is {weight.dtype} but x is {x.dtype}")
    _check_dtype_device("weight", weight, x.device)
    if weight.shape[0] > 1 and weight.stride(0) != 1:
        raise FusedKernelInputError("weight must be contiguous")


__all__ = [
    "FusedKernelInputError",
    "add_rms_norm",
    "apply_rope",
    "quantize_fp8",
    "rms_norm",
    "scale_rows_and_columns",
    "silu_and_mul",
]
