"""The attention interface every backend satisfies (PyTorch reference on CPU, Triton on CUDA).

The model runs one flattened batch of variable-length sequences per step. Each layer first writes
the step's new K/V into the paged cache (by slot), then attends over the cache, so prefill, chunked
prefill, prefix-cache hits and decode are all the same call.

Cache layout per layer: ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``t`` of a sequence lives in block
``block_table[t // block_size]`` at offset ``t % block_size``, i.e. slot
``block * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Where a step's tokens sit in the flattened batch and in the paged cache.

    ``num_seqs`` sequences contribute ``query_start_loc[i+1] - query_start_loc[i]`` new tokens each
    (laid out one after another in the batch). Sequence ``i`` has ``context_lens[i]`` tokens in the
    cache once this step's tokens are written, so its new tokens sit at positions
    ``context_lens[i] - q_len_i ... context_lens[i] - 1`` and attend causally to every cached
    position up to their own.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]; cache slot for each new token, -1 = do not write
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]; unused entries are 0
    context_lens: torch.Tensor  # int32 [num_seqs]; tokens in cache after this step's write
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]; cumulative new-token counts, starts at 0
    max_query_len: int  # longest new-token run in the step (1 means a pure decode step)
    max_context_len: int  # longest context_lens entry

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """What the model needs from an attention implementation."""

    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store the step's new K/V into their cache slots (slots of -1 are skipped)."""

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal grouped-query attention of the new tokens over the paged cache.

        Returns ``[num_tokens, num_heads, head_dim]`` in the query's dtype.
        """
