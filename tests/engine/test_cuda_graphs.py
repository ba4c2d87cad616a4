"""The GPU runtime's pieces that run anywhere: decode batches padded to a graph bucket (run eagerly
on CPU, the same code a captured graph replays), the device report in the engine's stats, and the
KV pool's sizing options. Tests marked ``cuda`` run only where a CUDA device is present."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from workers.engine import Engine, SamplingParams
from workers.engine.cuda_graphs import (
    DecodeStep,
    bucket_for,
    graph_batch_sizes,
    pad_decode_step,
)
from workers.engine.loader import load_model
from workers.engine.model_runner import ModelRunner, device_name, dummy_step
from workers.engine.sequence import Sequence

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ------------------------------------------------------------------------------- buckets


def test_buckets_run_from_one_to_the_largest_batch():
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20)[-1] == 20


@pytest.mark.parametrize("max_batch_size", [1, 3, 8, 20, 64, 100])
def test_every_batch_gets_the_smallest_bucket_that_holds_it(max_batch_size):
    sizes = graph_batch_sizes(max_batch_size)
    for n in range(1, max_batch_size + 1):
        bucket = bucket_for(n, sizes)
        assert bucket >= n
        assert not [s for s in sizes if n <= s < bucket]
        assert bucket - n < 8  # never more than 7 padded rows
    assert bucket_for(max_batch_size + 1, sizes) is None


def test_bad_bucket_requests_are_refused():
    with pytest.raises(ValueError, match="max_batch_size"):
        graph_batch_sizes(0)
    with pytest.raises(ValueError, match="at least one sequence"):
        bucket_for(0, [1, 2])


def test_padded_rows_write_nothing_and_read_the_padding_block():
    step = DecodeStep(np.array([5, 6], dtype=np.int64), np.array([9, 3], dtype=np.int64),
                      np.array([77, 12], dtype=np.int64), np.array([10, 4], dtype=np.int32),
                      np.array([[3, 4], [1, 0]], dtype=np.int32))
    padded = pad_decode_step(step, 4, pad_block=99)
    assert padded.num_seqs == 4
    assert padded.input_ids[:2].tolist() == [5, 6] and padded.positions[:2].tolist() == [9, 3]
    assert padded.slot_mapping.tolist() == [77, 12, -1, -1]
    assert padded.context_lens.tolist() == [10, 4, 1, 1]
    assert padded.block_tables.tolist() == [[3, 4], [1, 0], [99, 0], [99, 0]]
    assert padded.context_lens.dtype == np.int32 and padded.block_tables.dtype == np.int32
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode_step(step, 1, pad_block=99)


# ------------------------------------------------------------------ padded decode on CPU


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama"), dtype=torch.float32)


def prefilled_runner(tiny, num_seqs: int, *, max_batch_size=8, block_size=4, seed=0,
                     device="cpu", cuda_graphs=False):
    """A runner whose cache holds ``num_seqs`` prefilled sequences (each with its first sampled
    token appended, ready to decode). Every block but the padding block starts as NaN, so a read
    of a slot nobody wrote shows in the logits."""
    runner = ModelRunner(tiny.model, num_blocks=64, block_size=block_size, device=device,
                         dtype=next(tiny.model.parameters()).dtype,
                         max_batch_size=max_batch_size, max_model_len=64,
                         cuda_graphs=cuda_graphs)
    for k_cache, v_cache in runner.kv_caches:
        k_cache[:runner.num_blocks].fill_(float("nan"))
        v_cache[:runner.num_blocks].fill_(float("nan"))
    rng = random.Random(seed)
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    vocab = tiny.config.vocab_size
    seqs = []
    for i in range(num_seqs):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 13))]
        seq = Sequence(str(i), prompt, SamplingParams(temperature=0), max_tokens=8,
                       arrival_time=0.0)
        seq.block_table = [free.pop() for _ in range(-(-(len(prompt) + 4) // block_size))]
        seqs.append(seq)
    result = runner.execute(seqs, [s.num_tokens for s in seqs])
    for seq, token in zip(seqs, result.token_ids):
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(token)
    return runner, seqs


def decode_step(runner, seqs) -> DecodeStep:
    plan = runner._plan(seqs, [1] * len(seqs))
    return DecodeStep(plan.tokens, plan.positions, plan.slots, plan.context_lens.astype(np.int32),
                      plan.block_tables)


@pytest.mark.parametrize("num_seqs", [1, 3, 5, 8])
def test_a_padded_decode_step_gives_the_real_rows_the_unpadded_logits(tiny, num_seqs):
    runner, seqs = prefilled_runner(tiny, num_seqs)
    plan = runner._plan(seqs, [1] * num_seqs)
    expected = runner._run_eager(plan)  # writes this step's K/V; the padded run rewrites the same
    padded = runner.padded_decode()
    logits = padded.run(decode_step(runner, seqs))
    assert logits.shape == expected.shape == (num_seqs, tiny.config.vocab_size)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    # The padded rows of the bucket are well defined too (they attend over the zeroed block).
    bucket = bucket_for(num_seqs, padded.sizes)
    assert torch.isfinite(padded._forward(bucket)).all()


@pytest.mark.parametrize("num_seqs", [1, 3, 8])
def test_a_decode_step_read_straight_from_the_sequences_matches_the_planned_one(tiny, num_seqs):
    """``run_decode`` (the runner's path for decode steps) fills the inputs from the sequences
    themselves: the same rows, padding and logits as the planned ``run``, after a larger step
    left other rows in the buffers."""
    runner, seqs = prefilled_runner(tiny, 8)
    padded = runner.padded_decode()
    expected = padded.run(decode_step(runner, seqs[:num_seqs])).clone()
    planned = [t.clone() for t in (padded.input_ids, padded.positions, padded.slot_mapping,
                                   padded.context_lens)]
    padded.run(decode_step(runner, seqs))  # all eight rows: stale rows for the smaller step
    logits = padded.run_decode(seqs[:num_seqs])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    size = bucket_for(num_seqs, padded.sizes)
    for mine, theirs in zip((padded.input_ids, padded.positions, padded.slot_mapping,
                             padded.context_lens), planned):
        assert torch.equal(mine[:size], theirs[:size])
    assert padded.block_tables[num_seqs:size, 0].eq(runner.pad_block).all()


def test_a_decode_step_past_the_graphs_longest_context_is_left_to_the_eager_path(tiny):
    runner, seqs = prefilled_runner(tiny, 2)
    padded = runner.padded_decode()
    seqs[1].num_computed_tokens = padded.max_blocks * runner.block_size
    assert padded.run_decode(seqs) is None


def interpreted_triton_backend():
    """The Triton backend over a copy of the kernels imported to run in Triton's CPU
    interpreter (the rest of the process keeps its mode)."""
    from tests.engine.interpreted import import_interpreted
    from workers.engine.attention import triton_kernels
    from workers.engine.attention.triton_backend import TritonBackend

    return TritonBackend(kernels=import_interpreted(triton_kernels))


def test_the_triton_decode_kernel_gives_the_padded_step_the_same_logits(tiny_model_dir):
    """What a captured graph runs on a GPU, under the interpreter: the Triton kernels told the
    longest allowed context rather than the step's, with padded rows, against the eager step."""
    own = load_model(tiny_model_dir("llama"), dtype=torch.float32)  # its backend gets swapped
    runner, seqs = prefilled_runner(own, 5)
    expected = runner._run_eager(runner._plan(seqs, [1] * 5))
    own.model.backend = interpreted_triton_backend()
    padded = runner.padded_decode()
    assert padded.max_model_len == 64 > max(s.num_tokens for s in seqs)
    torch.testing.assert_close(padded.run(decode_step(runner, seqs)), expected,
                               rtol=1e-4, atol=1e-4)
    assert torch.isfinite(padded._forward(8)).all()


def test_padded_rows_leave_the_cache_alone(tiny):
    runner, seqs = prefilled_runner(tiny, 3)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    step = decode_step(runner, seqs)
    runner.padded_decode().run(step)
    written = set(step.slot_mapping.tolist())
    bs = runner.block_size
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        changed = ~(torch.isclose(k, k0, equal_nan=True).all(dim=(2, 3)))  # [blocks, block_size]
        slots = {int(b) * bs + int(o) for b, o in changed.nonzero().tolist()}
        assert slots == written
        assert torch.equal(k[runner.pad_block], k0[runner.pad_block])
        assert torch.equal(v[runner.pad_block], v0[runner.pad_block])


def test_a_stale_wider_step_does_not_disturb_a_narrower_one(tiny):
    """The static block tables keep a wider step's columns; the next step must not read them."""
    runner, seqs = prefilled_runner(tiny, 4, seed=3)
    padded = runner.padded_decode()
    padded.block_tables.fill_(runner.num_blocks - 1)  # stale garbage everywhere (a NaN block)
    plan = runner._plan(seqs[:3], [1, 1, 1])
    expected = runner._run_eager(plan)
    torch.testing.assert_close(padded.run(decode_step(runner, seqs[:3])), expected,
                               rtol=1e-4, atol=1e-4)


def test_steps_that_do_not_fit_the_buckets_are_refused(tiny):
    runner, seqs = prefilled_runner(tiny, 3, max_batch_size=2)
    padded = runner.padded_decode()
    assert not padded.fits(3, 1) and padded.fits(2, padded.max_blocks)
    assert not padded.fits(1, padded.max_blocks + 1)
    with pytest.raises(ValueError, match="does not fit"):
        padded.run(decode_step(runner, seqs))


def test_the_engine_gives_the_same_tokens_with_padded_decode_steps(tiny):
    """The whole engine with every fitting decode step padded to its bucket (what graph replay
    runs) against plain steps: same greedy tokens, batch sizes that pad and that do not."""
    rng = random.Random(7)
    vocab = tiny.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 30))] for _ in range(11)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def outputs(padded: bool):
        engine = Engine(tiny, max_batch_size=16, max_batched_tokens=64, num_kv_blocks=128,
                        block_size=4, enable_prefix_caching=False)
        if padded:
            engine.runner.decode_graphs = engine.runner.padded_decode()
        with engine:
            return [r.token_ids for r in engine.generate(prompts, params, timeout=120)]

    assert outputs(padded=True) == outputs(padded=False)


