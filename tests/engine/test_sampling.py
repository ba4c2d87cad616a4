"""Vectorized sampling without a model: each knob changes what it should, rows stay independent."""

import math

import pytest
import torch

from workers.engine.sampling import Sampler, SamplingBatch, argmax_rows, chunked_argmax
from workers.engine.sequence import InvalidRequestError, SamplingParams, StopStringMatcher

VOCAB = 50


def run(logits, params, histories=None, sampler=None, prompt_len=0):
    params = list(params)
    histories = histories or [[1] * prompt_len for _ in params]
    batch = SamplingBatch.build(params, histories, [prompt_len] * len(params), vocab_size=VOCAB)
    sampler = sampler or Sampler(seed=0)
    return sampler(logits.clone(), batch)


def draws(logits_row, params, n=400, seed=0):
    """n independent draws of one row (the row repeated n times in one batch)."""
    logits = logits_row.expand(n, -1).clone()
    return run(logits, [params] * n, sampler=Sampler(seed=seed)).token_ids


@pytest.fixture
def logits():
    torch.manual_seed(0)
    return torch.randn(4, VOCAB) * 3


def test_greedy_takes_the_argmax_of_each_row(logits):
    out = run(logits, [SamplingParams(temperature=0)] * 4)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("vocab,chunk", [(1000, 128), (1024, 128), (130, 1024)],
                         ids=["ragged-last-chunk", "whole-chunks", "one-short-chunk"])
def test_chunked_argmax_is_argmax_first_index_included(vocab, chunk):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    logits[1, :] = -1e30  # every value tied: the first index
    logits[2, [3, vocab - 1]] = 100.0  # tied across chunks: the first
    logits[3, vocab - 1] = 100.0  # in the padded last chunk
    if vocab > chunk:
        logits[4, [chunk - 1, chunk]] = 100.0  # tied across a chunk boundary
    assert torch.equal(chunked_argmax(logits, chunk=chunk), logits.argmax(dim=-1))


def test_argmax_rows_keeps_plain_argmax_off_the_gpu():
    logits = torch.randn(2, 40000)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_temperature_spreads_and_concentrates():
    row = torch.linspace(0, 10, VOCAB)
    hot = set(draws(row, SamplingParams(temperature=20.0)).tolist())
    cold = set(draws(row, SamplingParams(temperature=0.01)).tolist())
    assert cold == {VOCAB - 1}
    assert len(hot) > 20


def test_top_k_limits_to_the_k_best():
    row = torch.linspace(0, 1, VOCAB)
    seen = set(draws(row, SamplingParams(temperature=10.0, top_k=3)).tolist())
    assert seen == {VOCAB - 1, VOCAB - 2, VOCAB - 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    row = torch.full((VOCAB,), -30.0)
    row[[7, 8, 9]] = torch.tensor([0.5, 0.3, 0.2]).log()
    seen = set(draws(row, SamplingParams(top_p=0.7)).tolist())
    assert seen == {7, 8}
    assert set(draws(row, SamplingParams(top_p=0.5)).tolist()) == {7}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    row = torch.full((VOCAB,), -30.0)
    row[[1, 2, 3]] = torch.tensor([0.6, 0.3, 0.1]).log()
    seen = set(draws(row, SamplingParams(min_p=0.4)).tolist())
    assert seen == {1, 2}


def test_rows_use_their_own_settings_in_one_batch():
    row = torch.linspace(0, 1, VOCAB)
    logits = row.expand(300, -1).clone()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=10.0, top_k=2),
              SamplingParams(temperature=10.0)] * 100
    tokens = run(logits, params).token_ids.view(100, 3)
    assert set(tokens[:, 0].tolist()) == {VOCAB - 1}
    assert set(tokens[:, 1].tolist()) == {VOCAB - 1, VOCAB - 2}
    assert len(set(tokens[:, 2].tolist())) > 10


