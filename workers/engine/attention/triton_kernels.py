"""Triton kernels for attention over the paged KV cache (layout in ``base.py``).

- ``write_kv_cache``: each new token's K/V row into its cache slot (slot -1 is skipped).
- ``paged_decode_attention``: one new token per sequence (flash-decoding). A program owns one
  (sequence, KV head, context split) and computes every query head of that KV head's group at once,
  so each K/V tile is read from memory once per group. Long contexts are cut into splits that run
  in parallel; a second kernel merges the splits' partial results by their log-sum-exp.
- ``paged_prefill_attention``: runs of new tokens of any length per sequence (prefill, chunked
  prefill, extend after a prefix-cache hit), flattened by ``query_start_loc``; causal, over the
  cached prefix and the new tokens themselves, all read back through the block table.

Softmax is online, in float32, in base 2 (the scale is pre-multiplied by log2(e)). Inputs may be
bfloat16, float16 or float32; matmuls run in the input dtype with float32 accumulation (float32
inputs use full IEEE precision, not TF32, so results match the reference closely).

Launches ask for FMA contraction explicitly (``enable_fp_fusion=True``): Triton 3.9 warns that
its default will change, and the kernels should not change speed or rounding with it.

With ``TRITON_INTERPRET=1`` set while this module is imported (Triton reads it when ``@triton.jit``
decorates), the same kernels run on CPU tensors in Triton's interpreter; num_warps/num_stages are
then ignored.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


class AttentionInputError(ValueError):
    """Tensors handed to a kernel have shapes, dtypes or devices that do not fit together."""


SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LOG2E = 1.4426950408889634

# Triton decided at decoration time (above, at import) whether these kernels are interpreted.
# The interpreter's tl.dot multiplies bfloat16 operands as raw 16-bit integers (Triton 3.9), so
# interpreted kernels upcast dot operands to float32 first; compiled kernels never do.
_INTERPRETED = bool(triton.knobs.runtime.interpret)


# --------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------

# tl.max, tl.sum and tl.zeros are themselves @triton.jit functions, decorated when triton was
# imported. A copy of this module imported later under TRITON_INTERPRET=1 (how the tests run these
# kernels on CPU without switching the whole process) cannot call them, so the kernels use the
# builtins they are made of: tl.reduce with the standard library's own combine functions (what
# tl.max / tl.sum do for float32; the interpreter recognises them and uses numpy) and tl.full.


@triton.jit
def _row_max(x):  # float32 [M, N] -> [M]
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def _row_sum(x):  # float32 [M, N] -> [M]
    return tl.reduce(x, 1, tl.standard._sum_combine)



@triton.jit
def _load_paged_tile(
    cache_ptr,
    block_table_ptr,  # this sequence's row of the block table
    tokens,  # [BLOCK_N] token positions in the sequence
    token_mask,  # [BLOCK_N] which positions to load (others read as 0)
    kv_head,
    dims,  # [BLOCK_D]
    stride_block,
    stride_offset,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """[BLOCK_N, BLOCK_D] of K or V for the given positions, gathered through the block table."""
    block = tl.load(block_table_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
    offset = tokens % BLOCK_SIZE
    ptrs = (cache_ptr + block[:, None] * stride_block + offset[:, None] * stride_offset
            + kv_head * stride_head + dims[None, :])
    # Mask the head dimension only when it is padded, so whole rows stay vector loads.
    if BLOCK_D == HEAD_DIM:
        mask = token_mask[:, None]
    else:
        mask = token_mask[:, None] & (dims < HEAD_DIM)[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _online_softmax_step(
    q,  # [M, BLOCK_D] (already in the dot dtype)
    k,  # [BLOCK_N, BLOCK_D]
    v,  # [BLOCK_N, BLOCK_D]
    mask,  # [M, BLOCK_N] keys each row may see
    acc,  # [M, BLOCK_D] float32, unnormalised output
    m_i,  # [M] running max of the base-2 logits
    l_i,  # [M] running sum of exp2(logit - m_i)
    scale_log2,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, _row_max(qk))
    # Every row sees at least one key in every tile it processes, so m_new is finite.
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + _row_sum(p)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


# --------------------------------------------------------------------------------------------
# KV-cache write
# --------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_b, stride_kc_o, stride_kc_h, stride_vc_b, stride_vc_o, stride_vc_h,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    token = token.to(tl.int64)

    k = tl.load(key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :],
                mask=mask)
    tl.store(k_cache_ptr + block * stride_kc_b + offset * stride_kc_o + heads[:, None] * stride_kc_h
             + dims[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :],
                mask=mask)
    tl.store(v_cache_ptr + block * stride_vc_b + offset * stride_vc_o + heads[:, None] * stride_vc_h
             + dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Decode: split-K over the context, grouped query heads per program, then a log-sum-exp merge
# --------------------------------------------------------------------------------------------


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr,  # final output [S, H, D] when NUM_SPLITS == 1, else float32 partials [S, H, SPLITS, D]
    lse_ptr,  # float32 [S, H, SPLITS] base-2 log-sum-exp of each split (unused with one split)
    scale_log2,
    tokens_per_split,
    stride_q_t, stride_q_h,
    stride_k_b, stride_k_o, stride_k_h,
    stride_v_b, stride_v_o, stride_v_h,
    stride_bt,
    stride_o_t, stride_o_h, stride_o_s,
    stride_lse_t, stride_lse_h,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    start = split * tokens_per_split
    # The last split runs to the end, whatever max_context_len the host was told.
    end = tl.where(split == NUM_SPLITS - 1, context_len,
                   tl.minimum(start + tokens_per_split, context_len))

    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    seq64 = seq.to(tl.int64)
    q = tl.load(q_ptr + seq64 * stride_q_t + heads[:, None] * stride_q_h + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, dtype=tl.float32)
    acc = tl.full([GROUP_PAD, BLOCK_D], 0.0, dtype=tl.float32)
    table = block_tables_ptr + seq64 * stride_bt
    for tile in range(start, end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        k = _load_paged_tile(k_cache_ptr, table, tokens, token_mask, kv_head, dims,
                             stride_k_b, stride_k_o, stride_k_h, BLOCK_SIZE, HEAD_DIM, BLOCK_D)
        v = _load_paged_tile(v_cache_ptr, table, tokens, token_mask, kv_head, dims,
                             stride_v_b, stride_v_o, stride_v_h, BLOCK_SIZE, HEAD_DIM, BLOCK_D)
        acc, m_i, l_i = _online_softmax_step(q, k, v, token_mask[None, :], acc, m_i, l_i,
                                             scale_log2, DOT_F32, PRECISION)

    # A split past the end of a short sequence saw nothing: it reports weight 0 (lse = -inf).
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq64 * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + seq64 * stride_o_t + heads[:, None] * stride_o_h + split * stride_o_s
                 + dims[None, :], out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(lse_ptr + seq64 * stride_lse_t + heads * stride_lse_h + split, lse, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,  # float32 [S, H, SPLITS, D], each split's output normalised by its own sum
    lse_ptr,  # float32 [S, H, SPLITS]
    out_ptr,  # [S, H, D]
    stride_p_t, stride_p_h, stride_p_s,
    stride_lse_t, stride_lse_h,
    stride_o_t, stride_o_h,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < NUM_SPLITS
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    lse = tl.load(lse_ptr + seq * stride_lse_t + head * stride_lse_h + splits, mask=split_mask,
                  other=float("-inf"))
    lse_max = tl.reduce(lse, 0, tl.standard._elementwise_max)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # empty context: all weights 0
    weight = tl.exp2(lse - lse_max)
    partial = tl.load(partial_ptr + seq * stride_p_t + head * stride_p_h
                      + splits[:, None] * stride_p_s + dims[None, :],
                      mask=(split_mask & (weight > 0))[:, None] & dim_mask[None, :], other=0.0)
    total = tl.reduce(weight, 0, tl.standard._sum_combine)
    total = tl.where(total > 0, total, 1.0)
    out = tl.reduce(partial * weight[:, None], 0, tl.standard._sum_combine) / total
    tl.store(out_ptr + seq * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


# --------------------------------------------------------------------------------------------
# Prefill / extend: causal attention of ragged new-token runs over the paged cache
# --------------------------------------------------------------------------------------------


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    out_ptr,
    scale_log2,
    num_m_blocks,
    stride_q_t, stride_q_h,
    stride_k_b, stride_k_o, stride_k_h,
    stride_v_b, stride_v_o, stride_v_h,
    stride_bt,
    stride_o_t, stride_o_h,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # The last query blocks see the most keys: launch them first so they do not form the tail.
    m_block = num_m_blocks - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    prefix = context_len - q_len  # cached tokens before this step's first new token
    kv_head = head // GROUP

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    positions = prefix + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_t + head * stride_q_h + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # Keys before this block's first position are visible to every row of it: whole tiles of
    # them need neither a causal nor a bounds mask.
    first_position = prefix + m_block * BLOCK_M
    full_end = first_position // BLOCK_N * BLOCK_N
    all_keys = tl.full([BLOCK_N], 1, dtype=tl.int1)
    for tile in range(0, full_end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        k = _load_paged_tile(k_cache_ptr, table, tokens, all_keys, kv_head, dims,
                             stride_k_b, stride_k_o, stride_k_h, BLOCK_SIZE, HEAD_DIM, BLOCK_D)
        v = _load_paged_tile(v_cache_ptr, table, tokens, all_keys, kv_head, dims,
                             stride_v_b, stride_v_o, stride_v_h, BLOCK_SIZE, HEAD_DIM, BLOCK_D)
        acc, m_i, l_i = _online_softmax_step(q, k, v, all_keys[None, :], acc, m_i, l_i,
                                             scale_log2, DOT_F32, PRECISION)

    # The diagonal: keys up to this block's last position, each row seeing its own prefix.
    causal_end = tl.minimum(context_len, first_position + BLOCK_M)
    for tile in range(full_end, causal_end, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        token_mask = tokens < causal_end
        k = _load_paged_tile(k_cache_ptr, table, tokens, token_mask, kv_head, dims,
                             stride_k_b, stride_k_o, stride_k_h, BLOCK_SIZE, HEAD_DIM, BLOCK_D)
        v = _load_paged_tile(v_cache_ptr, table, tokens, token_mask, kv_head, dims,
                             stride_v_b, stride_v_o, stride_v_h, BLOCK_SIZE, HEAD_DIM, BLOCK_D)
        mask = token_mask[None, :] & (tokens[None, :] <= positions[:, None])
        acc, m_i, l_i = _online_softmax_step(q, k, v, mask, acc, m_i, l_i, scale_log2, DOT_F32,
                                             PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_o_t + head * stride_o_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # context tokens per loop iteration (spans several cache blocks)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        _check_tile("block_n", self.block_n)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query rows per program
    block_n: int  # keys per loop iteration
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        _check_tile("block_m", self.block_m)
        _check_tile("block_n", self.block_n)


def _check_tile(name: str, size: int) -> None:
    # tl.dot needs every side >= 16, tl.arange a power of two.
    if size < 16 or size & (size - 1):
        raise AttentionInputError(f"{name} must be a power of two >= 16, got {size}")


@functools.lru_cache(maxsize=None)
def _device_traits(device: torch.device) -> tuple[tuple[int, int], int]:
    """(compute capability, streaming multiprocessor count) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor), props.multi_processor_count


