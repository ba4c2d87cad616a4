"""The block manager: reference counts, prefix reuse by chained hash, LRU eviction, pool bounds."""

import random

import pytest

from workers.engine.kv_cache import BlockManager
from workers.engine.sequence import SamplingParams, Sequence


def make_seq(tokens, name="r"):
    return Sequence(name, list(tokens), SamplingParams(), max_tokens=16, arrival_time=0.0)


def admit_all(bm, seq):
    """Admit and mark the whole sequence computed, as a finished prefill would."""
    num_new = bm.admit(seq, 10_000)
    assert num_new > 0
    bm.commit(seq, seq.num_computed_tokens + num_new)
    seq.num_computed_tokens += num_new
    return num_new


def test_blocks_are_counted_and_returned():
    bm = BlockManager(8, 4)
    seq = make_seq(range(10))
    assert admit_all(bm, seq) == 10
    assert len(seq.block_table) == 3
    assert bm.num_used_blocks == 3
    assert all(bm.ref_counts[b] == 1 for b in seq.block_table)
    bm.free(seq)
    assert bm.num_used_blocks == 0
    assert seq.block_table == [] and seq.num_computed_tokens == 0


def test_shared_prefix_reuses_blocks_and_counts_references():
    bm = BlockManager(16, 4)
    a = make_seq(list(range(10)) + [100, 101], "a")
    b = make_seq(list(range(10)) + [200, 201, 202], "b")
    admit_all(bm, a)
    num_new = bm.admit(b, 10_000)
    # Two full blocks (8 tokens) are common to both prompts.
    assert b.num_computed_tokens == 8
    assert num_new == len(b.token_ids) - 8
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [2, 2]
    assert b.block_table[2] != a.block_table[2]
    assert bm.prefix_hits == 8
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [1, 1]


def test_a_block_is_known_by_its_whole_prefix():
    bm = BlockManager(16, 4)
    a = make_seq([1, 1, 1, 1, 7, 7, 7, 7, 9], "a")
    b = make_seq([2, 2, 2, 2, 7, 7, 7, 7, 9], "b")  # same second block, different first
    admit_all(bm, a)
    bm.admit(b, 10_000)
    assert b.num_computed_tokens == 0


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(16, 4)
    a = make_seq(range(8), "a")
    admit_all(bm, a)
    b = make_seq(range(8), "b")
    assert bm.admit(b, 10_000) == 4  # the second block is recomputed for the last logits
    assert b.num_computed_tokens == 4


def test_unreferenced_cached_blocks_survive_until_needed_then_go_lru():
    bm = BlockManager(4, 4)
    a = make_seq(range(9), "a")  # blocks: [0..3] [4..7] [8]
    admit_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2

    # Still findable after release.
    again = make_seq(range(9), "again")
    bm.admit(again, 10_000)
    assert again.num_computed_tokens == 8
    bm.free(again)

    # A stranger needing 3 blocks takes the free ones first, then evicts the least recently
    # released cached block: the tail block (released first), so the first block survives.
    stranger = make_seq(range(50, 61), "stranger")
    admit_all(bm, stranger)
    assert bm.num_used_blocks == 3
    bm.free(stranger)
    probe = make_seq(range(9), "probe")
    bm.admit(probe, 10_000)
    assert probe.num_computed_tokens == 4


def test_admission_that_does_not_fit_changes_nothing():
    bm = BlockManager(3, 4)
    a = make_seq(range(8), "a")
    admit_all(bm, a)
    big = make_seq(range(100, 110), "big")  # needs 3 blocks, 1 free
    assert bm.admit(big, 10_000) == 0
    assert big.block_table == [] and big.num_computed_tokens == 0
    assert bm.num_used_blocks == 2
    assert bm.admit(make_seq(range(100, 103)), 10_000, reserve=1) == 0


def test_reviving_a_cached_block_counts_against_the_free_pool():
    bm = BlockManager(3, 4)
    a = make_seq(range(9), "a")
    admit_all(bm, a)
    bm.free(a)
    holder = make_seq(range(100, 104), "holder")
    admit_all(bm, holder)  # takes the one never-used block
    # b shares a's first two blocks (cached, unreferenced) and needs one more: 3 > 2 left.
    b = make_seq(list(range(8)) + [5, 5, 5], "b")
    assert bm.admit(b, 10_000) == 0
    assert bm.num_used_blocks == 1


def test_append_grows_only_at_block_boundaries():
    bm = BlockManager(4, 4)
    seq = make_seq(range(3))
    admit_all(bm, seq)
    seq.token_ids.append(3)
    assert bm.append(seq, 1) and len(seq.block_table) == 1
    seq.num_computed_tokens += 1
    seq.token_ids.append(4)
    assert bm.append(seq, 1) and len(seq.block_table) == 2


def test_invalidate_forgets_contents():
    bm = BlockManager(8, 4)
    a = make_seq(range(9), "a")
    admit_all(bm, a)
    bm.free(a, invalidate=True)
    assert bm.num_cached_blocks == 0
    b = make_seq(range(9), "b")
    bm.admit(b, 10_000)
    assert b.num_computed_tokens == 0


def test_disabled_prefix_caching_never_shares():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(range(9), "a")
    admit_all(bm, a)
    b = make_seq(range(9), "b")
    bm.admit(b, 10_000)
    assert b.num_computed_tokens == 0
    assert not set(a.block_table) & set(b.block_table)


def test_random_workload_never_exceeds_the_pool_and_counts_stay_exact():
    rng = random.Random(1234)
    bm = BlockManager(24, 4)
    live = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    for step in range(2000):
        action = rng.random()
        if action < 0.35:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            seq = make_seq(tokens, f"s{step}")
            n = bm.admit(seq, rng.randrange(1, 20), reserve=rng.randrange(0, 3))
            if n:
                bm.commit(seq, seq.num_computed_tokens + n)
                seq.num_computed_tokens += n
                live.append(seq)
        elif action < 0.8 and live:
            seq = rng.choice(live)
            if seq.num_computed_tokens == len(seq.token_ids):
                seq.token_ids.append(rng.randrange(50))
            if bm.append(seq, 1):
                bm.commit(seq, seq.num_computed_tokens + 1)
                seq.num_computed_tokens += 1
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq, invalidate=rng.random() < 0.1)
        # Invariants.
        assert 0 <= bm.num_used_blocks <= bm.num_blocks
        refs = [0] * bm.num_blocks
        for seq in live:
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
            for block in seq.block_table:
                refs[block] += 1
        assert refs == bm.ref_counts
        assert bm.num_used_blocks == sum(1 for r in refs if r)
    for seq in live:
        bm.free(seq)
    assert bm.num_used_blocks == 0


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (4, 0)])
def test_bad_sizes_are_refused(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)
