"""The JSON automaton behind response_format: it accepts exactly the texts the format allows."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.json_grammar import MAX_DEPTH, MAX_WS_LINES, JsonGrammar, SchemaError
from workers.engine.sequence import InvalidRequestError, SamplingParams

JSON_OBJECT = JsonGrammar.from_response_format({"type": "json_object"})


def grammar(schema) -> JsonGrammar:
    return JsonGrammar.from_response_format({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})


def matches(g: JsonGrammar, text: bytes | str, *, chunk: int = 1) -> bool:
    """Whether ``text``, fed ``chunk`` bytes at a time as tokens would be, is a whole value."""
    data = text.encode() if isinstance(text, str) else text
    m = g.matcher()
    for i in range(0, len(data), chunk):
        piece = data[i:i + chunk]
        if not m.accepts(piece):
            return False
        m.advance(piece)
    return m.done


def strict_object(data: bytes) -> bool:
    """Python's reading of the same rules: a JSON object in real UTF-8, no key twice in one
    object (which Python would take, keeping the last), with whitespace only where a writer puts it."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=lambda name: 1 / 0, object_pairs_hook=_unique)
    except (ValueError, ZeroDivisionError):
        return False
    return isinstance(value, dict) and blanks_where_a_writer_puts_them(data)


def _unique(pairs: list) -> dict:
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError("a key twice in one object")
    return dict(pairs)


WRITERS_RUN = re.compile(rb" |\n{1,%d}( *|\t*)" % MAX_WS_LINES)


def blanks_where_a_writer_puts_them(data: bytes) -> bool:
    """Outside strings, each run of whitespace follows "{", "[" or ",", or precedes "}" or "]",
    or is the one space after ":"; none starts or ends the text; each is one space, or newlines
    then indentation of one kind."""
    in_string = escaped = False
    i = 0
    while i < len(data):
        c = data[i:i + 1]
        if in_string:
            in_string = escaped or c != b'"'
            escaped = not escaped and c == b"\\"
        elif c == b'"':
            in_string = True
        elif c in b" \t\n\r":
            end = i
            while end < len(data) and data[end:end + 1] in b" \t\n\r":
                end += 1
            before, after, run = data[i - 1:i], data[end:end + 1], data[i:end]
            if not (before and after and (before in b"{[," or after in b"}]" or (before == b":" and run == b" "))):
                return False
            if not WRITERS_RUN.fullmatch(run):  # one space, or newlines then spaces or tabs
                return False
            i = end
            continue
        i += 1
    return True


scalars = st.none() | st.booleans() | st.integers(-10**12, 10**12) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                      st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
objects = st.dictionaries(st.text(max_size=6), values, max_size=5)


@settings(max_examples=150, deadline=None)
@given(objects, st.sampled_from([None, 1, 2]), st.booleans(), st.integers(1, 5))
def test_every_json_object_is_accepted_however_it_is_cut_into_tokens(value, indent, ascii_only, chunk):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assert matches(JSON_OBJECT, text, chunk=chunk), text


@settings(max_examples=300, deadline=None)
@given(objects, st.data())
def test_a_text_one_edit_away_from_json_is_accepted_exactly_when_python_reads_an_object(value, data):
    text = json.dumps(value, ensure_ascii=False).encode()
    at = data.draw(st.integers(0, len(text)))
    if data.draw(st.booleans()) and at < len(text):
        edited = text[:at] + text[at + 1:]
    else:
        edited = text[:at] + data.draw(st.sampled_from(list(b'{}[]",:0123456789.eE+-tfnul \\\n'))).to_bytes(1, "big") \
            + text[at:]
    assert matches(JSON_OBJECT, edited) == strict_object(edited), edited


@pytest.mark.parametrize("text", [b"[]", b'"x"', b"1", b'{"a"}', b'{"a": 01}', b'{"a": 1,}', b'{"a": tru}',
                                  b'{"a": "\x01"}', b'{"a": 1.}', b'{"a": .5}', b'{"a": "\\x"}', b"{} ",
                                  b'{"a": "\xff"}', b'{"a": "\xc3"}', b"{'a': 1}"])