def default_decode_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> DecodeConfig:
    if device.type != "cuda":
        # The interpreter: small tiles keep it quick and make small test contexts span tiles.
        return DecodeConfig(block_n=16)
    capability, _ = _device_traits(device)
    # Decode is a memory stream: tiles of ~16 KB of K (and of V) per iteration. More stages let
    # the pipeliner run the block-table lookup and the K/V copies (cp.async) ahead of the math.
    block_n = max(16, min(128, 16384 // (_padded_dim(head_dim) * dtype.itemsize)))
    stages = 4 if capability >= (9, 0) else (3 if capability == (8, 0) else 2)
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=stages)


def default_prefill_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> PrefillConfig:
    if device.type != "cuda":
        return PrefillConfig(block_m=16, block_n=16)
    capability, _ = _device_traits(device)
    wide = _padded_dim(head_dim) * dtype.itemsize  # bytes per K/V row
    if dtype == torch.float32 or wide > 256:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if capability >= (9, 0):
        # Hopper: 128-row query tiles fill two warpgroups' wgmma; three stages of K/V fit in 228 KB.
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    if capability == (8, 0):
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    # Consumer GPUs have ~100 KB of shared memory.
    return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, block_n: int,
                       device: torch.device) -> int:
    """Enough context splits that the grid covers the GPU about four programs deep per SM."""
    if device.type != "cuda":
        return 1
    _, sm_count = _device_traits(device)
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(4 * sm_count, programs)
    # A split of one tile is still worth it: at batch 1 the tiles' loads are what take the time
    # (a Llama-3-8B-shaped step on an H100 spent 10 us per layer in 3 splits of 3 tiles), and the
    # merge reads only a few floats per split.
    longest_useful = triton.cdiv(max(max_context_len, 1), block_n)
    return max(1, min(wanted, longest_useful, _MAX_SPLITS))


