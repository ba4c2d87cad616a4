"""The Triton paged-attention kernels against two references: a naive dense loop and TorchBackend.

On CPU the kernels run in Triton's interpreter on small shapes. The interpreter is chosen when
``@triton.jit`` decorates a kernel, so the tests import a private copy of ``triton_kernels`` with
``TRITON_INTERPRET=1`` set only for that import: the rest of the process (and other tests) keeps
whatever mode it had. With a CUDA GPU the same cases also run compiled, plus full-size ones.

Every output buffer starts as NaN, and every cache slot outside a sequence's context holds NaN,
so an element a kernel forgets to write, or a slot it reads but should not, fails the comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.engine.interpreted import kernel_targets, needs_cuda
from workers.engine.attention import triton_kernels
from workers.engine.attention.base import AttentionMetadata
from workers.engine.attention.torch_backend import TorchBackend
from workers.engine.attention.triton_backend import TritonBackend

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


target = kernel_targets(triton_kernels)


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # already holds every sequence's whole context, new tokens included
    v_cache: torch.Tensor
    meta: AttentionMetadata
    dense_k: list  # per sequence [context_len, KV, D] (for the naive reference)
    dense_v: list
    new_k: torch.Tensor  # [T, KV, D], the step's own K/V (for write_kv)
    new_v: torch.Tensor


def make_batch(q_lens, context_lens, *, num_heads, num_kv_heads, head_dim, dtype, device,
               block_size=16, seed=0) -> Batch:
    """Random sequences scattered over shuffled blocks of a NaN-poisoned paged cache."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = torch.zeros(len(q_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    dense_k, dense_v, slots, new_rows = [], [], [], []
    for s, (q_len, ctx) in enumerate(zip(q_lens, context_lens)):
        assert 1 <= q_len <= ctx
        table = [free.pop() for _ in range(blocks_per_seq[s])]
        block_tables[s, : len(table)] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype)
        dense_k.append(k)
        dense_v.append(v)
        positions = torch.arange(ctx)
        seq_slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[seq_slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[seq_slots] = v
        slots.extend(seq_slots[ctx - q_len:].tolist())
        new_rows.append((k[ctx - q_len:], v[ctx - q_len:]))
    total = sum(q_lens)
    query = torch.randn(total, num_heads, head_dim, generator=g).to(dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(q_lens),
        max_context_len=max(context_lens),
    )
    return Batch(
        query=query.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device), meta=meta,
        dense_k=dense_k, dense_v=dense_v,
        new_k=torch.cat([k for k, _ in new_rows]).to(device),
        new_v=torch.cat([v for _, v in new_rows]).to(device),
    )


def naive_attention(batch: Batch, scale: float) -> torch.Tensor:
    """Float64, one sequence and one query at a time, straight from the dense K/V."""
    query = batch.query.cpu().double()
    num_heads = query.shape[1]
    out = torch.empty_like(query)
    starts = batch.meta.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v)):
        group = num_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        q_len, ctx = starts[s + 1] - starts[s], k.shape[0]
        for i in range(q_len):
            visible = ctx - q_len + i + 1
            scores = torch.einsum("hd,lhd->hl", query[starts[s] + i], k[:visible]) * scale
            out[starts[s] + i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[:visible])
    return out


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), expected.cpu().double(), atol=tol, rtol=tol)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def torch_reference(batch: Batch, scale: float) -> torch.Tensor:
    return TorchBackend().attend(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)


# ------------------------------------------------------------------------------------------------
# KV-cache write
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_kv_stores_rows_by_slot_and_skips_minus_one(target, dtype):
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, head_dim = 5, 16, 3, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    # K and V as views of a fused projection output, as a model produces them.
    fused = torch.randn(7, 2 * kv_heads * head_dim + 5, generator=g).to(dtype)
    key = fused[:, : kv_heads * head_dim].view(7, kv_heads, head_dim)
    value = fused[:, kv_heads * head_dim: 2 * kv_heads * head_dim].view(7, kv_heads, head_dim)
    slots = torch.tensor([17, -1, 0, 79, 15, -1, 48], dtype=torch.int64)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k.view(-1, kv_heads, head_dim)[slot] = key[t]
            expected_v.view(-1, kv_heads, head_dim)[slot] = value[t]

    dev = target.device
    k_dev, v_dev = k_cache.to(dev), v_cache.to(dev)
    target.kernels.write_kv_cache(key.to(dev), value.to(dev), k_dev, v_dev, slots.to(dev))
    assert torch.equal(k_dev.cpu(), expected_k)
    assert torch.equal(v_dev.cpu(), expected_v)


