"""The C decode-attention kernel: its answers, its build and cache, its fallback, and its threads."""

from __future__ import annotations

import logging

import pytest
import torch

from workers.engine.attention import cpu_native
from workers.engine.attention.torch_backend import _decode_gathered


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