_MAX_SPLITS = 64


def plan_decode_splits(max_context_len: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(splits actually launched, context tokens per split) for a wish of ``num_splits``.

    Splits start on tile boundaries, so a short context may get fewer splits than asked for.
    """
    if num_splits < 1:
        raise AttentionInputError(f"num_splits must be at least 1, got {num_splits}")
    context = max(max_context_len, 1)
    tokens_per_split = triton.cdiv(triton.cdiv(context, num_splits), block_n) * block_n
    return min(num_splits, triton.cdiv(context, tokens_per_split)), tokens_per_split


def _padded_dim(head_dim: int) -> int:
    return triton.next_power_of_2(head_dim)


# --------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = skip
) -> None:
    """Store each token's K/V row into cache slot ``slot_mapping[t]`` (skipping slots of -1)."""
    _check_cache(k_cache, v_cache)
    num_tokens = key.shape[0] if key.dim() == 3 else -1
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.shape != (num_tokens, num_kv_heads, head_dim):
            raise AttentionInputError(
                f"{name} has shape {tuple(t.shape)}; expected [num_tokens, {num_kv_heads}, "
                f"{head_dim}] to match the cache")
        _check_dtype_device(name, t, k_cache.device)
    _check_index(slot_mapping, "slot_mapping", (num_tokens,), k_cache.device)
    if num_tokens == 0:
        return
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=_padded_dim(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
        enable_fp_fusion=True,
    )


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # [num_seqs], >= 1
    scale: float,
    *,
    max_context_len: int,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one new token over its whole cached context.

    ``max_context_len`` only sizes the context splits; ``num_splits=None`` picks enough splits to
    fill the GPU. Returns ``out`` (allocated if not given), shaped like ``query``.
    """
    num_seqs, num_heads, head_dim, num_kv_heads = _check_attention_inputs(
        query, k_cache, v_cache, block_tables, context_lens)
    if query.shape[0] != num_seqs:
        raise AttentionInputError(
            f"decode takes one query token per sequence: got {query.shape[0]} tokens for "
            f"{num_seqs} sequences")
    out = _output(query, out)
    if num_seqs == 0:
        return out
    config = config or default_decode_config(head_dim, query.dtype, query.device)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_context_len, config.block_n,
                                        query.device)
    num_splits, tokens_per_split = plan_decode_splits(max_context_len, num_splits, config.block_n)

    group = num_heads // num_kv_heads
    query = _last_dim_contiguous(query)
    if num_splits == 1:
        partial, lse = out, out  # written directly; lse is not touched
        stride_p = (out.stride(0), out.stride(1), 0)
        stride_lse = (0, 0)
    else:
        partial = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                              device=query.device)
        lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                          device=query.device)
        stride_p = (partial.stride(0), partial.stride(1), partial.stride(2))
        stride_lse = (lse.stride(0), lse.stride(1))

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens, partial, lse,
        scale * _LOG2E, tokens_per_split,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        *stride_p, *stride_lse,
        BLOCK_SIZE=k_cache.shape[1],
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=_padded_dim(head_dim),
        BLOCK_N=config.block_n,
        NUM_SPLITS=num_splits,
        DOT_F32=_dot_in_float32(query.dtype),
        PRECISION=_precision(query.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        enable_fp_fusion=True,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            partial, lse, out,
            partial.stride(0), partial.stride(1), partial.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            BLOCK_D=_padded_dim(head_dim),
            num_warps=4 if num_splits * head_dim >= 4096 else 1,
            enable_fp_fusion=True,
        )
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences one after another
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # [num_seqs], cached tokens including this step's
    query_start_loc: torch.Tensor,  # [num_seqs + 1], cumulative new-token counts from 0
    scale: float,
    *,
    max_query_len: int,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and each other.

    New token ``i`` of sequence ``s`` sits at position ``context_lens[s] - q_len_s + i``. Its K/V
    must already be in the cache. Returns ``out`` (allocated if not given), shaped like ``query``.
    """
    num_seqs, num_heads, head_dim, num_kv_heads = _check_attention_inputs(
        query, k_cache, v_cache, block_tables, context_lens)
    _check_index(query_start_loc, "query_start_loc", (num_seqs + 1,), query.device)
    out = _output(query, out)
    if num_seqs == 0 or query.shape[0] == 0 or max_query_len <= 0:
        return out
    config = config or default_prefill_config(head_dim, query.dtype, query.device)
    query = _last_dim_contiguous(query)
    num_m_blocks = triton.cdiv(max_query_len, config.block_m)
    _paged_prefill_kernel[(num_m_blocks, num_seqs, num_heads)](
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc, out,
        scale * _LOG2E, num_m_blocks,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=k_cache.shape[1],
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=_padded_dim(head_dim),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        DOT_F32=_dot_in_float32(query.dtype),
        PRECISION=_precision(query.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        enable_fp_fusion=True,
    )
    return out


# --------------------------------------------------------------------------------------------
# Input checks (host side only: nothing here synchronises with the GPU)
# --------------------------------------------------------------------------------------------


def _dot_in_float32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (_INTERPRETED and dtype == torch.bfloat16)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 or _INTERPRETED else "tf32"


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _output(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise AttentionInputError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected "
            f"{tuple(query.shape)} {query.dtype} on {query.device} like the query")
    if out.stride(-1) != 1:
        raise AttentionInputError("out must be contiguous in its last dimension")
    return out


def _check_dtype_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise AttentionInputError(f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
    if t.device != device:
        raise AttentionInputError(f"{name} is on {t.device} but the KV cache is on {device}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise AttentionInputError(
            f"k_cache has shape {tuple(k_cache.shape)}; expected "
            "[num_blocks, block_size, num_kv_heads, head_dim]")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise AttentionInputError(
            f"v_cache ({tuple(v_cache.shape)}, {v_cache.dtype}) does not match k_cache "
            f"({tuple(k_cache.shape)}, {k_cache.dtype})")
    _check_dtype_device("k_cache", k_cache, k_cache.device)
    _check_dtype_device("v_cache", v_cache, k_cache.device)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:
            raise AttentionInputError(f"{name} must be contiguous in its last dimension")


def _check_index(t: torch.Tensor, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise AttentionInputError(f"{name} has dtype {t.dtype}; expected int32 or int64")
    if tuple(t.shape) != shape:
        raise AttentionInputError(f"{name} has shape {tuple(t.shape)}; expected {shape}")
    if t.device != device:
        raise AttentionInputError(f"{name} is on {t.device} but the attention runs on {device}")
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise AttentionInputError(f"{name} must be contiguous in its last dimension")


def _check_attention_inputs(query, k_cache, v_cache, block_tables, context_lens):
    _check_cache(k_cache, v_cache)
    _, _, num_kv_heads, head_dim = k_cache.shape
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise AttentionInputError(
            f"query has shape {tuple(query.shape)}; expected [num_tokens, num_heads, {head_dim}]")
    num_heads = query.shape[1]
    if num_heads % num_kv_heads != 0:
        raise AttentionInputError(
            f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    _check_dtype_device("query", query, k_cache.device)
    if query.dtype != k_cache.dtype:
        raise AttentionInputError(f"query is {query.dtype} but the KV cache is {k_cache.dtype}")
    if context_lens.dim() != 1:
        raise AttentionInputError(f"context_lens must be 1-D, got shape {tuple(context_lens.shape)}")
    num_seqs = context_lens.shape[0]
    _check_index(context_lens, "context_lens", (num_seqs,), query.device)
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise AttentionInputError(
            f"block_tables has shape {tuple(block_tables.shape)}; expected [{num_seqs}, max_blocks]")
    _check_index(block_tables, "block_tables", tuple(block_tables.shape), query.device)
    return num_seqs, num_heads, head_dim, num_kv_heads


__all__ = [
    "AttentionInputError",
    "DecodeConfig",
    "PrefillConfig",
    "default_decode_config",
    "default_num_splits",
    "default_prefill_config",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_decode_splits",
    "write_kv_cache",
]