# ------------------------------------------------------------------------------------------------
# Decode
# ------------------------------------------------------------------------------------------------

# Ragged contexts around the 16-token block boundary, one single-token context and a long one.
DECODE_CONTEXTS = [15, 16, 17, 1, 33, 70]

DECODE_CASES = [
    # (query heads per KV head, head_dim, dtype, splits)
    (1, 64, torch.bfloat16, 1),
    (4, 128, torch.float16, 3),
    (8, 64, torch.float32, 2),
    (4, 64, torch.bfloat16, 5),
    (8, 128, torch.bfloat16, 3),
    (1, 128, torch.float32, 5),
    (2, 96, torch.float16, 2),  # a head_dim that is not a power of two (padded to 128)
]


@pytest.mark.parametrize("group,head_dim,dtype,splits", DECODE_CASES)
def test_paged_decode_matches_references(target, group, head_dim, dtype, splits):
    kv_heads = 2
    batch = make_batch([1] * len(DECODE_CONTEXTS), DECODE_CONTEXTS, num_heads=kv_heads * group,
                       num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=target.device,
                       seed=splits * 100 + group)
    scale = head_dim ** -0.5
    kernels = target.kernels
    config = kernels.default_decode_config(head_dim, dtype, batch.query.device)
    used, _ = kernels.plan_decode_splits(batch.meta.max_context_len, splits, config.block_n)
    if target.device == "cpu":
        assert used == splits  # the case really exercises that many splits (16-token tiles)

    out = kernels.paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
        batch.meta.context_lens, scale, max_context_len=batch.meta.max_context_len,
        num_splits=splits, out=poisoned_like(batch.query))

    assert_matches(out, naive_attention(batch, scale), dtype)
    assert_matches(out, torch_reference(batch, scale), dtype)


def test_paged_decode_last_split_reaches_a_context_longer_than_announced(target):
    """A stale max_context_len shrinks the splits, never the attended context."""
    batch = make_batch([1, 1], [40, 9], num_heads=4, num_kv_heads=2, head_dim=64,
                       dtype=torch.float32, device=target.device)
    out = target.kernels.paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
        batch.meta.context_lens, 0.125, max_context_len=20, num_splits=2,
        out=poisoned_like(batch.query))
    assert_matches(out, naive_attention(batch, 0.125), torch.float32)


# ------------------------------------------------------------------------------------------------
# Prefill / extend over a cached prefix
# ------------------------------------------------------------------------------------------------

# (new tokens, context): a fresh prompt over a block boundary, a prefix-cache hit on one whole
# block, a decode riding along, exactly one block, a chunk after a prefix that ends mid-block.
PREFILL_SEQS = [(17, 17), (5, 21), (1, 15), (16, 16), (9, 40)]

PREFILL_CASES = [
    # (query heads per KV head, head_dim, dtype, (block_m, block_n) or None for the default)
    (1, 64, torch.float32, None),
    (4, 128, torch.bfloat16, None),
    (8, 64, torch.float16, None),
    (4, 64, torch.float32, (32, 16)),
    (1, 128, torch.float16, (16, 32)),
    (2, 96, torch.bfloat16, None),
]


@pytest.mark.parametrize("group,head_dim,dtype,tiles", PREFILL_CASES)
def test_paged_prefill_matches_references(target, group, head_dim, dtype, tiles):
    kv_heads = 1 if group == 8 else 2
    q_lens, contexts = zip(*PREFILL_SEQS)
    batch = make_batch(list(q_lens), list(contexts), num_heads=kv_heads * group,
                       num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                       device=target.device, seed=group + head_dim)
    scale = head_dim ** -0.5
    kernels = target.kernels
    config = None if tiles is None else kernels.PrefillConfig(block_m=tiles[0], block_n=tiles[1])
    out = kernels.paged_prefill_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
        batch.meta.context_lens, batch.meta.query_start_loc, scale,
        max_query_len=batch.meta.max_query_len, config=config, out=poisoned_like(batch.query))

    assert_matches(out, naive_attention(batch, scale), dtype)
    assert_matches(out, torch_reference(batch, scale), dtype)