# -------------------------------------------------------------- device report, KV sizing


def test_stats_report_the_device_and_the_kv_capacity(tiny):
    with Engine(tiny, num_kv_blocks=37, block_size=8, max_batch_size=4) as engine:
        stats = engine.stats()
    assert stats["kv_capacity_tokens"] == 37 * 8
    assert stats["instance"] == engine.instance
    assert stats["device_name"] == device_name("cpu") and stats["device_name"]
    assert stats["device_memory_total"] is None and stats["device_memory_free"] is None
    assert stats["cuda_graphs"] is False and stats["cuda_graph_capture_s"] is None


def test_the_cpu_device_name_is_the_processors():
    cpuinfo = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
             if line.startswith("model name")]
    if not names:
        pytest.skip("/proc/cpuinfo names no model")
    assert device_name("cpu") == names[0]


def test_kv_memory_sizes_the_pool_leaving_one_block_for_padding(tiny):
    from workers.engine.model_runner import kv_bytes_per_block

    per_block = kv_bytes_per_block(tiny.config, 8, torch.float32)
    engine = Engine(tiny, kv_memory=per_block * 21 + per_block // 2, block_size=8,
                    max_batch_size=64)
    assert engine.num_kv_blocks == 20
    assert engine.runner.kv_caches[0][0].shape[0] == 21
    with pytest.raises(ValueError, match="holds no block"):
        Engine(tiny, kv_memory=per_block, block_size=8)


