"""The decoder's elementwise ops in C for a bfloat16 model on the CPU (``attention/csrc/fused_ops.c``,
built with the CPU attention kernels by ``attention.cpu_native``).

The same names, signatures and rounding steps as ``model.TorchOps``, their reference, and like
the CUDA path's ``fused_kernels``, ``add_rms_norm`` updates the residual and ``apply_rope``
rotates q and k in place. A call the C ops do not take (float32, a layout they do not read, or
no compiler) goes to ``TorchOps``, so float32 models keep the path that matches transformers
exactly.
"""

from __future__ import annotations

import torch

from .attention import cpu_native
from .model import TorchOps


def _library(*tensors: torch.Tensor):
    """The C library, if every tensor is a contiguous bfloat16 CPU tensor and it is built."""
    if all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return cpu_native._load()
    return None


class CpuOps(TorchOps):
    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        library = _library(x, weight)
        if library is None or x.dim() != 2 or weight.shape != x.shape[1:]:
            return TorchOps.rms_norm(x, weight, eps)
        out = torch.empty_like(x)
        library.add_rms_norm_bf16(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), x.shape[0],
                                  x.shape[1], eps)
        return out

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        library = _library(x, residual, weight)
        if library is None or x.dim() != 2 or residual.shape != x.shape or weight.shape != x.shape[1:]:
            return TorchOps.add_rms_norm(x, residual, weight, eps)
        out = torch.empty_like(x)
        library.add_rms_norm_bf16(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                  x.shape[0], x.shape[1], eps)
        return out, residual

    @staticmethod
    def apply_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens, heads, head_dim = qk.shape
        library = _library(cos, sin)
        if library is None or qk.dtype != torch.bfloat16 or qk.device.type != "cpu" \
                or qk.stride(2) != 1 or qk.stride(1) != head_dim or head_dim % 2 \
                or (tokens > 1 and qk.stride(0) < heads * head_dim) \
                or cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
            return TorchOps.apply_rope(qk, cos, sin)
        library.rope_bf16(qk.data_ptr(), qk.stride(0), tokens, heads, head_dim, cos.data_ptr(),
                          sin.data_ptr())
        return qk

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        library = _library(gate_up)
        if library is None or gate_up.dim() != 2 or gate_up.shape[1] % 2:
            return TorchOps.silu_and_mul(gate_up)
        inner = gate_up.shape[1] // 2
        out = torch.empty(gate_up.shape[0], inner, dtype=gate_up.dtype)
        library.silu_and_mul_bf16(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inner)
        return out