# ------------------------------------------------------------------------------------------------
# The backend: a model step is write_kv, then attend
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_lens,contexts", [
    ([1, 1, 1], [16, 17, 5]),  # pure decode step
    ([12, 1, 3], [12, 30, 19]),  # prefill + decode + prefix-cache hit in one step
])
def test_backend_step_matches_torch_backend(target, q_lens, contexts):
    dtype = torch.float16
    batch = make_batch(q_lens, contexts, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype,
                       device=target.device, seed=7)
    # Hide the step's own K/V: the backend must write them before attending.
    new_slots = batch.meta.slot_mapping
    flat_k = batch.k_cache.view(-1, 2, 64)
    flat_v = batch.v_cache.view(-1, 2, 64)
    flat_k[new_slots] = float("nan")
    flat_v[new_slots] = float("nan")
    triton_caches = (batch.k_cache.clone(), batch.v_cache.clone())
    torch_caches = (batch.k_cache.clone(), batch.v_cache.clone())

    backend = TritonBackend(kernels=target.kernels)
    assert backend.name == "triton"
    backend.write_kv(batch.new_k, batch.new_v, *triton_caches, batch.meta.slot_mapping)
    out = backend.attend(batch.query, *triton_caches, batch.meta, 0.125)

    reference = TorchBackend()
    reference.write_kv(batch.new_k, batch.new_v, *torch_caches, batch.meta.slot_mapping)
    expected = reference.attend(batch.query, *torch_caches, batch.meta, 0.125)

    assert out.shape == batch.query.shape and out.dtype == dtype
    assert torch.equal(triton_caches[0].cpu().nan_to_num(), torch_caches[0].cpu().nan_to_num())
    assert_matches(out, expected, dtype)
    assert_matches(out, naive_attention(batch, 0.125), dtype)


# ------------------------------------------------------------------------------------------------
# Bad input (checked on the host, before any launch)
# ------------------------------------------------------------------------------------------------


def _decode(kernels, query, k_cache, v_cache=None, tables=None, lens=None):
    v_cache = k_cache if v_cache is None else v_cache
    tables = torch.zeros(query.shape[0], 2, dtype=torch.int32) if tables is None else tables
    lens = torch.ones(query.shape[0], dtype=torch.int32) if lens is None else lens
    return kernels.paged_decode_attention(query, k_cache, v_cache, tables, lens, 1.0,
                                          max_context_len=1)


@pytest.mark.parametrize("problem,call,message", [
    ("head_dim differs", lambda k: _decode(k, torch.zeros(2, 4, 32), torch.zeros(3, 16, 2, 64)),
     "expected \\[num_tokens, num_heads, 64\\]"),
    ("heads do not group", lambda k: _decode(k, torch.zeros(2, 3, 64), torch.zeros(3, 16, 2, 64)),
     "3 query heads cannot share 2 KV heads"),
    ("dtype mismatch", lambda k: _decode(k, torch.zeros(2, 4, 64, dtype=torch.float16),
                                         torch.zeros(3, 16, 2, 64)), "KV cache is torch.float32"),
    ("unsupported dtype", lambda k: _decode(k, torch.zeros(2, 4, 64, dtype=torch.float64),
                                            torch.zeros(3, 16, 2, 64, dtype=torch.float64)),
     "supported: bfloat16"),
    ("caches differ", lambda k: _decode(k, torch.zeros(2, 4, 64), torch.zeros(3, 16, 2, 64),
                                        v_cache=torch.zeros(3, 8, 2, 64)), "does not match k_cache"),
    ("float block table", lambda k: _decode(k, torch.zeros(2, 4, 64), torch.zeros(3, 16, 2, 64),
                                            tables=torch.zeros(2, 2)), "block_tables has dtype"),
    ("decode token per seq", lambda k: _decode(k, torch.zeros(3, 4, 64), torch.zeros(3, 16, 2, 64),
                                               tables=torch.zeros(2, 2, dtype=torch.int32),
                                               lens=torch.ones(2, dtype=torch.int32)),
     "one query token per sequence"),
    ("lens per seq", lambda k: _decode(k, torch.zeros(2, 4, 64), torch.zeros(3, 16, 2, 64),
                                       lens=torch.ones(3, dtype=torch.int32)), "block_tables has shape"),
    ("write shape", lambda k: k.write_kv_cache(torch.zeros(2, 2, 32), torch.zeros(2, 2, 32),
                                               torch.zeros(3, 16, 2, 64), torch.zeros(3, 16, 2, 64),
                                               torch.zeros(2, dtype=torch.int64)), "key has shape"),
    ("slots per token", lambda k: k.write_kv_cache(torch.zeros(2, 2, 64), torch.zeros(2, 2, 64),
                                                   torch.zeros(3, 16, 2, 64),
                                                   torch.zeros(3, 16, 2, 64),
                                                   torch.zeros(3, dtype=torch.int64)),
     "slot_mapping has shape"),
])
def test_bad_inputs_raise_a_clear_error(problem, call, message):
    with pytest.raises(triton_kernels.AttentionInputError, match=message):
        call(triton_kernels)  # checked on the host before any launch, in any mode
    assert issubclass(triton_kernels.AttentionInputError, ValueError)