@pytest.mark.parametrize("fraction", [0, -0.5, 1.5, "half", True, float("nan")])
def test_a_bad_kv_memory_fraction_is_refused_by_name(tiny, fraction):
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        Engine(tiny, kv_memory_fraction=fraction)


def test_kv_sizes_are_exclusive(tiny):
    with pytest.raises(ValueError, match="num_kv_blocks and kv_memory_fraction"):
        Engine(tiny, num_kv_blocks=8, kv_memory_fraction=0.5)
    with pytest.raises(ValueError, match="num_kv_blocks and kv_memory"):
        Engine(tiny, num_kv_blocks=8, kv_memory=1 << 20)


def test_the_memory_probe_step_runs_a_prefill_and_samples_with_every_feature(tiny):
    cfg = tiny.config
    shape = (40, 4, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    logits = dummy_step(tiny.model, caches, seq_lens=[30, 30, 7], num_logit_rows=5, sample=True)
    assert logits.shape == (5, cfg.vocab_size) and torch.isfinite(logits).all()
    decode = dummy_step(tiny.model, caches, seq_lens=[1] * 6, num_logit_rows=6,
                        max_context_len=64)
    assert decode.shape == (6, cfg.vocab_size) and torch.isfinite(decode).all()
    with pytest.raises(ValueError, match="needs 41 blocks"):
        dummy_step(tiny.model, caches, seq_lens=[164], num_logit_rows=1)


# ------------------------------------------------------------------------- on a GPU only


@cuda
@pytest.mark.parametrize("num_seqs", [1, 3, 8])
def test_cuda_graph_replay_gives_the_eager_logits(tiny_model_dir, num_seqs):
    loaded = load_model(tiny_model_dir("llama"), dtype=torch.bfloat16, device="cuda")
    runner, seqs = prefilled_runner(loaded, num_seqs, device="cuda", cuda_graphs=True)
    assert runner.decode_graphs.captured and runner.decode_graphs.sizes == [1, 2, 4, 8]
    expected = runner._run_eager(runner._plan(seqs, [1] * num_seqs))
    replayed = runner.decode_graphs.run(decode_step(runner, seqs))
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(replayed, expected, rtol=3e-2, atol=3e-2)
    # A second replay with other inputs (the next token) still follows the eager step.
    result = runner.execute(seqs, [1] * num_seqs)
    for seq, token in zip(seqs, result.token_ids):
        seq.num_computed_tokens += 1
        seq.token_ids.append(token)
    expected = runner._run_eager(runner._plan(seqs, [1] * num_seqs))
    torch.testing.assert_close(runner.decode_graphs.run(decode_step(runner, seqs)), expected,
                               rtol=3e-2, atol=3e-2)


@cuda
def test_cuda_graph_replay_gives_the_eager_tokens(tiny_model_dir):
    loaded = load_model(tiny_model_dir("llama"), dtype=torch.bfloat16, device="cuda")
    rng = random.Random(11)
    vocab = loaded.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(2, 40))] for _ in range(13)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = {}
    for graphs in (True, False):
        with Engine(loaded, max_batch_size=16, num_kv_blocks=256, cuda_graphs=graphs) as engine:
            stats = engine.stats()
            assert stats["cuda_graphs"] is graphs
            if graphs:
                assert stats["cuda_graph_batch_sizes"] == [1, 2, 4, 8, 16]
                assert stats["cuda_graph_capture_s"] > 0
            results[graphs] = [r.token_ids for r in engine.generate(prompts, params, timeout=300)]
    # bfloat16 sums in another order may flip a near tie late in a sequence: compare the start.
    same = sum(a[:4] == b[:4] for a, b in zip(results[True], results[False]))
    assert same >= len(prompts) - 1


@cuda
def test_cuda_stats_report_the_gpu_and_size_the_pool_from_free_memory(tiny_model_dir):
    loaded = load_model(tiny_model_dir("llama"), dtype=torch.bfloat16, device="cuda")
    with Engine(loaded, max_batch_size=8, kv_memory_fraction=0.05, max_model_len=256) as engine:
        stats = engine.stats()
    assert stats["device_name"] == torch.cuda.get_device_name()
    assert 0 < stats["device_memory_free"] <= stats["device_memory_total"]
    assert stats["kv_capacity_tokens"] == engine.num_kv_blocks * engine.block_size
    sizing = engine.kv_sizing
    assert sizing["fraction"] == 0.05 and sizing["step_reserve"] > 0
    assert sizing["kv_memory"] == int(sizing["free_after_weights"] * 0.05) - sizing["step_reserve"]
