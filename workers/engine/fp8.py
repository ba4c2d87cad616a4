"""FP8 (e4m3) weights for the decoder layers' matmuls, with per-channel or per-tensor scales.

A weight ``W`` [out, in] is stored as ``Q = e4m3(W / s)`` with ``s = max|W| / 448`` for each output
channel (row) or for the whole tensor, so its largest magnitude lands on e4m3's largest finite
value. At run time the activations are scaled the same way on the fly, per token with per-channel
weights and per tensor with per-tensor weights (the pairings ``torch._scaled_mm`` accepts on GPUs),
the e4m3 operands are multiplied with float32 accumulation, and both scales applied to the result:

    y[t, o] = sx[t] * sw[o] * sum_i Qx[t, i] * Qw[o, i]

``fp8_linear`` makes that one ``torch._scaled_mm`` call: on NVIDIA GPUs of compute capability 8.9
and up (Ada, Hopper), and on CPU where the installed PyTorch has it. For a GPU decode step's few
rows it calls it with unit scales and applies them in a fused epilogue (``_few_rows_linear``).
Where ``small_batch_linear`` measured faster (see ``CausalLM.tune_small_batch_linear``), a GPU
decode step's matmul reads the e4m3 weights in that kernel instead, with the activations left
unquantized. ``dequantized_linear`` is the same math in plain float32 matmuls: the fallback where
``_scaled_mm`` is missing, and the reference the tests hold ``fp8_linear`` to. On CPU FP8 is an
emulation (for tests and accuracy checks), not a speed-up.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import fused_kernels

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # e4m3fn's largest finite value
# Scales never go below this: an all-zero row or tensor gets a harmless scale instead of 0 / 0.
MIN_SCALE = torch.finfo(torch.float32).tiny

# Deployment setting -> whether weights get one scale per output channel (else per tensor).
SCHEMES = {"fp8": True, "fp8-per-tensor": False}

MIN_CUDA_CAPABILITY = (8, 9)
# Up to this many rows (a decode step's batch) the GPU path scales in an epilogue (``fp8_linear``).
FEW_ROWS = 64


class Fp8Error(ValueError):
    """FP8 was asked for where it cannot run, or with a setting it does not have."""


class Fp8Weight(nn.Module):
    """A [out, in] weight stored as float8_e4m3fn, with float32 scales: [out] per output channel,
    or a single 0-d scale for the whole tensor. Its buffers follow ``.to(device)``; do not cast
    a model holding it with ``.to(dtype)``, which would cast these buffers too."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)

    @property
    def per_channel(self) -> bool:
        return self.scale.dim() == 1

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self) -> torch.Tensor:
        """The weight the FP8 values stand for, in float32 [out, in]."""
        scale = self.scale[:, None] if self.per_channel else self.scale
        return self.qweight.float() * scale


