"""response_format on the real bundled model: the replies parse, follow their schema, and guiding
one request changes nothing for the others in its batch."""

from __future__ import annotations

import json

import jsonschema
import pytest

from workers.engine import Engine, SamplingParams

ASK = [{"role": "user", "content": "Describe a cat as JSON with its name, age and colour."}]
CAT = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "colour": {"enum": ["black", "white", "ginger"]},
                   "toys": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
JSON_OBJECT = {"type": "json_object"}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT, "strict": True}}


def make_engine(model, **kwargs):
    settings = dict(max_batch_size=16, max_batched_tokens=256, num_kv_blocks=256)
    settings.update(kwargs)
    return Engine(model, **settings)


@pytest.fixture(scope="module")
def engine(bundled_model_fp32):
    with make_engine(bundled_model_fp32) as eng:
        yield eng


def ask(engine, response_format, **params):
    params = {"max_tokens": 80, "temperature": 0, **params}
    return engine.submit_chat(ASK, SamplingParams(response_format=response_format, **params))


@pytest.mark.parametrize("temperature,seed", [(0, None), (0.8, 1), (1.0, 2)])
def test_json_object_replies_parse_as_objects(engine, temperature, seed):
    out = ask(engine, JSON_OBJECT, temperature=temperature, seed=seed, max_tokens=200).result(timeout=300)
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("temperature,seed", [(0, None), (0.8, 7), (1.0, 8)])
def test_json_schema_replies_are_instances_of_the_schema(engine, temperature, seed):
    out = ask(engine, JSON_SCHEMA, temperature=temperature, seed=seed, max_tokens=200).result(timeout=300)
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), CAT)


def test_without_a_format_the_same_prompt_is_not_bare_json(engine):
    """The test above is not passing by luck: left alone, this model wraps its JSON in prose."""
    out = ask(engine, None).result(timeout=300)
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_guided_and_free_requests_batched_together_each_get_what_they_would_alone(bundled_model_fp32):
    with make_engine(bundled_model_fp32) as alone:
        free_alone = ask(alone, None).result(timeout=300)
        schema_alone = ask(alone, JSON_SCHEMA).result(timeout=300)
    # A pool so small that the batch is preempted and recomputed: the grammar state survives it.
    with make_engine(bundled_model_fp32, num_kv_blocks=20, block_size=8) as eng:
        handles = [ask(eng, None), ask(eng, JSON_SCHEMA), ask(eng, JSON_OBJECT), ask(eng, JSON_SCHEMA)]
        free, schema, _, schema_again = [h.result(timeout=300) for h in handles]
        assert eng.stats()["batch_size_max"] > 1 and eng.stats()["preemptions"] > 0
    assert free.token_ids == free_alone.token_ids
    assert schema.token_ids == schema_again.token_ids == schema_alone.token_ids


def test_logprobs_and_stop_strings_work_on_guided_output(engine):
    out = ask(engine, JSON_SCHEMA, logprobs=True, top_logprobs=2).result(timeout=300)
    assert out.logprobs and all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in out.logprobs)
    cut = ask(engine, JSON_SCHEMA, stop=['"age"']).result(timeout=300)
    assert cut.finish_reason == "stop" and cut.stop_reason == '"age"' and '"age"' not in cut.text


def test_a_grammar_left_with_nothing_to_pick_fails_its_request_and_says_so(bundled_model_fp32):
    """It never should; if it does, the reply is an error, not a "stop" with broken JSON."""
    from workers.engine.guided import VocabBytes

    with make_engine(bundled_model_fp32) as eng:
        ask(eng, JSON_OBJECT, max_tokens=1).result(timeout=300)  # the engine reads its tokens' bytes
        vocab = eng.runner.vocab_bytes
        eng.runner.vocab_bytes = VocabBytes([None] * len(vocab.table), len(vocab.table))  # no token is text
        out = ask(eng, JSON_OBJECT).result(timeout=300)
        eng.runner.vocab_bytes = vocab
        assert out.finish_reason == "error" and "format" in out.error and out.completion_tokens == 0
        assert ask(eng, None, max_tokens=4).result(timeout=300).finish_reason == "length"


def test_formatted_strings_are_values_their_parsers_read(engine):
    """A pydantic model's datetime, UUID and e-mail fields come as JSON Schema formats, its
    Field(ge=..., le=...) as bounds."""
    import datetime
    import uuid

    event = {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "starts": {"type": "string", "format": "date-time"},
        "id": {"type": "string", "format": "uuid"}, "contact": {"type": "string", "format": "email", "maxLength": 40},
        "room": {"type": "string", "pattern": "^[A-Z]\\d{3}$"},
        "seats": {"type": "integer", "minimum": 2, "maximum": 40}, "budget": {"type": "number", "exclusiveMinimum": 0}},
        "required": ["title", "starts", "id", "contact", "room", "seats", "budget"], "additionalProperties": False}
    ask_event = [{"role": "user", "content": "Describe a meeting as JSON: title, start time, id, contact e-mail, room, "
                                             "seats and budget."}]
    out = engine.submit_chat(ask_event, SamplingParams(
        max_tokens=200, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "event", "schema": event}})).result(timeout=300)
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)
    jsonschema.validate(value, event)
    datetime.datetime.fromisoformat(value["starts"].replace("Z", "+00:00"))
    uuid.UUID(value["id"])
    assert "@" in value["contact"]
