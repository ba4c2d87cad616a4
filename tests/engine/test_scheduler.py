"""The scheduler without a model: steps are simulated by marking tokens computed and appending
a made-up token whenever a sequence reaches its end, as the engine does after sampling."""

import itertools

import pytest

from workers.engine.kv_cache import BlockManager
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

_ids = itertools.count()


def make_seq(prompt_len, max_tokens=8, first_token=0):
    tokens = [first_token + i for i in range(prompt_len)]
    return Sequence(f"r{next(_ids)}", tokens, SamplingParams(), max_tokens=max_tokens,
                    arrival_time=0.0)


def run_step(scheduler):
    """Schedule one step and apply its effect; returns the batch."""
    batch = scheduler.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        assert seq.num_computed_tokens <= seq.num_tokens
        assert len(seq.block_table) * scheduler.block_manager.block_size \
            >= seq.num_computed_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.max_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)
    bm = scheduler.block_manager
    assert bm.num_used_blocks <= bm.num_blocks
    return batch


def run_until_done(scheduler, max_steps=10_000):
    batches = []
    while scheduler.has_work():
        batches.append(run_step(scheduler))
        assert len(batches) < max_steps, "the scheduler stopped making progress"
    return batches


def test_token_budget_and_batch_size_are_respected():
    scheduler = Scheduler(BlockManager(1000, 4), max_batch_size=3, max_batched_tokens=10)
    seqs = [make_seq(7) for _ in range(6)]
    for s in seqs:
        scheduler.add(s)
    for batch in run_until_done(scheduler):
        assert batch.num_tokens <= 10
        assert len(batch) <= 3
        assert len(scheduler.running) <= 3
    assert all(s.num_output_tokens == 8 for s in seqs)


def test_long_prompt_is_chunked_and_decodes_keep_running():
    scheduler = Scheduler(BlockManager(1000, 4), max_batch_size=8, max_batched_tokens=16)
    short = [make_seq(3, max_tokens=50) for _ in range(4)]
    for s in short:
        scheduler.add(s)
    run_step(scheduler)  # all four prefilled
    long = make_seq(100, max_tokens=2, first_token=1000)
    scheduler.add(long)
    chunks = 0
    while long.num_output_tokens == 0:
        batch = run_step(scheduler)
        # Every running short sequence decodes in every step of the long prefill.
        assert all(s in batch.seqs for s in short)
        assert batch.num_tokens <= 16
        chunks += 1
    assert chunks >= 100 // 16


def test_a_new_request_joins_between_decode_steps():
    scheduler = Scheduler(BlockManager(1000, 4), max_batch_size=8, max_batched_tokens=64)
    first = make_seq(5, max_tokens=20)
    scheduler.add(first)
    run_step(scheduler)
    run_step(scheduler)
    second = make_seq(5, max_tokens=20, first_token=500)
    scheduler.add(second)
    batch = run_step(scheduler)
    assert batch.seqs == [first, second]
    assert batch.num_new_tokens == [1, 5]


def test_tiny_pool_preempts_and_everything_finishes():
    bm = BlockManager(10, 4)  # 40 slots for 8 sequences wanting 14 tokens each
    scheduler = Scheduler(bm, max_batch_size=8, max_batched_tokens=64)
    seqs = [make_seq(6, max_tokens=8, first_token=100 * i) for i in range(8)]
    for s in seqs:
        scheduler.add(s)
    run_until_done(scheduler)
    assert scheduler.num_preemptions > 0
    for s in seqs:
        assert s.status is SequenceStatus.FINISHED
        assert s.finish_reason is FinishReason.LENGTH
        assert s.num_output_tokens == 8
    assert bm.num_used_blocks == 0


def test_the_oldest_sequence_is_never_preempted():
    bm = BlockManager(8, 4)
    scheduler = Scheduler(bm, max_batch_size=8, max_batched_tokens=64)
    seqs = [make_seq(4, max_tokens=12, first_token=100 * i) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    run_until_done(scheduler)
    assert seqs[0].num_preemptions == 0
    assert scheduler.num_preemptions > 0


def test_a_sequence_that_alone_fills_the_pool_ends_with_length():
    bm = BlockManager(2, 4)
    scheduler = Scheduler(bm, max_batch_size=2, max_batched_tokens=64)
    seq = make_seq(5, max_tokens=100)
    scheduler.add(seq)
    batches = run_until_done(scheduler)
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.num_tokens == 9  # 8 slots computed, then one more token sampled
    assert any(seq in b.finished for b in batches)
    assert bm.num_used_blocks == 0


def test_a_waiting_sequence_larger_than_the_pool_runs_until_the_pool_is_full():
    # As a preempted sequence can be: prompt and outputs together outgrew the pool.
    bm = BlockManager(4, 4)
    scheduler = Scheduler(bm, max_batch_size=2, max_batched_tokens=64)
    seq = make_seq(20, max_tokens=100)
    scheduler.add(seq)
    run_until_done(scheduler)
    assert seq.finish_reason is FinishReason.LENGTH
    assert bm.num_used_blocks == 0


def test_finishing_a_sequence_frees_its_blocks_in_any_state():
    bm = BlockManager(100, 4)
    scheduler = Scheduler(bm, max_batch_size=1, max_batched_tokens=64)
    running, waiting = make_seq(9), make_seq(9)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler)
    assert running.status is SequenceStatus.RUNNING and waiting.status is SequenceStatus.WAITING
    scheduler.finish(running, FinishReason.ABORT)
    scheduler.finish(waiting, FinishReason.ABORT)
    assert bm.num_used_blocks == 0
    assert not scheduler.has_work()


def test_shared_prompts_admitted_in_one_step_share_blocks():
    bm = BlockManager(100, 4)
    scheduler = Scheduler(bm, max_batch_size=8, max_batched_tokens=256)
    a, b = make_seq(13), make_seq(13)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [13, 1]
    assert b.num_cached_prompt_tokens == 12
    assert a.block_table[:3] == b.block_table[:3]


@pytest.mark.parametrize("kwargs", [{"max_batch_size": 0, "max_batched_tokens": 8},
                                    {"max_batch_size": 1, "max_batched_tokens": 0}])
def test_bad_limits_are_refused(kwargs):
    with pytest.raises(ValueError):
        Scheduler(BlockManager(4, 4), **kwargs)