def test_what_is_not_a_json_object_is_refused(text):
    assert not matches(JSON_OBJECT, text)


def test_a_run_of_blank_lines_is_cut_short():
    """Small models left free to indent emit newlines until max_tokens: a run is bounded."""
    assert matches(JSON_OBJECT, "{" + "\n" * MAX_WS_LINES + '"a": 1}')
    assert not matches(JSON_OBJECT, "{" + "\n" * (MAX_WS_LINES + 1) + '"a": 1}')


@pytest.mark.parametrize("text,ok", [
    ('{"a": 1}', True), ('{"a":1}', True), ('{\n  "a": [\n    1,\n    2\n  ]\n}', True), ("{ }", True),
    ('{"a": 1 }', True), ('{"a" : 1}', False), ('{"a":  1}', False), ('{"a":\n1}', False), ('{"a": 1 , "b": 2}', False),
    (' {"a": 1}', False), ('{"a": [1 ]}', True), ('{"a": [1 ,2]}', False),
    ('{"a": 1, "b": 2}', True), ('{\n\t"a": 1\n}', True), ('{\n  \n}', False), ('{\n\t  "a": 1}', False),
    ('{\t"a": 1}', False), ('{\r\n"a": 1}', False), ('{  "a": 1}', False), ('{"a": 1,\n  \n            \t\t}', False),
])
def test_whitespace_goes_only_where_a_json_writer_puts_it(text, ok):
    """A model that cannot write the token it wanted must not pad with blanks instead."""
    assert matches(JSON_OBJECT, text) == ok == blanks_where_a_writer_puts_them(text.encode())


def test_blanks_before_a_close_that_cannot_come_yet_are_refused():
    """No dead ends: after a member, blanks promise a close, so they wait for the required keys."""
    g = grammar({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"]})
    assert not g.matcher().accepts(b'{"a": 1\n')
    assert matches(g, '{"a": 1, "b": 2\n}')


def test_the_matcher_is_done_only_when_the_object_closes_and_then_takes_nothing():
    m = JSON_OBJECT.matcher()
    m.advance(b'{"a": [1')
    assert not m.done and m.accepts(b"2, 3]}") and not m.accepts(b"]]")
    m.advance(b"]}")
    assert m.done and not m.accepts(b" ") and not m.accepts(b"{")
    assert not m.accepts(b"")


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "annotations are ignored"},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 2},
        "nick": {"type": ["string", "null"]},
        "pet": {"anyOf": [{"const": "none"}, {"$ref": "#/$defs/pet"}]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    "$defs": {"pet": {"type": "object", "properties": {"kind": {"type": "string"}, "child": {"$ref": "#/$defs/pet"}},
                      "required": ["kind"]}},
}


@pytest.mark.parametrize("value", [
    {"name": "Ada", "age": 36},
    {"name": "", "age": -1},
    {"name": "x", "age": 0, "height": 1.5e3, "tags": ["a", 3], "nick": None},
    {"name": "x", "age": 0, "nick": "é"},
    {"name": "x", "age": 0, "pet": "none"},
    {"name": "x", "age": 0, "pet": {"kind": "cat", "child": {"kind": "kitten"}}},
])
def test_a_schema_accepts_its_instances(value):
    g = grammar(PERSON)
    assert matches(g, json.dumps(value)) and matches(g, json.dumps(value, indent=2), chunk=3)


