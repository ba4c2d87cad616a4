"""Function calling through the whole stack, with the official ``openai`` client: tool calls
non-streamed and streamed, a named choice, the client's pydantic tools, and a conversation that
sends the results back."""

from __future__ import annotations

import json

import jsonschema
import pytest

from .conftest import DEPLOYMENT

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def create(client, **params):
    params = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 120, **params}
    return client.chat.completions.create(model=DEPLOYMENT, **params)


def test_a_required_call_comes_back_as_tool_calls_with_valid_arguments(openai_client):
    reply = create(openai_client, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    ids = [call.id for call in choice.message.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    for call in choice.message.tool_calls:
        assert call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert reply.usage.completion_tokens > 10  # the calls' tokens are billed like any others


def test_streamed_calls_add_up_to_the_whole_reply(openai_client):
    ask = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60, "logprobs": True}
    whole = create(openai_client, **ask).choices[0]
    chunks = list(create(openai_client, **ask, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id:  # a call's first delta: its id and name, once
                assert delta.index not in calls and delta.function.name
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c.choices[0].delta.content is None for c in chunks)  # no text can come: null, as OpenAI's
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    # Every token's logprob, the tags' too, each riding on a chunk that says something.
    streamed = [e.token for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in whole.logprobs.content]
    assert all(c.choices[0].delta.tool_calls for c in chunks[1:-1])


def test_a_named_function_is_the_one_called_once(openai_client):
    reply = create(openai_client, tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=1.0,
                   seed=11)
    choice = reply.choices[0]
    assert [call.function.name for call in choice.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), TIME)
    assert choice.finish_reason == "stop"  # OpenAI's for a call the client chose


def test_the_clients_pydantic_tools_parse(openai_client):
    import openai
    from pydantic import BaseModel

    class GetWeather(BaseModel):
        city: str
        unit: str

    reply = openai_client.chat.completions.parse(
        model=DEPLOYMENT, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=80)
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1 and isinstance(calls[0].function.parsed_arguments, GetWeather)


def test_results_sent_back_get_an_answer_in_text(openai_client):
    first = create(openai_client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Rain, 11 degrees."},
    ]
    reply = create(openai_client, messages=conversation, tool_choice="none", max_tokens=24).choices[0]
    assert reply.message.tool_calls is None and reply.message.content
    # The result reached the model: the same conversation with another result reads differently.
    other = conversation[:-1] + [{**conversation[-1], "content": "Sunny, 30 degrees."}]
    assert create(openai_client, messages=other, tool_choice="none", max_tokens=24).choices[0].message.content \
        != reply.message.content


def test_a_response_format_with_tools_gives_its_json_or_calls(openai_client):
    """As OpenAI's: with tool_choice "auto" the reply calls tools or answers in the format."""
    from typing import Literal

    import openai
    from pydantic import BaseModel

    class GetWeather(BaseModel):
        city: str

    class Forecast(BaseModel):
        sky: Literal["sunny", "cloudy", "rainy"]
        degrees: int

    call = {"id": "call_1", "type": "function", "function": {"name": "GetWeather", "arguments": '{"city": "Paris"}'}}
    conversation = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "Rain, 11 degrees."}]
    for messages in (ASK, conversation):
        reply = openai_client.chat.completions.parse(
            model=DEPLOYMENT, messages=messages, tools=[openai.pydantic_function_tool(GetWeather)],
            response_format=Forecast, temperature=0, max_tokens=80)
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.parsed is None
            assert isinstance(choice.message.tool_calls[0].function.parsed_arguments, GetWeather)
        else:
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Forecast)


def test_the_deprecated_functions_call_once_as_function_call(openai_client):
    """Older client code's ``functions``/``function_call``: one call, answered in the legacy shape,
    whole and streamed, and its result sent back as a ``function`` message."""
    functions = [tool["function"] for tool in TOOLS]
    ask = {"messages": ASK, "functions": functions, "function_call": {"name": "get_weather"}, "temperature": 0,
           "max_tokens": 60}
    whole = openai_client.chat.completions.create(model=DEPLOYMENT, **ask).choices[0]
    call = whole.message.function_call
    assert whole.finish_reason == "stop" and whole.message.tool_calls is None  # a named call, as OpenAI's
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    streamed = {"name": "", "arguments": ""}
    for chunk in openai_client.chat.completions.create(model=DEPLOYMENT, stream=True, **ask):
        delta = chunk.choices[0].delta
        assert not delta.tool_calls
        if delta.function_call:
            streamed["name"] += delta.function_call.name or ""
            streamed["arguments"] += delta.function_call.arguments or ""
    assert streamed == {"name": call.name, "arguments": call.arguments}

    conversation = ASK + [{"role": "assistant", "content": None, "function_call": call.model_dump()},
                          {"role": "function", "name": "get_weather", "content": "Rain, 11 degrees."}]
    reply = openai_client.chat.completions.create(model=DEPLOYMENT, messages=conversation, functions=functions,
                                                  function_call="none", temperature=0, max_tokens=24).choices[0]
    assert reply.message.function_call is None and reply.message.content and reply.finish_reason in ("stop", "length")
