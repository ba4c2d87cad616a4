"""The C decode-attention kernel: its answers, its build and cache, its fallback, and its threads."""

from __future__ import annotations

import logging

import pytest
import torch

from workers.engine.attention import cpu_native
from workers.engine.attention.torch_backend import _decode_gathered, _extend_one


def random_decode_case(*, num_seqs, num_heads, num_kv_heads, head_dim, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 5 * block_size, (num_seqs,), generator=g, dtype=torch.int32)
    width = int((lens.max() + block_size - 1) // block_size)
    num_blocks = num_seqs * width + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * width].view(num_seqs, width).int()
    query = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    return query, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (4, 4, 128, 16), (8, 1, 64, 32), (6, 2, 80, 8), (2, 1, 256, 16),
    (14, 2, 64, 1)])
def test_the_kernel_matches_the_gather_path(num_heads, num_kv_heads, head_dim, block_size):
    assert cpu_native.available()
    query, k_cache, v_cache, tables, lens = random_decode_case(
        num_seqs=13, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, seed=head_dim + num_heads)
    scale = head_dim ** -0.5
    expected = _decode_gathered(query, k_cache, v_cache, tables, lens, int(lens.max()), scale)
    # A non-contiguous query (the model hands in a slice of its fused q/k/v projection).
    padded = torch.cat([query, torch.zeros_like(query)], dim=-1)[..., :head_dim]
    got = cpu_native.paged_decode(padded, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_one_thread_and_many_give_the_same_answer():
    query, k_cache, v_cache, tables, lens = random_decode_case(
        num_seqs=31, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_native.paged_decode(query, k_cache, v_cache, tables, lens, 0.125)
        torch.set_num_threads(max(3, threads))
        shared = cpu_native.paged_decode(query, k_cache, v_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, shared)  # each (sequence, KV head) is computed by one thread, the same way


def test_the_library_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_KERNEL_CACHE", str(tmp_path))
    first = cpu_native._build()
    stamp = first.stat().st_mtime_ns
    assert first.parent == tmp_path and first.suffix == ".so"
    assert cpu_native._build() == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial files left behind


def test_without_a_compiler_the_backend_falls_back_to_pytorch(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_native, "_library", None)
    monkeypatch.setattr(cpu_native, "_failed", False)
    monkeypatch.setenv("ENGINE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert not cpu_native.available()
    assert "using the PyTorch path" in caplog.text
    with pytest.raises(RuntimeError, match="not available"):
        cpu_native.paged_decode(*random_decode_case(num_seqs=1, num_heads=2, num_kv_heads=1,
                                                    head_dim=8, block_size=4, seed=0), 1.0)
    from workers.engine.attention.torch_backend import _decode

    query, k_cache, v_cache, tables, lens = random_decode_case(
        num_seqs=3, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=2)
    got = _decode(query, k_cache, v_cache, tables, lens, int(lens.max()), 0.25)
    expected = _decode_gathered(query, k_cache, v_cache, tables, lens, int(lens.max()), 0.25)
    assert torch.equal(got, expected)


def test_it_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(cpu_native, "_library", None)
    monkeypatch.setattr(cpu_native, "_failed", False)
    monkeypatch.setenv("ENGINE_NATIVE_KERNELS", "0")
    assert not cpu_native.available()


# Query heads per KV head 3, 4 and 2 are attended together; 5 vectors of 16, and 16, are not.
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [
    (9, 3, 64), (8, 2, 64), (4, 2, 64), (8, 4, 128), (6, 2, 80), (2, 1, 256)])
def test_a_bfloat16_cache_is_read_exactly_and_attended_in_float32(num_heads, num_kv_heads,
                                                                  head_dim):
    query, k_cache, v_cache, tables, lens = random_decode_case(
        num_seqs=11, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=16, seed=7)
    query, k_cache, v_cache = (t.to(torch.bfloat16) for t in (query, k_cache, v_cache))
    scale = head_dim ** -0.5
    got = cpu_native.paged_decode(query, k_cache, v_cache, tables, lens, scale)
    assert got.dtype == torch.bfloat16
    # The same bfloat16 values widened to float32 first: only the output's rounding differs.
    expected = _decode_gathered(query.float(), k_cache.float(), v_cache.float(), tables, lens,
                                int(lens.max()), scale)
    torch.testing.assert_close(got.float(), expected.to(torch.bfloat16).float(), atol=1e-2,
                               rtol=1e-2)
    assert (got.float() - expected).abs().max() <= expected.abs().max() * 2 ** -8


def test_other_dtypes_and_layouts_are_not_its_case():
    query = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    cache = torch.zeros(3, 4, 2, 16, dtype=torch.bfloat16)
    assert cpu_native.supports(query, cache, cache)
    assert cpu_native.supports(query.float(), cache.float(), cache.float())
    assert not cpu_native.supports(query, cache.half(), cache.half())
    assert not cpu_native.supports(query, cache, cache.float())
    assert not cpu_native.supports(query.float(), cache.float().transpose(1, 2), cache.float())
    odd = torch.zeros(2, 4, 72)  # not a whole number of the kernel's 16-float vectors
    odd_cache = torch.zeros(3, 4, 2, 72)
    assert not cpu_native.supports(odd, odd_cache, odd_cache)
    with pytest.raises(ValueError, match="head size 72"):
        cpu_native.paged_decode(odd, odd_cache, odd_cache, torch.zeros(2, 1, dtype=torch.int32),
                                torch.ones(2, dtype=torch.int32), 1.0)


# --------------------------------------------------------------------------- the prefill kernel

needs_prefill_kernel = pytest.mark.skipif(
    not cpu_native.prefill_available(), reason="the prefill kernel needs a CPU with AVX-512 BF16")


def random_prefill_case(*, q_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size,
                        seed):
    """A flattened batch in bfloat16, with NaN in every cache slot past a context, and the query
    a slice of a fused projection, as the model hands it in."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in context_lens)
    num_blocks = len(q_lens) * width + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).bfloat16()
    k_cache[-1] = float("nan")
    v_cache[-1] = float("nan")
    tables = torch.randperm(num_blocks - 1, generator=g)[: len(q_lens) * width]
    tables = tables.view(len(q_lens), width).int()
    for s, n in enumerate(context_lens):  # slots past a context: NaN, as an earlier owner may leave
        tables[s, -(-n // block_size):] = num_blocks - 1
        last = tables[s, (n - 1) // block_size]
        k_cache[last, (n - 1) % block_size + 1:] = float("nan")
        v_cache[last, (n - 1) % block_size + 1:] = float("nan")
    fused = torch.randn(sum(q_lens), num_heads + 2 * num_kv_heads, head_dim, generator=g).bfloat16()
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return fused[:, :num_heads], k_cache, v_cache, tables, starts, torch.tensor(context_lens, dtype=torch.int32)


@needs_prefill_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 64, 16), (14, 2, 64, 16), (2, 1, 256, 16)])
def test_the_prefill_kernel_matches_per_sequence_attention(num_heads, num_kv_heads, head_dim,
                                                           block_size):
    # Whole prompts, a prompt after a cached prefix, a decode row (left alone), a two-token
    # chunk, and lengths that end mid-block and mid-tile.
    q_lens, context_lens = [37, 1, 200, 70, 2], [37, 90, 250, 70, 33]
    query, k_cache, v_cache, tables, starts, lens = random_prefill_case(
        q_lens=q_lens, context_lens=context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, seed=head_dim + num_heads)
    scale = head_dim ** -0.5
    out = torch.full(query.shape, 7.0, dtype=torch.bfloat16)
    cpu_native.paged_prefill(query, k_cache, v_cache, tables, starts, lens, scale, out)
    for s, (n, start) in enumerate(zip(q_lens, starts.tolist())):
        got = out[start:start + n].float()
        if n == 1:
            assert (got == 7.0).all()  # the decode kernel's row: not written
            continue
        # The same bfloat16 inputs in float32 (the torch path): the kernel's products differ
        # by the rounding of its probabilities to bfloat16, and the output by its own.
        expected = _extend_one(query[start:start + n].float(), k_cache.float(), v_cache.float(),
                               tables[s], context_lens[s], scale)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@needs_prefill_kernel
def test_the_backend_takes_prefill_rows_to_the_kernel_and_decode_rows_to_the_decode_kernel(
        monkeypatch):
    from workers.engine.attention.base import AttentionMetadata
    from workers.engine.attention.torch_backend import TorchBackend

    q_lens, context_lens = [40, 1, 17, 1], [40, 60, 50, 9]
    query, k_cache, v_cache, tables, starts, lens = random_prefill_case(
        q_lens=q_lens, context_lens=context_lens, num_heads=9, num_kv_heads=3, head_dim=64,
        block_size=16, seed=3)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=tables,
                             context_lens=lens, query_start_loc=starts, max_query_len=40,
                             max_context_len=60)
    calls = []
    kernel = cpu_native.paged_prefill
    monkeypatch.setattr(cpu_native, "paged_prefill", lambda *a: calls.append(1) or kernel(*a))
    native = TorchBackend().attend(query, k_cache, v_cache, meta, 0.125)
    monkeypatch.setattr(cpu_native, "prefill_available", lambda: False)
    reference = TorchBackend().attend(query, k_cache, v_cache, meta, 0.125)
    assert calls == [1]  # one call for the whole batch, and only where the kernel is available
    torch.testing.assert_close(native.float(), reference.float(), atol=2e-2, rtol=2e-2)


@needs_prefill_kernel
def test_the_prefill_kernel_gives_the_same_answer_on_one_thread_and_many():
    query, k_cache, v_cache, tables, starts, lens = random_prefill_case(
        q_lens=[130, 64], context_lens=[130, 100], num_heads=8, num_kv_heads=2, head_dim=64,
        block_size=16, seed=5)
    outputs = []
    threads = torch.get_num_threads()
    try:
        for count in (1, max(3, threads)):
            torch.set_num_threads(count)
            out = torch.empty(query.shape, dtype=torch.bfloat16)
            cpu_native.paged_prefill(query, k_cache, v_cache, tables, starts, lens, 0.125, out)
            outputs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*outputs)


def test_the_prefill_kernel_refuses_what_it_does_not_take():
    query = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, 16, 1, 64, dtype=torch.bfloat16)
    assert cpu_native.prefill_supports(query, cache, cache)
    assert not cpu_native.prefill_supports(query.float(), cache.float(), cache.float())
    assert not cpu_native.prefill_supports(query, cache[:, :8].contiguous(), cache[:, :8].contiguous())
    assert not cpu_native.prefill_supports(torch.zeros(4, 2, 48, dtype=torch.bfloat16),
                                           torch.zeros(3, 16, 1, 48, dtype=torch.bfloat16),
                                           torch.zeros(3, 16, 1, 48, dtype=torch.bfloat16))
    if cpu_native.prefill_available():
        with pytest.raises(ValueError, match="block size 8"):
            cpu_native.paged_prefill(query, cache[:, :8].contiguous(), cache[:, :8].contiguous(),
                                     torch.zeros(1, 1, dtype=torch.int32),
                                     torch.tensor([0, 4], dtype=torch.int32),
                                     torch.tensor([4], dtype=torch.int32), 1.0, torch.empty_like(query))
    else:
        with pytest.raises(RuntimeError, match="not available"):
            cpu_native.paged_prefill(query, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                     torch.tensor([0, 4], dtype=torch.int32),
                                     torch.tensor([4], dtype=torch.int32), 1.0, torch.empty_like(query))


@needs_prefill_kernel
@pytest.mark.parametrize("change,problem", [
    (dict(starts=[0, 40]), "does not lie within the query"),  # 8 rows past the query's 32
    (dict(lens=[20]), "shorter than its new tokens"),
    (dict(lens=[80]), "longer than its block table"),
    (dict(tables=[[0, 9]]), "outside the cache"),
    (dict(head_dim=32), "do not fit together"),
])
def test_the_prefill_kernel_refuses_metadata_that_would_take_it_out_of_bounds(change, problem):
    head_dim = change.get("head_dim", 64)
    query = torch.zeros(32, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, 16, 1, head_dim, dtype=torch.bfloat16)
    tables = torch.tensor(change.get("tables", [[0, 1]]), dtype=torch.int32)
    starts = torch.tensor(change.get("starts", [0, 32]), dtype=torch.int32)
    lens = torch.tensor(change.get("lens", [32]), dtype=torch.int32)
    out = torch.full(query.shape, 3.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=problem):
        cpu_native.paged_prefill(query, cache, cache, tables, starts, lens, 1.0, out)
    assert (out == 3.0).all()