def test_seeded_rows_repeat_and_ignore_their_companions():
    torch.manual_seed(1)
    row = torch.randn(VOCAB)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = run(row[None].clone(), [seeded], sampler=Sampler(seed=1)).token_ids[0]
    companions = torch.randn(7, VOCAB)
    logits = torch.cat([companions[:3], row[None], companions[3:]])
    params = [SamplingParams(temperature=1.5)] * 3 + [seeded] + [SamplingParams(top_k=5)] * 4
    in_batch = run(logits, params, sampler=Sampler(seed=99)).token_ids[3]
    assert alone == in_batch
    # Different output positions draw different noise: over many steps the tokens vary.
    steps = {run(row[None].clone(), [seeded], histories=[[0] * n]).token_ids[0].item()
             for n in range(40)}
    assert len(steps) > 1


def test_unseeded_rows_differ_between_samplers():
    row = torch.zeros(VOCAB)
    a = draws(row, SamplingParams(), n=50, seed=1)
    b = draws(row, SamplingParams(), n=50, seed=2)
    assert not torch.equal(a, b)


def test_logit_bias_forces_and_bans_tokens(logits):
    forced = run(logits, [SamplingParams(temperature=0, logit_bias={11: 100})] * 4)
    assert forced.token_ids.tolist() == [11] * 4
    best = logits.argmax(-1)
    banned = run(logits, [SamplingParams(temperature=0, logit_bias={int(best[0]): -100}),
                          SamplingParams(temperature=0)] * 2)
    assert banned.token_ids[0] != best[0]
    assert banned.token_ids[1] == best[1]


def test_presence_and_frequency_penalties_push_down_generated_tokens():
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 1.0
    logits[:, 6] = 0.9
    history = [[0, 0, 5], [0, 0, 5, 5, 5]]  # prompt of 2 tokens, then outputs
    plain = SamplingBatch.build([SamplingParams(temperature=0)] * 2, history, [2, 2],
                                vocab_size=VOCAB)
    assert Sampler()(logits.clone(), plain).token_ids.tolist() == [5, 5]
    presence = SamplingParams(temperature=0, presence_penalty=0.5)
    out = Sampler()(logits.clone(), SamplingBatch.build([presence] * 2, history, [2, 2],
                                                        vocab_size=VOCAB))
    assert out.token_ids.tolist() == [6, 6]
    # Frequency grows with the count: 0.05 per use flips only the row that used 5 three times.
    frequency = SamplingParams(temperature=0, frequency_penalty=0.05)
    out = Sampler()(logits.clone(), SamplingBatch.build([frequency] * 2, history, [2, 2],
                                                        vocab_size=VOCAB))
    assert out.token_ids.tolist() == [5, 6]


def test_presence_penalty_ignores_the_prompt():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    out = Sampler()(logits, SamplingBatch.build([params], [[5, 5, 5]], [3], vocab_size=VOCAB))
    assert out.token_ids.tolist() == [5]


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 1.0
    logits[0, 6] = 0.6
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = Sampler()(logits, SamplingBatch.build([params], [[5, 1]], [2], vocab_size=VOCAB))
    assert out.token_ids.tolist() == [6]  # 1.0 / 2 < 0.6


def test_logprobs_are_log_softmax_of_the_processed_logits(logits):
    params = SamplingParams(temperature=0, logprobs=True, top_logprobs=3, logit_bias={2: 5.0})
    out = run(logits, [params] * 4)
    processed = logits.clone()
    processed[:, 2] += 5.0
    expected = torch.log_softmax(processed, -1)
    chosen = out.token_ids
    assert torch.allclose(out.logprobs, expected.gather(1, chosen[:, None]).squeeze(1))
    top_values, top_ids = expected.topk(3, dim=-1)
    assert torch.equal(out.top_ids, top_ids)
    assert torch.allclose(out.top_logprobs, top_values)
    assert math.isclose(float(out.top_logprobs[0, 0]), float(out.logprobs[0]), rel_tol=1e-6)


def test_sampled_tokens_are_never_masked_out():
    torch.manual_seed(3)
    logits = torch.randn(200, VOCAB)
    params = [SamplingParams(temperature=0.7, top_k=4, top_p=0.8, min_p=0.05)] * 200
    out = run(logits, params)
    top4 = logits.topk(4, dim=-1).indices
    assert all(out.token_ids[i] in top4[i] for i in range(200))


