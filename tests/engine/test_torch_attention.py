"""The PyTorch paged-attention backend against a dense per-sequence reference.

Decode rows in float32 go to the C kernel when it builds; the tests that have decode rows run
both through it and through the PyTorch gather path (``decode_path``).
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.engine.attention import cpu_native
from workers.engine.attention.base import AttentionMetadata
from workers.engine.attention.torch_backend import TorchBackend


@pytest.fixture(params=["native", "gathered"])
def decode_path(request, monkeypatch):
    if request.param == "native":
        # The machines that run the suite have a C compiler: the fast path must be the one tested.
        assert cpu_native.available(), "the CPU attention kernel did not build"
    else:
        monkeypatch.setattr(cpu_native, "available", lambda: False)
    return request.param


def dense_reference(q, k, v, scale):
    """Causal GQA for one sequence whose q_len new tokens are the last of its len(k) tokens."""
    q_len, num_heads, _ = q.shape
    context_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q_len):
        pos = context_len - q_len + i
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k[: pos + 1]) * scale
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[: pos + 1])
    return out


def build_case(q_lens, context_lens, *, num_heads, num_kv_heads, head_dim=16, block_size=4,
               dtype=torch.float32, seed=0, poison=float("nan")):
    """Random sequences scattered over a shuffled, poisoned paged cache.

    Returns the backend inputs plus each sequence's dense K/V (whole context) for the reference.
    The cached prefix of every sequence is already in the cache; the step's new K/V are not.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    # Poison every slot so that reading anything outside a sequence's context shows up.
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), poison, dtype=dtype)
    v_cache = torch.full_like(k_cache, poison)
    order = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    dense_k, dense_v, slots, queries, new_k, new_v = [], [], [], [], [], []
    for i, (q_len, ctx) in enumerate(zip(q_lens, context_lens)):
        table = [order.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(table)] = torch.tensor(table)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype)
        dense_k.append(k)
        dense_v.append(v)
        for pos in range(ctx):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < ctx - q_len:
                k_cache.view(-1, num_kv_heads, head_dim)[slot] = k[pos]
                v_cache.view(-1, num_kv_heads, head_dim)[slot] = v[pos]
            else:
                slots.append(slot)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=g).to(dtype))
        new_k.append(k[ctx - q_len:])
        new_v.append(v[ctx - q_len:])
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_context_len=max(context_lens),
    )
    return dict(query=torch.cat(queries), key=torch.cat(new_k), value=torch.cat(new_v),
                k_cache=k_cache, v_cache=v_cache, meta=meta, dense_k=dense_k, dense_v=dense_v)


def run_and_compare(case, q_lens, *, atol):
    backend = TorchBackend()
    meta = case["meta"]
    head_dim = case["query"].shape[-1]
    scale = head_dim ** -0.5
    backend.write_kv(case["key"], case["value"], case["k_cache"], case["v_cache"], meta.slot_mapping)
    out = backend.attend(case["query"], case["k_cache"], case["v_cache"], meta, scale)
    assert out.shape == case["query"].shape
    assert out.dtype == case["query"].dtype
    assert torch.isfinite(out).all()
    start = 0
    for i, q_len in enumerate(q_lens):
        expected = dense_reference(case["query"][start:start + q_len], case["dense_k"][i],
                                   case["dense_v"][i], scale)
        torch.testing.assert_close(out[start:start + q_len].double(), expected, atol=atol, rtol=0)
        start += q_len


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (16, 2)])
def test_decode_ragged_lengths_across_block_boundaries(num_heads, num_kv_heads, decode_path):
    # Lengths 1, exactly one block, one past a block, many blocks.
    context_lens = [1, 4, 5, 8, 9, 23, 2]
    q_lens = [1] * len(context_lens)
    case = build_case(q_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert case["meta"].is_decode
    run_and_compare(case, q_lens, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (16, 2)])
def test_prefill_and_extend_over_cached_prefix(num_heads, num_kv_heads, decode_path):
    # Fresh prefills (q_len == context_len), extends after a cached prefix, and one decode row
    # riding along in the same step.
    q_lens = [7, 3, 1, 12, 4]
    context_lens = [7, 11, 6, 12, 16]
    case = build_case(q_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert not case["meta"].is_decode
    run_and_compare(case, q_lens, atol=1e-5)


def test_bfloat16_matches_reference_loosely():
    q_lens, context_lens = [1, 5, 1], [9, 5, 17]
    case = build_case(q_lens, context_lens, num_heads=8, num_kv_heads=2, dtype=torch.bfloat16)
    run_and_compare(case, q_lens, atol=3e-2)


def test_finite_garbage_outside_context_is_ignored(decode_path):
    q_lens, context_lens = [1, 1, 3], [3, 6, 10]
    case = build_case(q_lens, context_lens, num_heads=4, num_kv_heads=2, poison=1e4)
    run_and_compare(case, q_lens, atol=1e-5)


def test_write_kv_skips_negative_slots_and_touches_nothing_else():
    backend = TorchBackend()
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    key = torch.randn(4, 2, 8)
    value = torch.randn(4, 2, 8)
    slots = torch.tensor([5, -1, 0, 11])
    backend.write_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    for row, slot in [(0, 5), (2, 0), (3, 11)]:
        assert torch.equal(flat_k[slot], key[row])
        assert torch.equal(flat_v[slot], value[row])
    written = {0, 5, 11}
    untouched = [s for s in range(12) if s not in written]
    assert not flat_k[untouched].any()
    assert not flat_v[untouched].any()


def test_write_kv_converts_to_cache_dtype():
    backend = TorchBackend()
    k_cache = torch.zeros(2, 2, 1, 4, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(1, 1, 4)
    backend.write_kv(key, key, k_cache, v_cache, torch.tensor([3]))
    assert torch.equal(k_cache.view(-1, 1, 4)[3], key[0].to(torch.bfloat16))


def test_cache_dtype_may_differ_from_the_query_dtype(decode_path):
    # A float32 model over a bfloat16 cache: the output stays float32 and close to the reference.
    q_lens, context_lens = [1, 4, 1], [6, 9, 12]
    case = build_case(q_lens, context_lens, num_heads=4, num_kv_heads=2)
    case["k_cache"] = case["k_cache"].to(torch.bfloat16)
    case["v_cache"] = case["v_cache"].to(torch.bfloat16)
    case["dense_k"] = [k.to(torch.bfloat16).float() for k in case["dense_k"]]
    case["dense_v"] = [v.to(torch.bfloat16).float() for v in case["dense_v"]]
    run_and_compare(case, q_lens, atol=1e-5)