@pytest.mark.parametrize("value", [
    {"name": "Ada"},  # a required property missing
    {"name": "Ada", "age": 36.5},  # integer
    {"name": "Ada", "age": "36"},
    {"name": "Ada", "age": 1, "email": "a@b"},  # additionalProperties false
    {"name": "Ada", "age": 1, "tags": []},  # minItems
    {"name": "Ada", "age": 1, "tags": ["a", "b", "a"]},  # maxItems
    {"name": "Ada", "age": 1, "tags": ["c"]},  # enum
    {"name": "Ada", "age": 1, "nick": 5},
    {"name": "Ada", "age": 1, "pet": {"child": {"kind": "x"}}},  # the referenced definition's required
    {"name": "Ada", "age": 1, "pet": "some"},
])
def test_a_schema_refuses_what_breaks_it(value):
    assert not matches(grammar(PERSON), json.dumps(value))


@pytest.mark.parametrize("text, accepted", [
    ('{"name": "a", "age": 1, "tags": ["a"], "nick": null}', True),  # "height" left out: optional
    ('{"name": "a", "age": 1, "nick": null, "tags": ["a"]}', False),  # "tags" comes before "nick"
    ('{"age": 1, "name": "a"}', False),  # "name" is declared first, and required
    ('{"name": "a", "age": 1, "pet": "none", "height": 2}', False),  # an optional key once passed
])
def test_properties_come_in_the_schemas_order(text, accepted):
    """As OpenAI's structured outputs write them: a "reasoning" declared before its "answer" is
    written first, which is its point."""
    assert matches(grammar(PERSON), text) is accepted


def test_a_property_comes_once():
    assert not matches(grammar(PERSON), '{"name": "a", "age": 1, "name": "b"}')


def test_an_object_without_declared_properties_takes_any_and_one_with_them_only_those():
    assert matches(grammar({"type": "object"}), '{"anything": [1, {"x": null}]}')
    assert not matches(grammar({"type": "object", "properties": {"a": {}}}), '{"b": 1}')
    extra = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    assert matches(grammar(extra), '{"a": 1, "ab": "x"}') and not matches(grammar(extra), '{"ab": 1}')


@pytest.mark.parametrize("text,ok", [
    ('"ab"', True), ('"abcd"', True), ('"a"', False), ('"abcde"', False), ('"é\\n😀"', True), ('"\\u00e9é"', True),
    ('"é"', False), ('"\\n\\t\\"\\\\x"', False),
])
def test_string_lengths_count_characters(text, ok):
    assert matches(grammar({"type": "string", "minLength": 2, "maxLength": 4}), text) == ok


def test_other_roots_end_where_their_value_does():
    assert matches(grammar({"type": "integer"}), "-12") and not matches(grammar({"type": "integer"}), "1.5")
    assert matches(grammar({"type": "array", "items": {"type": "boolean"}}), "[true, false]")
    assert matches(grammar({"enum": ["red", "green"]}), '"green"') and not matches(grammar({"enum": ["red"]}), '"r"')


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("schema,words", [
    ({"type": "string", "pattern": "^(?=a)"}, ["pattern", "lookarounds"]),
    ({"type": "string", "pattern": '^"quoted"$'}, ["pattern", "escapes"]),
    ({"type": "string", "pattern": "^[a-z]{3}$", "maxLength": 2}, ["minLength/maxLength"]),
    ({"type": "string", "pattern": "^a$", "format": "uuid"}, ["pattern beside format"]),
    ({"type": "object", "properties": {"e": {"type": "string", "format": "password"}}}, ["'password'", "#/properties/e"]),
    ({"type": "array", "uniqueItems": True}, ["'uniqueItems'"]),
    ({"type": "object", "required": ["a"]}, ["'a'", "required"]),
    ({"$ref": "#/$defs/missing"}, ["$ref", "missing"]),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, ["itself"]),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/a"}]}}}, ["itself"]),
    ({"anyOf": [{"$ref": "#"}]}, ["itself"]),
    (_nested(MAX_DEPTH + 1), ["nested", "32"]),
    ({"type": "date"}, ["type"]),
    ({"enum": []}, ["enum"]),
    ({"type": "array", "minItems": 3, "maxItems": 1}, ["maxItems"]),
    ({"type": "string", "minLength": -1}, ["minLength"]),
    ({"type": "object", "properties": {f"p{i}": {"type": "object", "properties": {f"q{j}": {} for j in range(10)}}
                                       for i in range(600)}}, ["5000 parts"]),
    (False, ["false"]),
])
def test_a_schema_it_cannot_enforce_is_refused_saying_where_and_why(schema, words):
    with pytest.raises(SchemaError) as caught:
        grammar(schema)
    assert all(w in str(caught.value) for w in words), str(caught.value)