EVERY_FEATURE = [
    SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.02, seed=4, logprobs=True,
                   top_logprobs=3, presence_penalty=0.5, frequency_penalty=0.2,
                   repetition_penalty=1.2, logit_bias={1: 2.0}),
    SamplingParams(temperature=0, logprobs=True, top_logprobs=2),
    SamplingParams(temperature=1.3, top_k=-1, top_p=0.5),
    SamplingParams(temperature=0.5, top_k=12, seed=9),
]


def test_a_step_never_reads_a_tensor_back_to_the_host(monkeypatch):
    """On a GPU every such read waits for the device; a step's only one is ``to_host``."""
    torch.manual_seed(1)
    logits = torch.randn(len(EVERY_FEATURE), VOCAB)
    history = [[3, 4, 5, 3]] * len(EVERY_FEATURE)
    batch = SamplingBatch.build(EVERY_FEATURE, history, [2] * len(EVERY_FEATURE),
                                vocab_size=VOCAB)
    expected = Sampler(seed=0)(logits.clone(), batch)

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host inside the sampler")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = Sampler(seed=0)(logits.clone(), batch)
    monkeypatch.undo()
    assert torch.equal(out.token_ids, expected.token_ids)


def test_results_come_to_the_host_whole_in_one_transfer(logits):
    out = run(logits, EVERY_FEATURE)
    token_ids, logprobs, top_ids, top_logprobs = out.to_host()
    assert token_ids == out.token_ids.tolist()
    assert logprobs == out.logprobs.tolist()  # float32 values survive the float64 packing
    assert top_ids == out.top_ids.tolist() and top_logprobs == out.top_logprobs.tolist()
    assert all(isinstance(t, int) for t in token_ids)
    plain = run(logits, [SamplingParams(temperature=0)] * 4).to_host()
    assert plain == (logits.argmax(-1).tolist(), None, None, None)
    no_top = run(logits, [SamplingParams(temperature=0, logprobs=True)] * 4).to_host()
    assert no_top[2] is None and no_top[3] is None and len(no_top[1]) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_step_does_not_synchronise_until_its_results_are_read():
    torch.manual_seed(1)
    logits = torch.randn(len(EVERY_FEATURE), VOCAB, device="cuda")
    history = [[3, 4, 5, 3]] * len(EVERY_FEATURE)
    sampler = Sampler("cuda", seed=0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = SamplingBatch.build(EVERY_FEATURE, history, [2] * len(EVERY_FEATURE),
                                    vocab_size=VOCAB, device="cuda")
        out = sampler(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    token_ids = out.to_host()[0]
    cpu = Sampler(seed=0)(logits.cpu(), SamplingBatch.build(
        EVERY_FEATURE, history, [2] * len(EVERY_FEATURE), vocab_size=VOCAB))
    greedy = [i for i, p in enumerate(EVERY_FEATURE) if p.temperature == 0]
    assert [token_ids[i] for i in greedy] == [cpu.token_ids.tolist()[i] for i in greedy]


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 1.5), ("min_p", 2.0), ("max_tokens", 0), ("max_tokens", 2.5),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("seed", "x"), ("stop", [""]), ("stop", 5), ("stop_token_ids", [-1]),
    ("logit_bias", {"a": 1}), ("logit_bias", {3: 101}), ("top_logprobs", 21),
    ("logprobs", "yes"),
])
def test_bad_values_name_the_parameter(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field in str(info.value)


def test_top_logprobs_needs_logprobs():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(top_logprobs=2)
    assert info.value.param == "top_logprobs"


def test_openai_string_keys_in_logit_bias_become_ids():
    assert SamplingParams(logit_bias={"17": -5}).logit_bias == {17: -5.0}


def test_stop_strings_are_found_across_pieces_and_held_back():
    matcher = StopStringMatcher(["END", "##"])
    assert matcher.feed("hello E") == ("hello ", None)  # "E" could start "END"
    assert matcher.feed("N") == ("", None)
    assert matcher.feed("D and more") == ("", "END")


def test_held_text_is_released_when_it_stops_matching():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("the E") == ("the ", None)
    assert matcher.feed("nd") == ("End", None)
    assert matcher.feed(" EN") == (" ", None)
    assert matcher.flush() == "EN"


def test_earliest_stop_string_wins():
    matcher = StopStringMatcher(["bb", "a"])
    assert matcher.feed("xxbba") == ("xx", "bb")
