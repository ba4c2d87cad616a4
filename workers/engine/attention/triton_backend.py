"""The attention backend for NVIDIA GPUs: the Triton kernels in ``triton_kernels.py``."""

from __future__ import annotations

import torch

from . import triton_kernels
from .base import AttentionMetadata


class TritonBackend:
    """Paged attention with Triton: split-K decode for one-token steps, a causal kernel otherwise."""

    name = "triton"

    def __init__(self, kernels=triton_kernels) -> None:
        # The kernels module is a parameter so that tests can hand in a copy of it imported under
        # TRITON_INTERPRET=1 without switching the whole process to the interpreter.
        self._kernels = kernels

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._kernels.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # One token per sequence is the decode kernel's case; anything else (prefill, chunked
        # prefill, decodes mixed with a prefill chunk) goes through the general causal kernel.
        if meta.max_query_len == 1 and query.shape[0] == meta.num_seqs:
            return self._kernels.paged_decode_attention(
                query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                max_context_len=meta.max_context_len)
        return self._kernels.paged_prefill_attention(
            query, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc,
            scale, max_query_len=meta.max_query_len)