def test_a_schema_nested_too_deep_for_python_is_refused_not_crashed():
    deep: dict = {}
    for _ in range(5000):
        deep = {"anyOf": [deep]}
    with pytest.raises(InvalidRequestError):
        SamplingParams(response_format={"type": "json_schema", "json_schema": {"schema": deep}})
    assert grammar(_nested(MAX_DEPTH - 1)) is not None
    chain = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)}
    chain["d5000"] = {"type": "null"}
    with pytest.raises(SchemaError):
        grammar({"$ref": "#/$defs/d0", "$defs": chain})


def test_recursive_definitions_that_consume_input_are_fine():
    tree = {"$ref": "#/$defs/t", "$defs": {"t": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}}}
    assert matches(grammar(tree), '{"kids": [{"kids": []}, {}]}')


def test_sampling_params_compile_the_format_and_name_it_in_errors():
    assert SamplingParams(response_format={"type": "text"}).grammar is None
    assert SamplingParams(response_format={"type": "json_object"}).grammar is not None
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "x"}}})
    assert caught.value.param == "response_format"
    with pytest.raises(InvalidRequestError):
        SamplingParams(response_format={"type": "json_object"}, ignore_eos=True)


# -- found in review ------------------------------------------------------------------------------

def test_a_declared_property_cannot_come_back_as_an_undeclared_one():
    g = grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True})
    assert matches(g, '{"a": 1, "b": "x"}') and matches(g, '{"ab": "x", "a": 2}')
    assert not matches(g, '{"a": "str"}') and not matches(g, '{"a": 1, "a": 2}')
    assert not matches(g, '{"\\u0061": "str"}')  # an escape spelling a declared name
    assert not matches(JSON_OBJECT, '{"x": 1, "x": 2}') and matches(JSON_OBJECT, '{"x": 1, "y": {"x": 2}}')


def test_a_thousand_value_enum_under_a_union_stays_one_reading():
    kinds = {"enum": [f"v{i:03d}" for i in range(1000)]}
    options = [{"type": "object", "properties": {"c": {"$ref": "#/$defs/kind"}, "kind": {"const": f"k{i}"}},
                "required": ["c", "kind"], "additionalProperties": False} for i in range(5)]
    g = grammar({"anyOf": options, "$defs": {"kind": kinds}})
    assert matches(g, '{"c": "v001", "kind": "k1"}') and not matches(g, '{"c": "v1000", "kind": "k1"}')
    m = g.matcher()
    m.advance(b'{"c": "v0')
    assert len(m.states) <= 5


def test_schema_containers_nest_past_the_limit_for_free_values():
    node = {"type": "object", "properties": {"child": {"$ref": "#/$defs/n"}, "name": {"type": "string"}},
            "required": ["name"], "additionalProperties": False}
    g = grammar({"$ref": "#/$defs/n", "$defs": {"n": node}})
    text = '{"child": ' * (MAX_DEPTH + 8) + '{"name": "x"}' + ', "name": "y"}' * (MAX_DEPTH + 8)
    assert matches(g, text)
    deep = '{"a": ' * MAX_DEPTH
    m = JSON_OBJECT.matcher()
    m.advance(deep.encode())
    assert not m.accepts(b"{") and m.accepts(b'"x"}')  # free nesting stops, but never a dead end


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"type": "object", "properties": {"ok": {"type": "string"}, "bad": {"$ref": "#/$defs/loop"}},
     "$defs": {"loop": {"type": "object", "properties": {"x": {"$ref": "#/$defs/loop"}}, "required": ["x"]}}},
])
def test_a_schema_without_a_finite_value_is_refused(schema):
    with pytest.raises(SchemaError, match="finite"):
        grammar(schema)


