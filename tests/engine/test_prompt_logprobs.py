"""Prompt logprobs (what ``echo`` with ``logprobs`` needs): each prompt token's logprob given the
tokens before it, computed as the prompt is, whatever its chunks, and never from the prefix cache."""

from __future__ import annotations

import math

import pytest

from workers.engine import Engine, InvalidRequestError, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. The capital of France is"


@pytest.fixture(scope="module")
def engine(bundled_model_fp32):
    # A small token budget: the scored prompts below are computed in several chunks.
    with Engine(bundled_model_fp32, max_batch_size=8, max_batched_tokens=16, num_kv_blocks=256) as eng:
        yield eng


def test_a_scored_text_gets_the_logprobs_its_tokens_had_when_generated(engine):
    generated = engine.submit(PROMPT, SamplingParams(temperature=0, max_tokens=12, logprobs=True)).result(timeout=120)
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    text_ids = prompt_ids + [entry.token_id for entry in generated.logprobs]

    scored = engine.submit(text_ids, SamplingParams(max_tokens=0, prompt_logprobs=3)).result(timeout=120)
    assert scored.prompt_token_ids == text_ids
    assert scored.finish_reason == "length" and scored.completion_tokens == 0 and scored.token_ids == []
    entries = scored.prompt_logprobs
    assert len(entries) == len(text_ids) and entries[0] is None
    assert [e.token_id for e in entries[1:]] == text_ids[1:]
    # The tail of the scored text is what was generated: the same logprobs, greedy's top choices.
    for entry, was in zip(entries[len(prompt_ids):], generated.logprobs):
        assert entry.logprob == pytest.approx(was.logprob, abs=2e-3)
        assert entry.top_logprobs[0][0] == was.token_id
    for entry in entries[1:]:
        values = [lp for _, lp in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-5
        assert math.isfinite(entry.logprob) and entry.logprob <= 0


def test_scoring_ignores_the_prefix_cache_and_generates_on_after_the_prompt(engine):
    long = " ".join([PROMPT] * 4)  # full KV blocks: cached for the next request
    warm = engine.submit(long, SamplingParams(temperature=0, max_tokens=4)).result(timeout=120)
    again = engine.submit(long, SamplingParams(temperature=0, max_tokens=4)).result(timeout=120)
    assert again.cached_prompt_tokens > 0  # the cache holds this prompt
    scored = engine.submit(long, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)).result(timeout=120)
    assert scored.cached_prompt_tokens == 0
    assert all(e.top_logprobs == [] for e in scored.prompt_logprobs[1:])
    assert scored.text == warm.text  # the answer after a scored prompt is the usual one
    # Only the first output carries the prompt.
    outputs = list(engine.submit(long, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)))
    assert outputs[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in outputs[1:])


def test_nothing_to_generate_is_valid_only_when_scoring():
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError):
        SamplingParams(prompt_logprobs=21)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


def test_a_request_ended_before_its_prompt_was_scored_hands_out_no_partial_scores(engine):
    long = " ".join([PROMPT] * 60)  # hundreds of 16-token chunks to compute
    handle = engine.submit(long, SamplingParams(max_tokens=0, prompt_logprobs=1))
    handle.abort()
    last = handle.result(timeout=120)
    assert last.finish_reason == "abort"
    assert last.prompt_logprobs is None and last.prompt_token_ids is None


def test_a_prompt_scored_without_an_answer_may_fill_the_whole_context(bundled_model_fp32):
    """Nothing is generated, as for an embedding: a prompt of the context's length is scored,
    where one that asks for a token after it is refused."""
    with Engine(bundled_model_fp32, max_batch_size=2, num_kv_blocks=32, max_model_len=48) as small:
        ids = small.tokenizer.encode(" ".join([PROMPT] * 4))[:48]
        scored = small.submit(ids, SamplingParams(max_tokens=0, prompt_logprobs=0)).result(timeout=120)
        assert len(scored.prompt_logprobs) == 48 and scored.completion_tokens == 0
        with pytest.raises(InvalidRequestError, match="no room to generate"):
            small.submit(ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
        with pytest.raises(InvalidRequestError, match="more than this model's context"):
            small.submit(ids + ids[:1], SamplingParams(max_tokens=0, prompt_logprobs=0))
