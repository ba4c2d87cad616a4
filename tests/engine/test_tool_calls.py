"""Tool calls: the grammar that makes the model write them, the parser that reads them back, the
prompt that shows the model its tools, and the real model calling them."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine import Engine, InvalidRequestError, SamplingParams
from workers.engine.tool_calls import (
    OPEN, ToolCallParser, call_text, chat_messages, parse_tool_calls, tool_grammar_for,
)

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False},
}
TIME = {"name": "get_time", "description": "The time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                       "required": ["timezone"], "additionalProperties": False}}
NOW = {"name": "now"}  # no parameters: any object
TOOLS = [WEATHER, TIME, NOW]
PARIS = call_text("get_weather", '{"city": "Paris", "unit": "celsius"}')
UTC = call_text("get_time", '{"timezone": "UTC"}')


def accepts(choice, text: str, *, parallel: bool = True) -> bool:
    matcher = tool_grammar_for(TOOLS, choice, parallel).matcher()
    if not matcher.accepts(text.encode()):
        return False
    matcher.advance(text.encode())
    return matcher.done


# -- the grammar --------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_calls_whose_arguments_follow_the_schema_are_whole_replies(choice):
    assert accepts(choice, PARIS)
    assert accepts(choice, call_text("now", '{"anything": [1, 2]}'))
    assert accepts(choice, PARIS + "\n" + UTC)  # parallel calls, one per line


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', '{"city": "Paris", "unit": "kelvin"}',
                                       '{"city": "Paris", "unit": "celsius", "x": 1}', '["Paris"]'])
def test_arguments_that_break_the_schema_are_refused(arguments):
    assert not tool_grammar_for(TOOLS, "required", True).matcher().accepts(call_text("get_weather", arguments).encode())


def test_an_unknown_function_or_a_broken_form_is_refused():
    matcher = tool_grammar_for(TOOLS, "required", True).matcher()
    assert not matcher.accepts(call_text("get_wether", "{}").encode())
    assert not matcher.accepts(PARIS.replace("\n</tool_call>", "</tool_call>").encode())
    assert not matcher.accepts((PARIS + "\n\n" + UTC).encode())


def test_required_starts_with_a_call_and_cannot_end_before_one():
    matcher = tool_grammar_for(TOOLS, "required", True).matcher()
    assert not matcher.done
    assert [chr(b) for b, ok in enumerate(matcher.allowed_first_bytes()) if ok] == ["<"]
    assert not matcher.accepts(b"Sure")
    half = PARIS[:len(PARIS) // 2].encode()
    matcher.advance(half)
    assert not matcher.done and not matcher.failed


def test_auto_allows_text_then_calls_and_nothing_after_them():
    assert accepts("auto", "It is sunny.")
    assert accepts("auto", "Let me check.\n" + PARIS)
    assert not accepts("auto", PARIS + "\nDone.")
    matcher = tool_grammar_for(TOOLS, "auto", True).matcher()
    assert all(matcher.allowed_first_bytes()) and matcher.done
    # Once the tag is written the grammar holds, even when it arrives split across tokens.
    matcher.advance(b"Checking <tool_")
    assert matcher.done
    matcher.advance(b"call>")
    assert not matcher.done and not matcher.accepts(b" oops")
    assert matcher.accepts(b'\n{"name": "now"')


def test_a_named_choice_allows_that_function_once():
    named = {"name": "get_time"}
    assert accepts(named, UTC)
    assert not accepts(named, PARIS)
    assert not accepts(named, UTC + "\n" + UTC)
    assert not accepts("required", PARIS + "\n" + UTC, parallel=False)
    assert accepts("required", PARIS, parallel=False)


@pytest.mark.parametrize("parameters, allowed", [
    (None, True), ({}, True), ({"properties": {"a": {"type": "integer"}}}, True),
    ({"anyOf": [{"type": "object", "properties": {"a": {"const": 1}}}, {"$ref": "#/$defs/b"}],
      "$defs": {"b": {"type": "object"}}}, True),
    ({"type": "string"}, False), ({"type": ["object", "null"]}, False), ({"type": "array"}, False),
])
def test_arguments_are_always_an_object(parameters, allowed):
    tools = [{"name": "f", "parameters": parameters}]
    if not allowed:
        with pytest.raises(ValueError, match="must describe an object"):
            tool_grammar_for(tools, "required", True)
        return
    matcher = tool_grammar_for(tools, "required", True).matcher()
    assert not matcher.accepts(call_text("f", "5").encode()) and not matcher.accepts(call_text("f", "[1]").encode())
    assert matcher.accepts(call_text("f", '{"a": 1}').encode())


def test_stop_strings_apply_to_text_but_not_inside_calls():
    matcher = tool_grammar_for(TOOLS, "auto", True).matcher()
    assert matcher.stops_apply
    matcher.advance(b"Let me see.\n<tool_call>")
    assert not matcher.stops_apply
    matcher.advance(PARIS[len(OPEN):].encode())
    assert not matcher.stops_apply and matcher.done  # after a call only calls may follow


ANSWER = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": {
    "type": "object", "properties": {"sky": {"enum": ["sunny", "rainy"]}}, "required": ["sky"],
    "additionalProperties": False}}}


def test_auto_with_a_response_format_answers_in_its_json_or_calls():
    grammar = SamplingParams(tools=TOOLS, tool_choice="auto", response_format=ANSWER).grammar
    assert grammar is SamplingParams(tools=TOOLS, tool_choice="auto", response_format=ANSWER).grammar  # shared

    def whole(text: str) -> bool:
        matcher = grammar.matcher()
        if not matcher.accepts(text.encode()):
            return False
        matcher.advance(text.encode())
        return matcher.done

    assert whole('{"sky": "sunny"}') and whole(PARIS) and whole(PARIS + "\n" + UTC)
    assert not whole("It is sunny.") and not whole('{"sky": "foggy"}') and not whole('{"sky": "sunny"}' + PARIS)
    assert not whole("Let me check.\n" + PARIS)  # no text before a call: the reply is JSON or calls
    matcher = grammar.matcher()
    assert not matcher.done and [chr(b) for b, ok in enumerate(matcher.allowed_first_bytes()) if ok and chr(b) in "{<a"] \
        == ["<", "{"]
    matcher.advance(b'{"sky": "rai')
    assert matcher.stops_apply and not matcher.done  # a stop string may cut the answer, as without tools
    # "required" (or a named function) still means calls only: the answer does not apply.
    required = SamplingParams(tools=TOOLS, tool_choice="required", response_format=ANSWER).grammar.matcher()
    assert not required.accepts(b'{"sky"') and required.accepts(PARIS.encode())


def test_none_means_text_that_never_opens_a_call_and_schemas_are_checked():
    matcher = tool_grammar_for(TOOLS, "none", True).matcher()
    assert matcher.done and matcher.accepts(b"It is sunny. <tool_call")  # the tag's start may be text
    assert not matcher.accepts(b"Let me check.\n<tool_call>")
    assert SamplingParams(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}).grammar \
        is not tool_grammar_for(TOOLS, "none", True)  # JSON output applies, tools or not
    with pytest.raises(ValueError, match=r"tools\[0\] \(bad\).*uniqueItems"):
        tool_grammar_for([{"name": "bad", "parameters": {"type": "object", "properties": {
            "n": {"type": "array", "uniqueItems": True}}}}], "auto", True)
    with pytest.raises(ValueError, match="not in tools"):
        tool_grammar_for(TOOLS, {"name": "missing"}, True)


# -- the parser -----------------------------------------------------------------------------------


def test_a_reply_splits_into_its_text_and_calls():
    text, calls = parse_tool_calls("Let me look.\n" + PARIS + "\n" + call_text("now", "{}"))
    assert text == "Let me look."  # the line break before the call is no part of it
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                     {"name": "now", "arguments": "{}"}]


@pytest.mark.parametrize("reply", [
    "a <tool_call> that is no call", "ends inside the tag <tool_c", "x < y and <tool> and <tool_call<tool_call>  y",
    "trailing blanks \n\n ", "",
])
def test_text_that_only_looks_like_a_call_is_kept_whole(reply):
    assert parse_tool_calls(reply) == (reply, [])


def test_a_reply_that_can_only_call_keeps_no_cut_tag_as_text():
    assert parse_tool_calls("<tool_c", free=False) == ("", [])
    assert parse_tool_calls("<", free=False) == ("", [])
    assert parse_tool_calls(PARIS[:3], free=True) == (PARIS[:3], [])  # with auto it may be text


def test_a_reply_cut_inside_a_call():
    assert parse_tool_calls(PARIS[:-20]) == ("", [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "cel'}])
    # Cut before the name was whole: no call began, and its tag is no text either.
    assert parse_tool_calls("Let me see.\n" + PARIS[:25]) == ("Let me see.", [])
    parser = ToolCallParser()
    parser.feed(PARIS[:-3])
    assert not parser.whole
    parser.feed(PARIS[-3:])
    assert parser.whole


_ARGUMENTS = st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8),
    max_size=4)


@settings(max_examples=150, deadline=None)
@given(prose=st.text(max_size=30), calls=st.lists(st.tuples(st.sampled_from(["f", "get_x", "a-b_9"]), _ARGUMENTS),
                                                  max_size=3), cuts=st.lists(st.integers(1, 7), min_size=1),
       indent=st.sampled_from([None, 2]))
def test_streamed_in_any_pieces_the_parse_is_the_whole_parse(prose, calls, cuts, indent):
    while OPEN in prose:
        prose = prose.replace(OPEN, "")
    written = [(name, json.dumps(args, indent=indent, ensure_ascii=False)) for name, args in calls]
    reply = prose + (("\n" if prose else "") + "\n".join(call_text(n, a) for n, a in written) if written else "")
    parser, events, at, i = ToolCallParser(), [], 0, 0
    while at < len(reply):
        events += parser.feed(reply[at:at + cuts[i % len(cuts)]])
        at, i = at + cuts[i % len(cuts)], i + 1
    events += parser.finish()
    expected_text = prose.rstrip() if written else prose
    assert "".join(e[1] for e in events if e[0] == "text") == expected_text
    assert [(c["name"], json.loads(c["arguments"])) for c in parser.calls] == calls
    streamed = {}
    for event in events:
        if event[0] == "arguments":
            streamed[event[1]] = streamed.get(event[1], "") + event[2]
    assert [streamed.get(i, "") for i in range(len(calls))] == [a for _, a in written]
    assert [e[1:] for e in events if e[0] == "call"] == [(i, n) for i, (n, _) in enumerate(calls)]


# -- the prompt -------------------------------------------------------------------------------------


def test_the_conversation_shows_tools_past_calls_and_their_results():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "CET"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    ]
    out = chat_messages(messages, [WEATHER, TIME])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in out[0]["content"]
    assert parse_tool_calls(out[2]["content"])[1] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": '{"timezone": "CET"}'}]
    assert out[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n14:05\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)
    assert chat_messages(messages[1:2], None) == messages[1:2]  # no tools: unchanged
    # A user message right after results joins their turn: user and assistant turns alternate.
    follow_up = chat_messages(messages + [{"role": "user", "content": "And tomorrow?"}], None)
    assert [m["role"] for m in follow_up] == ["system", "user", "assistant", "user"]
    assert follow_up[-1]["content"].endswith("</tool_response>\nAnd tomorrow?")


def test_sampling_params_check_tools():
    for kwargs, param in [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TIME, TIME]}, "tools"),
        ({"tools": [{"name": "has space"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"name": "missing"}}, "tool_choice"),
        ({"tools": TOOLS, "response_format": "json"}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "none", "response_format": "json"}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "tools"),
        ({"tools": [{"name": "f", "parameters": {"type": "string"}}]}, "tools"),
        ({"tools": [{"name": "f", "parameters": {"type": "object", "uniqueItems": True}}]}, "tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ]:
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(**kwargs)
        assert caught.value.param == param, kwargs
    assert SamplingParams(tools=TOOLS, tool_choice="none", ignore_eos=True).grammar.matcher().done  # text may run on


# -- the real model -------------------------------------------------------------------------------

ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def engine(bundled_model_fp32):
    with Engine(bundled_model_fp32, max_batch_size=8, max_batched_tokens=256, num_kv_blocks=256) as eng:
        yield eng


def _calls(engine, choice, *, parallel=True, **params):
    params = {"max_tokens": 160, "temperature": 0, **params}
    out = engine.submit_chat(ASK, SamplingParams(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                                                 **params)).result(timeout=300)
    assert out.finish_reason == "stop", out.text
    return parse_tool_calls(out.text)


@pytest.mark.parametrize("temperature,seed,parallel", [(0, None, True), (1.0, 3, False), (1.0, 4, False)])
def test_the_model_calls_a_tool_with_valid_arguments_when_required(engine, temperature, seed, parallel):
    text, calls = _calls(engine, "required", parallel=parallel, temperature=temperature, seed=seed)
    assert text == "" and calls
    assert parallel or len(calls) == 1
    by_name = {t["name"]: t for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), by_name[call["name"]].get("parameters", {}))


def test_a_named_function_without_parallel_calls_is_called_once(engine):
    text, calls = _calls(engine, {"name": "get_time"}, parallel=False, temperature=1.0, seed=5)
    assert text == "" and [c["name"] for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME["parameters"])


def test_a_stop_string_cuts_text_but_not_a_call(engine):
    text, calls = _calls(engine, "required", parallel=False, stop=["\n", "}"])
    assert text == "" and len(calls) == 1
    json.loads(calls[0]["arguments"])
    out = engine.submit_chat(ASK, SamplingParams(tools=TOOLS, max_tokens=60, temperature=0, stop=["Paris"])).result(
        timeout=300)
    assert out.stop_reason == "Paris" and "Paris" not in out.text


def test_with_auto_and_a_response_format_the_model_answers_in_it_or_calls(engine):
    out = engine.submit_chat(ASK, SamplingParams(tools=TOOLS, tool_choice="auto", response_format=ANSWER,
                                                 max_tokens=160, temperature=0)).result(timeout=300)
    assert out.finish_reason == "stop", out.text
    text, calls = parse_tool_calls(out.text)
    if calls:
        assert text == ""
        by_name = {t["name"]: t for t in TOOLS}
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), by_name[call["name"]].get("parameters", {}))
    else:
        jsonschema.validate(json.loads(text), ANSWER["json_schema"]["schema"])


def test_with_auto_the_model_may_answer_in_text(engine):
    """This small model, not trained to call tools, answers the question itself; whatever it
    writes is either text or well-formed calls."""
    text, calls = _calls(engine, "auto")
    assert text and OPEN not in text and calls == []


def test_with_none_the_model_sees_the_tools_and_answers_in_text(engine):
    """The prompt is the one the turns that may call have (so the prefix cache serves it)."""
    params = dict(max_tokens=12, temperature=0, tools=TOOLS)
    auto = engine.submit_chat(ASK, SamplingParams(**params, tool_choice="auto")).result(timeout=300)
    none = engine.submit_chat(ASK, SamplingParams(**params, tool_choice="none")).result(timeout=300)
    assert none.prompt_tokens == auto.prompt_tokens and none.cached_prompt_tokens > 0
    assert OPEN not in none.text and none.text


def test_a_prompt_that_shows_tools_differs_from_one_that_does_not(engine):
    shown = engine.tokenizer.encode_chat(chat_messages(ASK, TOOLS))
    plain = engine.tokenizer.encode_chat(ASK)
    assert len(shown) > len(plain) + 50
    assert '"name": "get_weather"' in engine.tokenizer.decode(shown)


def test_arguments_come_in_the_parameters_order():
    """Not sorted by name (the compiled grammars' cache once keyed them by sorted JSON)."""
    tool = {"name": "f", "parameters": {"type": "object", "properties": {"zcity": {"type": "string"},
                                                                         "aunit": {"type": "string"}},
                                        "required": ["zcity", "aunit"], "additionalProperties": False}}
    matcher = tool_grammar_for([tool], "required", False).matcher()
    assert matcher.accepts(call_text("f", '{"zcity": "Oslo", "aunit": "c"}').encode())
    assert not matcher.accepts(call_text("f", '{"aunit": "c", "zcity": "Oslo"}').encode())