# ------------------------------------------------------------------------------------------------
# Full size, compiled, on a GPU
# ------------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_full_size_decode_on_gpu(dtype, splits):
    g = torch.Generator().manual_seed(3)
    contexts = torch.randint(1, 3000, (48,), generator=g).tolist() + [4096, 16, 17]
    batch = make_batch([1] * len(contexts), contexts, num_heads=32, num_kv_heads=8, head_dim=128,
                       dtype=dtype, device="cuda", seed=4)
    out = triton_kernels.paged_decode_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
        batch.meta.context_lens, 128 ** -0.5, max_context_len=batch.meta.max_context_len,
        num_splits=splits, out=poisoned_like(batch.query))
    assert_matches(out, torch_reference(batch, 128 ** -0.5), dtype)
    assert_matches(out, naive_attention(batch, 128 ** -0.5), dtype)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,num_heads,num_kv_heads", [
    (torch.bfloat16, 128, 32, 8), (torch.float16, 64, 16, 2), (torch.float32, 128, 4, 4)])
def test_full_size_prefill_on_gpu(dtype, head_dim, num_heads, num_kv_heads):
    # Fresh prompts, prefix-cache hits of whole blocks, a chunk after a mid-block prefix, decodes.
    seqs = [(1000, 1000), (300, 812), (129, 129), (1, 2000), (77, 333), (640, 640), (1, 1)]
    q_lens, contexts = zip(*seqs)
    batch = make_batch(list(q_lens), list(contexts), num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device="cuda",
                       seed=5)
    out = triton_kernels.paged_prefill_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta.block_tables,
        batch.meta.context_lens, batch.meta.query_start_loc, head_dim ** -0.5,
        max_query_len=batch.meta.max_query_len, out=poisoned_like(batch.query))
    assert_matches(out, torch_reference(batch, head_dim ** -0.5), dtype)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.slow
def test_bundled_model_greedy_tokens_on_cuda_match_cpu_torch_backend():
    """Same weights, same prompts: Triton on CUDA and PyTorch on CPU pick the same greedy tokens.

    The second round shares the first prompt's opening, so its prefill extends a cached prefix.
    """
    from workers.engine.engine import Engine
    from workers.engine.loader import bundled_model_path
    from workers.engine.sequence import SamplingParams

    opening = ("You are a careful assistant. Answer in one short paragraph, and never use lists. "
               "Question: ")
    rounds = [[opening + "why is the sky blue?"],
              [opening + "what is a prime number?", "def fibonacci(n):", "1, 2, 3, 5, 8,"]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for device, backend in (("cpu", "torch"), ("cuda", "triton")):
        with Engine(bundled_model_path(), dtype=torch.float32, device=device,
                    num_kv_blocks=256) as engine:
            assert engine.loaded.model.backend.name == backend
            outputs = [engine.generate(prompts, params, timeout=300) for prompts in rounds]
        assert outputs[1][0].cached_prompt_tokens > 0  # the prefix-cache hit really happened
        tokens[device] = [[out.token_ids for out in batch] for batch in outputs]
        assert all(len(ids) == 24 for batch in tokens[device] for ids in batch)
    assert tokens["cuda"] == tokens["cpu"]
