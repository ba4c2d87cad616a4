"""bfloat16 matmuls on the CPU against weights packed once for oneDNN, PyTorch's CPU GEMM library.

``F.linear`` reorders a bfloat16 weight into oneDNN's blocked layout on every call; packing it at
load time skips that (measured on a Zen 4 core with AVX512-BF16: 10-20% off a decode step's
matmuls, a few % off prefill's, bit-identical results). The operators are PyTorch's own, the ones
its compiler emits for CPU linears; where this build lacks them, or they fail a probe, the model
keeps ``F.linear``. float32 is left alone: its packed matmul sums in another order, and the
float32 path is the one held to transformers' numbers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# A typical decode batch: oneDNN picks the packed layout for it, and it serves any batch size.
PACKING_BATCH = 64


@functools.cache
def available() -> bool:
    """Whether this PyTorch packs and multiplies bfloat16 weights, and gets F.linear's answer."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(3, 32, generator=generator).bfloat16()
        w = torch.randn(48, 32, generator=generator).bfloat16()
        return torch.equal(linear(x, pack(w)), F.linear(x, w))
    except RuntimeError:
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [out, in] weight in oneDNN's layout (an opaque tensor only ``linear`` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKING_BATCH)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a weight made by ``pack``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