@pytest.mark.parametrize("schema", [
    {"enum": ["\ud800"]}, {"const": "\ud83d"}, {"type": "object", "properties": {"\udc00": {}}},
    {"enum": [[float("nan")]]}, {"const": {"a": float("inf")}},
    {"type": "object", "properties": {"a": {}}, "anyOf": [{"type": "object"}, {"type": "null"}]},
    {"$ref": "#/$defs/s", "maxLength": 2, "$defs": {"s": {"type": "string"}}},
    {"enum": ["a"], "maxLength": 3},
    {"type": "integer", "enum": ["a", "b"]},
])
def test_what_would_be_ignored_or_cannot_be_json_is_refused(schema):
    with pytest.raises(SchemaError):
        grammar(schema)


def test_an_enum_keeps_the_values_of_its_type_and_tables_keep_their_names():
    g = grammar({"type": "integer", "enum": ["a", 1, 2.0]})
    assert matches(g, "1") and matches(g, "2.0") and not matches(g, '"a"')
    both = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}, "definitions": {"a": {"type": "string"}}}
    assert matches(grammar(both), "1") and not matches(grammar(both), '"x"')
    both["$ref"] = "#/definitions/a"
    assert matches(grammar(both), '"x"') and not matches(grammar(both), "1")


@pytest.mark.parametrize("raw,ok", [
    (b"\xe2\x82\xac", True), (b"\xf0\x9f\x98\x80", True), (b"\xc3\xa9", True),
    (b"\xe0\x80\x80", False), (b"\xc0\xaf", False), (b"\xed\xa0\x80", False), (b"\xf4\x90\x80\x80", False),
    (b"\xf5\x80\x80\x80", False), (b"\x80", False),
])
def test_strings_hold_only_well_formed_utf8(raw, ok):
    assert matches(JSON_OBJECT, b'{"a": "' + raw + b'"}') == ok


def test_a_long_chain_of_definitions_under_a_union_compiles_and_matches():
    """Found in QA: the finiteness check went over every node once per level (seconds here)."""
    defs = {f"d{i}": {"type": "object", "properties": {"p": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["p"]}
            for i in range(1650)}
    defs["d1650"] = {"type": "string"}
    g = grammar({"$defs": defs, "anyOf": [{"$ref": f"#/$defs/d{i}"} for i in range(1640, 1651)]})
    assert matches(g, '"x"') and matches(g, '{"p": {"p": "x"}}') and not matches(g, '{"p": 1}')


def test_pydantics_discriminator_is_an_annotation():
    cat = {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}
    dog = {"type": "object", "properties": {"kind": {"const": "dog"}, "barks": {"type": "boolean"}}, "required": ["kind"]}
    g = grammar({"type": "object", "properties": {"pet": {"oneOf": [cat, dog], "discriminator": {"propertyName": "kind"}}},
                 "required": ["pet"]})
    assert matches(g, '{"pet": {"kind": "dog", "barks": true}}') and not matches(g, '{"pet": {"kind": "cow"}}')


def test_the_same_format_compiles_once():
    from workers.engine.json_grammar import grammar_for

    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": PERSON}}
    assert grammar_for(rf) is grammar_for(json.loads(json.dumps(rf))) is SamplingParams(response_format=rf).grammar


def test_a_requested_format_keeps_its_properties_order():
    """Through the cache of compiled formats too, which once keyed a format by its JSON with sorted
    keys and compiled that: an "answer" came before its "reasoning"."""
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    g = SamplingParams(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).grammar
    assert matches(g, '{"reasoning": "r", "answer": 5}')
    assert not matches(g, '{"answer": 5, "reasoning": "r"}')
