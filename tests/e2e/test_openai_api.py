"""The official ``openai`` client against the real stack: ASGI server, Redis, Celery worker, model."""

from __future__ import annotations

import pytest

from workers.engine import SamplingParams

from .conftest import DEPLOYMENT

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


def test_chat_greedy_equals_the_engine_run_directly(openai_client, reference_engine):
    reply = openai_client.chat.completions.create(model=DEPLOYMENT, messages=QUESTION, temperature=0, max_tokens=24)
    direct = reference_engine.submit_chat(QUESTION, SamplingParams(temperature=0, max_tokens=24)).result(timeout=120)

    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == direct.text
    assert choice.finish_reason == ("length" if direct.finish_reason == "length" else "stop")
    assert reply.object == "chat.completion" and reply.model == DEPLOYMENT and reply.id.startswith("chatcmpl-")
    assert reply.service_tier == "default"
    # The serving engine's configuration, not a constant: a client learns when it changes.
    from gateway.formatting import SYSTEM_FINGERPRINT
    assert reply.system_fingerprint.startswith("fp_") and reply.system_fingerprint != SYSTEM_FINGERPRINT
    assert reply.usage.prompt_tokens == direct.prompt_tokens
    assert reply.usage.completion_tokens == direct.completion_tokens
    assert reply.usage.total_tokens == direct.prompt_tokens + direct.completion_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_with_usage_matches_the_non_streamed_reply(openai_client):
    whole = openai_client.chat.completions.create(model=DEPLOYMENT, messages=QUESTION, temperature=0, max_tokens=20)
    chunks = list(openai_client.chat.completions.create(
        model=DEPLOYMENT, messages=QUESTION, temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    # Usage only on the last chunk, which has no choices.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_sends_no_usage_chunk(openai_client):
    chunks = list(openai_client.chat.completions.create(
        model=DEPLOYMENT, messages=QUESTION, temperature=0, max_tokens=5, stream=True))
    assert all(c.choices for c in chunks)
    assert all(getattr(c, "usage", None) is None for c in chunks)


def test_chat_logprobs_in_the_chat_shape(openai_client):
    reply = openai_client.chat.completions.create(
        model=DEPLOYMENT, messages=QUESTION, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    ended_by_eos = reply.choices[0].finish_reason == "stop"  # the end-of-text token has no entry, as with OpenAI
    assert len(content) == reply.usage.completion_tokens - ended_by_eos
    assert b"".join(bytes(entry.bytes) for entry in content) == reply.choices[0].message.content.encode()
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(max(alt.logprob for alt in entry.top_logprobs), abs=1e-4)


def test_logprobs_true_alone_is_valid(openai_client):
    reply = openai_client.chat.completions.create(
        model=DEPLOYMENT, messages=QUESTION, temperature=0, max_tokens=4, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in reply.choices[0].logprobs.content)


def test_completions_with_stop_and_logprobs(openai_client, reference_engine):
    prompt = "The capital of France is Paris. The capital of Italy is"
    direct = reference_engine.submit(prompt, SamplingParams(temperature=0, max_tokens=12)).result(timeout=120)
    assert len(direct.text) > 3
    stop = direct.text[2:4]  # a stop string from inside the greedy continuation
    reply = openai_client.completions.create(model=DEPLOYMENT, prompt=prompt, temperature=0, max_tokens=12,
                                             stop=[stop], logprobs=2)
    choice = reply.choices[0]
    assert reply.object == "text_completion"
    assert choice.text == direct.text[: direct.text.index(stop)]
    assert stop not in choice.text and choice.finish_reason == "stop"
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == len(choice.logprobs.top_logprobs)
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)


def test_completions_stream(openai_client):
    prompt = "One, two, three,"
    whole = openai_client.completions.create(model=DEPLOYMENT, prompt=prompt, temperature=0, max_tokens=10)
    chunks = list(openai_client.completions.create(model=DEPLOYMENT, prompt=prompt, temperature=0, max_tokens=10,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_seeded_sampling_reproduces_through_the_api(openai_client):
    def ask():
        return openai_client.chat.completions.create(
            model=DEPLOYMENT, messages=QUESTION, temperature=0.9, top_p=0.95, seed=1234, max_tokens=16,
        ).choices[0].message.content

    assert ask() == ask()


def test_models_lists_the_public_deployment(openai_client):
    ids = [m.id for m in openai_client.models.list().data]
    assert DEPLOYMENT in ids
    assert openai_client.models.retrieve(DEPLOYMENT).id == DEPLOYMENT


def test_a_started_request_tells_where_its_time_went(openai_client):
    from gateway.timing import parse

    raw = openai_client.completions.with_raw_response.create(model=DEPLOYMENT, prompt="Hello", max_tokens=2,
                                                              temperature=0)
    stages = parse(raw.headers.get("server-timing"))
    assert list(stages) == ["auth", "admit", "dispatch", "queue", "load"], raw.headers.get("server-timing")
    assert all(ms >= 0 for ms in stages.values())
    assert raw.parse().usage.completion_tokens >= 1


def test_structured_output_parses_into_the_clients_own_model(openai_client):
    """The openai package's ``parse`` sends a strict JSON schema made from a pydantic model and
    reads the reply back into it."""
    from typing import Literal

    from pydantic import BaseModel

    class Cat(BaseModel):
        name: str
        age: int
        colour: Literal["black", "white", "ginger"]

    ask = [{"role": "user", "content": "Describe a cat as JSON with its name, age and colour."}]
    reply = openai_client.chat.completions.parse(model=DEPLOYMENT, messages=ask, response_format=Cat,
                                                 temperature=0.8, seed=3, max_tokens=100)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Cat), choice.message.content


def test_json_mode_streams_a_json_object(openai_client):
    import json

    chunks = list(openai_client.chat.completions.create(
        model=DEPLOYMENT, messages=[{"role": "user", "content": "Describe a cat as JSON with its name, age and colour."}],
        temperature=0, max_tokens=100, stream=True, response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop", text
    assert isinstance(json.loads(text), dict), text


def test_structured_output_with_datetimes_uuids_and_bounds(openai_client):
    """pydantic writes them as JSON Schema formats, bounds (fractional ones too) and multipleOf,
    which the engine enforces (pydantic checks the reply as ``parse`` reads it)."""
    import datetime
    import uuid

    from pydantic import BaseModel, Field

    class Booking(BaseModel):
        guest: str
        arrives: datetime.date
        booked_at: datetime.datetime
        reference: uuid.UUID
        nights: int = Field(ge=1, le=30)
        price: float = Field(gt=0, multiple_of=0.01)
        rating: float = Field(ge=0.5, le=5, multiple_of=0.5)
        discount: float = Field(ge=0, lt=0.35)

    ask = [{"role": "user", "content": "A hotel booking as JSON: guest, arrival date, when it was booked, reference, "
                                       "nights, price, rating and discount."}]
    reply = openai_client.chat.completions.parse(model=DEPLOYMENT, messages=ask, response_format=Booking,
                                                 temperature=0.7, seed=5, max_tokens=300)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Booking), choice.message.content


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(openai_client, reference_engine):
    """lm-evaluation-harness's loglikelihood: the prompt written back with each token's logprob
    given the tokens before it (the first has none), and nothing generated with max_tokens=0."""
    context_ids = reference_engine.tokenizer.encode("The capital of France is")
    # The engine's own logprob of the token that follows, computed by generating it.
    expected = reference_engine.submit(context_ids, SamplingParams(temperature=0, max_tokens=1, logprobs=True)) \
        .result(timeout=120).logprobs[0]
    ids = context_ids + [expected.token_id]
    scored = openai_client.completions.create(model=DEPLOYMENT, prompt=ids, max_tokens=0, echo=True, logprobs=2,
                                              temperature=0)
    [choice] = scored.choices
    logprobs = choice.logprobs
    assert choice.text == reference_engine.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    assert "".join(logprobs.tokens) == choice.text and len(logprobs.tokens) == len(ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(ids))]
    assert logprobs.token_logprobs[-1] == pytest.approx(expected.logprob, abs=2e-3)
    for top, logprob in zip(logprobs.top_logprobs[1:], logprobs.token_logprobs[1:]):
        assert 1 <= len(top) <= 3 and max(top.values()) >= logprob - 1e-5

    # lm-evaluation-harness's own request: one token generated, its entry last, which it drops
    # (token_logprobs[ctxlen:-1]). A stop token or EOS ending the answer has its entry too, as in
    # OpenAI's completions, though it adds no text: here EOS, made the one choice by logit_bias.
    eos = reference_engine.config.eos_token_ids[0]
    harness = openai_client.completions.create(model=DEPLOYMENT, prompt=ids, max_tokens=1, echo=True, logprobs=1,
                                               temperature=0, logit_bias={str(eos): 100})
    [choice] = harness.choices
    assert choice.finish_reason == "stop" and harness.usage.completion_tokens == 1
    assert choice.text == reference_engine.tokenizer.decode(ids)  # EOS writes nothing
    assert len(choice.logprobs.tokens) == len(ids) + 1
    assert choice.logprobs.tokens[-1] == reference_engine.tokenizer.token_bytes(eos).decode()
    assert choice.logprobs.token_logprobs[:-1] == pytest.approx(logprobs.token_logprobs, abs=1e-4)
    assert choice.logprobs.text_offset[-1] == len(choice.text)

    # Streamed, with an answer after the prompt: the prompt first, then the answer's tokens.
    text = "One, two, three,"
    chunks = list(openai_client.completions.create(model=DEPLOYMENT, prompt=text, max_tokens=4, echo=True,
                                                   temperature=0, stream=True))
    whole = openai_client.completions.create(model=DEPLOYMENT, prompt=text, max_tokens=4, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == text + whole.choices[0].text
