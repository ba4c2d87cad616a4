"""Paged attention in plain PyTorch: the CPU backend and the reference the Triton kernels match.

Decode rows (one new token per sequence) are the hot path at large batch sizes, so they are done
together: on the CPU by the C kernel of ``cpu_native``, which reads the blocks where they lie;
otherwise (CUDA, or no C compiler) by one gather of every sequence's blocks through the block
table and one masked batched grouped-query attention. Rows with several new tokens (prefill,
chunked prefill, extend after a prefix-cache hit) are compute-bound: in bfloat16 on a CPU with
AVX-512 BF16, the C kernel of ``cpu_native`` takes them all in one call; otherwise they are done
one sequence at a time with a causal mask whose diagonal is shifted by the cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_native
from .base import AttentionMetadata


class TorchBackend:
    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
        if slots.numel() == 0:
            return
        if bool((slots < 0).any()):
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
        v_flat.index_copy_(0, slots, value.to(v_cache.dtype))

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.is_decode:
            return _decode(query, k_cache, v_cache, meta.block_tables, meta.context_lens,
                           meta.max_context_len, scale)

        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        native_prefill = cpu_native.prefill_supports(query, k_cache, v_cache) \
            and cpu_native.prefill_available()
        if native_prefill:  # every row of more than one new token, in one call
            cpu_native.paged_prefill(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                     meta.context_lens, scale, out)
        starts = meta.query_start_loc.tolist()
        q_lens = [starts[i + 1] - starts[i] for i in range(meta.num_seqs)]
        decode_rows = [i for i, n in enumerate(q_lens) if n == 1]
        if decode_rows:
            # Mixed batch (decodes riding along with a prefill chunk): keep the decodes vectorized.
            rows = torch.tensor(decode_rows, device=query.device)
            token_index = meta.query_start_loc.to(query.device, torch.long)[rows]
            ctx = meta.context_lens[rows.to(meta.context_lens.device)]
            out[token_index] = _decode(query[token_index], k_cache, v_cache,
                                       meta.block_tables[rows.to(meta.block_tables.device)],
                                       ctx, int(ctx.max()), scale)
        if native_prefill:
            return out
        context_lens = meta.context_lens.tolist()
        for i, q_len in enumerate(q_lens):
            if q_len <= 1:
                continue
            start = starts[i]
            out[start:start + q_len] = _extend_one(
                query[start:start + q_len], k_cache, v_cache, meta.block_tables[i],
                context_lens[i], scale)
        return out


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[num_seqs, num_blocks * block_size, num_kv_heads, head_dim] of each sequence's blocks."""
    total, block_size, heads, dim = cache.shape
    index = block_tables[:, :num_blocks].to(cache.device, torch.long)
    # index_select copies whole blocks as rows; plain advanced indexing is several times slower.
    rows = cache.view(total, -1).index_select(0, index.reshape(-1))
    return rows.view(index.shape[0], num_blocks * block_size, heads, dim)


def _decode(query, k_cache, v_cache, block_tables, context_lens, max_context_len, scale):
    """One new token per sequence: [num_seqs, num_heads, head_dim] → same shape."""
    if cpu_native.supports(query, k_cache, v_cache) and cpu_native.available():
        return cpu_native.paged_decode(query, k_cache, v_cache, block_tables, context_lens, scale)
    return _decode_gathered(query, k_cache, v_cache, block_tables, context_lens, max_context_len,
                            scale)


def _decode_gathered(query, k_cache, v_cache, block_tables, context_lens, max_context_len, scale):
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = -(-max_context_len // block_size)
    keys = _gather(k_cache, block_tables, num_blocks).to(query.dtype)  # [S, L, KV, D]
    values = _gather(v_cache, block_tables, num_blocks).to(query.dtype)
    length = keys.shape[1]

    positions = torch.arange(length, device=query.device)
    beyond = positions[None, :] >= context_lens.to(query.device)[:, None]  # [S, L]
    # Slots past a sequence's end hold whatever an earlier owner left, maybe NaN, which a zero
    # attention weight would still turn into NaN: zero them. Only the tail can hold such slots.
    tail = int(context_lens.min()) // block_size * block_size
    tail_mask = beyond[:, tail:, None, None]
    keys[:, tail:].masked_fill_(tail_mask, 0)
    values[:, tail:].masked_fill_(tail_mask, 0)

    # Folding the query-head group into the query-length axis turns GQA into plain batched
    # attention, so no K/V head is repeated.
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(
        q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=~beyond[:, None, None, :],
        scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _extend_one(query, k_cache, v_cache, block_table, context_len, scale):
    """q_len new tokens of one sequence, the last q_len of its context_len cached positions."""
    q_len, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-context_len // block_size)
    keys = _gather(k_cache, block_table[None], num_blocks)[0, :context_len]  # [C, KV, D]
    values = _gather(v_cache, block_table[None], num_blocks)[0, :context_len]

    # Batched 4-D inputs with as many K/V heads as query heads: the shape for which SDPA takes
    # its fused flash kernel on the CPU (with enable_gqa, or 3-D inputs, it falls back to the
    # unfused math path, 3x slower at a few hundred tokens). Repeating K/V costs a copy of this
    # one sequence's keys, small next to the attention itself; transformers does the same.
    q = query.transpose(0, 1)[None]  # [1, H, Q, D]
    k = keys.transpose(0, 1).to(query.dtype)  # [KV, C, D]
    v = values.transpose(0, 1).to(query.dtype)
    if num_heads != num_kv_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
    k, v = k[None], v[None]
    if q_len == context_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # Query i sits at position context_len - q_len + i and sees every key up to it.
        offset = context_len - q_len
        rows = torch.arange(q_len, device=query.device)[:, None] + offset
        mask = torch.arange(context_len, device=query.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)
