"""OpenAI's deprecated ``functions`` / ``function_call``: read as tools (one call at most), with
errors naming the legacy fields, and answered as the legacy API did (``message.function_call``,
``finish_reason: "function_call"``, ``delta.function_call``)."""

from __future__ import annotations

import pytest

from gateway.errors import ApiError
from gateway.protocol import parse_chat
from tests.gateway.test_answers import CALL, EVENTS, delta, finished, run

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def chat(**body):
    return parse_chat({"model": "m", "messages": ASK, **body})


def refused(**body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        chat(**body)
    assert caught.value.status == 400
    return caught.value


def test_functions_are_tools_that_call_once():
    request = chat(functions=[WEATHER])
    assert request.sampling["tools"] == [WEATHER]
    assert request.sampling["tool_choice"] == "auto" and request.sampling["parallel_tool_calls"] is False
    assert request.extra["legacy_functions"] is True
    named = chat(functions=[WEATHER], function_call={"name": "get_weather"})
    assert named.sampling["tool_choice"] == {"name": "get_weather"}
    assert chat(functions=[WEATHER], function_call="none").sampling["tool_choice"] == "none"
    # Nothing to call: no tools, and the reply is plain (what frameworks send when they have none).
    for body in ({"functions": []}, {"function_call": "auto"}, {"functions": [], "function_call": "none"}):
        request = chat(**body)
        assert "tools" not in request.sampling and "legacy_functions" not in request.extra


def test_a_conversation_carries_a_call_and_its_result_as_a_tool_turn():
    messages = ASK + [
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"role": "function", "name": "get_weather", "content": "12 C, rain"},
    ]
    clean = chat(functions=[WEATHER], messages=messages).messages
    call = clean[1]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert clean[2] == {"role": "tool", "content": "12 C, rain", "tool_call_id": call["id"]}
    # Without functions in this request too (the turn that calls none may still show past calls).
    assert parse_chat({"model": "m", "messages": messages}).messages[2]["role"] == "tool"
    # A request that offers tools is answered in the tools form, whatever its history holds.
    tools = chat(messages=messages, tools=[{"type": "function", "function": WEATHER}])
    assert "legacy_functions" not in tools.extra and tools.sampling["parallel_tool_calls"] is True


def test_legacy_fields_sent_as_null_are_nothing():
    request = chat(functions=None, function_call=None)
    assert "tools" not in request.sampling and "legacy_functions" not in request.extra


@pytest.mark.parametrize("body, param, words", [
    ({"functions": [WEATHER], "tools": []}, "functions", "not both"),
    ({"function_call": "auto", "tool_choice": "auto"}, "function_call", "not both"),
    ({"functions": [WEATHER], "function_call": {"name": "nope"}}, "function_call", "'nope', which is not among"),
    ({"functions": [WEATHER], "function_call": "required"}, "function_call", '"none", "auto"'),
    ({"functions": {"name": "f"}}, "functions", "array"),
    ({"functions": ["get_weather"]}, "functions[0]", 'functions[0] must be {"name": ...'),
    ({"functions": [{"name": "bad name!"}]}, "functions[0]", "functions[0].name must be"),
    ({"functions": [{**WEATHER, "bogus": 1}]}, "functions[0]", "functions[0] takes no 'bogus'"),
    ({"functions": [WEATHER, WEATHER]}, "functions", "two functions named 'get_weather'"),
])
def test_bad_legacy_fields_are_named_as_sent(body, param, words):
    error = refused(**body)
    assert error.param == param and words in error.message, error.message
    assert "tools[" not in error.message and "tool_choice" not in error.message


@pytest.mark.parametrize("messages, param, words", [
    ([{"role": "function", "name": "get_weather", "content": "12 C"}], "messages[1].name", "does not call"),
    ([{"role": "assistant", "function_call": {"name": "get_weather", "arguments": "{}"}},
      {"role": "function", "name": "get_time", "content": "noon"}], "messages[2].name", "'get_time'"),
    ([{"role": "assistant", "function_call": {"name": "get_weather", "arguments": "{}"}},
      {"role": "user", "content": "and?"}], "messages[1].function_call", "not its result"),
    ([{"role": "assistant", "function_call": {"name": "get_weather"}}], "messages[1].function_call", "arguments"),
    ([{"role": "assistant", "function_call": {"name": "bad name!", "arguments": "{}"}},
      {"role": "function", "name": "bad name!", "content": "x"}], "messages[1].function_call", "function_call.name must be"),
    ([{"role": "user", "function_call": {"name": "f", "arguments": "{}"}}], "messages[1].function_call", "assistant"),
    ([{"role": "function", "content": "x"}], "messages[1].name", "name of the function"),
])
def test_a_bad_legacy_conversation_is_named_where_it_goes_wrong(messages, param, words):
    error = refused(functions=[WEATHER], messages=ASK + messages)
    assert error.param == param and words in error.message, error.message


LEGACY = {"sampling": {"tools": [{"name": "f", "parameters": {"type": "object"}}], "tool_choice": "auto",
                       "parallel_tool_calls": False}, "extra": {"legacy_functions": True}}


def test_a_legacy_reply_names_its_call_as_function_call():
    events = [EVENTS[0], delta(0, CALL[:20]), delta(1, "I cannot."), delta(0, CALL[20:]), finished("stop", "stop")]
    first, second = run("chat", events, stream=False, **LEGACY)["choices"]
    assert first["message"]["function_call"] == {"name": "f", "arguments": '{"a": 1}'}
    assert first["message"]["content"] is None and "tool_calls" not in first["message"]
    assert first["finish_reason"] == "function_call"
    assert second["message"]["content"] == "I cannot." and "function_call" not in second["message"]

    chunks = run("chat", events, stream=True, **LEGACY)
    deltas = [c["delta"]["function_call"] for chunk in chunks for c in chunk["choices"]
              if c["index"] == 0 and c["delta"].get("function_call")]
    assert deltas[0]["name"] == "f" and all("name" not in d for d in deltas[1:])
    assert "".join(d["arguments"] for d in deltas) == '{"a": 1}'
    assert not any(c["delta"].get("tool_calls") for chunk in chunks for c in chunk["choices"])
    ends = {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}
    assert ends == {0: "function_call", 1: "stop"}


def test_a_legacy_delta_is_the_first_calls_alone():
    from gateway.legacy_functions import function_call_delta

    second = {"index": 1, "function": {"arguments": "{}"}}
    assert function_call_delta([second]) is None
    assert function_call_delta([{"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}, second]) == \
        {"name": "f", "arguments": ""}