def per_channel_scales(scheme: str) -> bool:
    """Whether ``scheme`` scales weights per output channel; a clear error for an unknown one."""
    if scheme not in SCHEMES:
        raise Fp8Error(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    return SCHEMES[scheme]


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, *, per_channel: bool = True) -> Fp8Weight:
    """``weight`` [out, in] (any float dtype) in FP8 with per-channel or per-tensor scales."""
    _require_fp8_dtype()
    if weight.dim() != 2:
        raise Fp8Error(f"a weight to quantize must be [out, in], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise Fp8Error(f"a weight to quantize must be floating point, got {weight.dtype}")
    w = weight.float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = _to_fp8(w / (scale[:, None] if per_channel else scale))
    return Fp8Weight(q, scale)


def quantize_activation(x: torch.Tensor, *, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [tokens, in] -> (e4m3 values, float32 scales [tokens, 1] or 0-d per tensor).
    On CUDA one fused kernel does it (a decode step runs this for every matmul of every layer)."""
    if x.is_cuda:
        return fused_kernels.quantize_fp8(x, per_row=per_token, fp8_max=FP8_MAX,
                                          min_scale=MIN_SCALE)
    return quantize_activation_reference(x, per_token=per_token)


def quantize_activation_reference(x: torch.Tensor, *,
                                  per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_activation`` in plain PyTorch ops (the CPU path and the fused kernel's
    reference)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True) if per_token else xf.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(xf / scale), scale


def fp8_linear(x: torch.Tensor, weight: Fp8Weight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with W in FP8 and x quantized on the fly; result in x's dtype."""
    rows, out_shape = _flatten(x, weight)
    if rows.shape[0] == 0:
        return x.new_zeros(out_shape)
    per_channel = weight.per_channel
    if rows.is_cuda and rows.shape[0] <= FEW_ROWS:
        y = _few_rows_linear(rows, weight)
    else:
        qx, x_scale = quantize_activation(rows, per_token=per_channel)
        # _scaled_mm takes the second operand column-major: the [out, in] weight transposed.
        w_scale = weight.scale[None, :] if per_channel else weight.scale
        y = torch._scaled_mm(qx, weight.qweight.t(), scale_a=x_scale, scale_b=w_scale,
                             out_dtype=x.dtype)
    if bias is not None:  # added apart: GPUs' row-wise scaled matmul takes no bias
        y = y + bias
    return y.view(out_shape)


def _few_rows_linear(rows: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """``fp8_linear`` for a decode step's few rows on a GPU. The row-wise scaled matmul runs
    128-row tiles, which at one row reads the weights at half the memory's speed (measured on an
    H100); the tensor-wise one picks kernels made for few rows. So: unit scales in the matmul,
    float32 out, then both scales and the cast in one epilogue. One row's per-token scale is
    its per-tensor scale, so per-tensor weights need no separate reduction for it either."""
    per_token = weight.per_channel or rows.shape[0] == 1
    qx, x_scale = quantize_activation(rows, per_token=per_token)
    if not weight.per_channel:
        return torch._scaled_mm(qx, weight.qweight.t(), scale_a=x_scale.reshape(()),
                                scale_b=weight.scale, out_dtype=rows.dtype)
    one = _unit_scale(rows.device)
    y = torch._scaled_mm(qx, weight.qweight.t(), scale_a=one, scale_b=one,
                         out_dtype=torch.float32)
    return fused_kernels.scale_rows_and_columns(y, x_scale, weight.scale, rows.dtype)


@functools.lru_cache(maxsize=None)
def _unit_scale(device: torch.device) -> torch.Tensor:
    # Made once per device: created inside a CUDA graph capture, it would cost a launch a step.
    return torch.ones((), dtype=torch.float32, device=device)


def dequantized_linear(x: torch.Tensor, weight: Fp8Weight,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``fp8_linear`` computes, as float32 matmuls of the dequantized operands."""
    rows, out_shape = _flatten(x, weight)
    qx, x_scale = quantize_activation(rows, per_token=weight.per_channel)
    y = F.linear(qx.float() * x_scale, weight.dequantize()).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(out_shape)


def linear_for(device: torch.device | str):
    """The FP8 matmul for a model that runs on ``device``: ``torch._scaled_mm`` where it works
    there, else the dequantizing fallback (CPU only; on CUDA ``check_fp8_support`` decides)."""
    device = torch.device(device)
    if device.type == "cuda" or _cpu_scaled_mm_works():
        return fp8_linear
    return dequantized_linear


def fp8_support_problem(device_type: str, dtype: torch.dtype,
                        capability: tuple[int, int] | None = None,
                        gpu_name: str = "this GPU") -> str | None:
    """Why FP8 weights cannot run on this device and dtype, or None if they can."""
    if FP8_DTYPE is None:
        return f"this PyTorch ({torch.__version__}) has no float8_e4m3fn"
    if device_type == "cuda":
        if capability is None:
            return "FP8 weights were asked for on CUDA, but no CUDA device is available"
        if tuple(capability) < MIN_CUDA_CAPABILITY:
            need = ".".join(map(str, MIN_CUDA_CAPABILITY))
            return (f"FP8 matmuls need an NVIDIA GPU of compute capability {need} or newer "
                    f"(Ada, Hopper); {gpu_name} is {capability[0]}.{capability[1]}")
        if dtype != torch.bfloat16:
            return (f"FP8 weights on CUDA run with bfloat16 activations; load the model with "
                    f"dtype=bfloat16, not {str(dtype).removeprefix('torch.')}")
        return None
    if device_type == "cpu":
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"FP8 weights need float32, bfloat16 or float16 activations, not {dtype}"
        return None
    return (f"FP8 weights run on CUDA GPUs (or emulated on CPU for tests), "
            f"not on {device_type!r} devices")


def check_fp8_support(scheme: str, device: torch.device | str, dtype: torch.dtype) -> None:
    """Raise ``Fp8Error`` unless ``scheme`` is known and FP8 weights can run on ``device`` in
    ``dtype`` (cheap: call it before loading any weights)."""
    per_channel_scales(scheme)
    device = torch.device(device)
    capability, name = None, "this GPU"
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
    problem = fp8_support_problem(device.type, dtype, capability, name)
    if problem is not None:
        raise Fp8Error(problem)


def check_gpu_shape(name: str, shape: tuple[int, ...]) -> None:
    """GPUs' FP8 matmuls need both sides of the weight to be multiples of 16."""
    if any(size % 16 for size in shape):
        raise Fp8Error(f"{name} has shape {tuple(shape)}; FP8 matmuls on GPUs need both sides "
                       "to be multiples of 16")


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    # Clamped first: a quotient a rounding step above 448 must saturate, not turn into NaN.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _flatten(x: torch.Tensor, weight: Fp8Weight) -> tuple[torch.Tensor, tuple[int, ...]]:
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise Fp8Error(f"input has {x.shape[-1]} features; the weight takes {in_features}")
    return x.reshape(-1, in_features), (*x.shape[:-1], out_features)


def _require_fp8_dtype() -> None:
    if FP8_DTYPE is None:
        raise Fp8Error(f"this PyTorch ({torch.__version__}) has no float8_e4m3fn")


@functools.lru_cache(maxsize=None)
def _cpu_scaled_mm_works() -> bool:
    """Whether this PyTorch's ``_scaled_mm`` runs on CPU with both pairings of scales (some
    versions take per-tensor scales only)."""
    if FP8_DTYPE is None:
        return False
    a = torch.ones(2, 16).to(FP8_DTYPE)
    b = torch.ones(16, 16).to(FP8_DTYPE)
    pairings = [(torch.tensor(1.0), torch.tensor(1.0)),
                (torch.ones(2, 1), torch.ones(1, 16))]
    try:
        results = [torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
                   for sa, sb in pairings]
    except (RuntimeError, NotImplementedError):
        return False
    return all(bool((y == 16).all()) for y in results)
