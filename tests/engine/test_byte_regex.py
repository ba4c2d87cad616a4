"""Patterns and formats as byte automata: they match what Python's ``re`` matches, formats accept
the values parsers read, and inside JSON output no prefix of a string is a dead end."""

from __future__ import annotations

import datetime
import ipaddress
import json
import random
import re
import uuid
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.byte_regex import (
    FORMATS, RegexError, compile_format, compile_pattern, decimal_pattern, integer_pattern,
)
from workers.engine.json_grammar import JsonGrammar

# Bounds with a fraction, of up to four digits on either side of the point.
BOUNDS = st.decimals(-300, 300, places=2, allow_nan=False) | st.decimals(-2, 2, places=4, allow_nan=False)


def matches(regex, text: str) -> bool:
    states = regex.start
    for b in text.encode():
        states = regex.step(states, b)
        if not states:
            return False
    return regex.matches(states)


PATTERNS = [
    r"^[a-z]+$", r"ab+c", r"^(\d{3})-\d{4}$", r"^(foo|ba[rz])*$", r"^a{2,3}b?$", r"^[^aeiou ]{1,4}$", r"x.y",
    r"^\w+@\w+\.(com|org)$", r"^[A-Z][a-z]*( [A-Z][a-z]*)*$", r"^-?\d+(\.\d+)?$", r"^(?:ab|a)(?:bc|c)$", r"^\S+\s\S+$",
    r"^é+ü?$", r"^[\d\-]+$", r"^\x41\u0042$", r"^a{0}b$", r"^(a|)+$", r"^.{2}$", r"^(?P<word>[a-z]+)-\d$",
]


@settings(max_examples=300, deadline=None)
@given(pattern=st.sampled_from(PATTERNS), text=st.text(alphabet="abcxyzAB019-. @éü_", max_size=12))
def test_a_pattern_matches_what_python_matches(pattern, text):
    assert matches(compile_pattern(pattern), text) == bool(re.search(pattern, text, re.ASCII))


@pytest.mark.parametrize("name, good, bad", [
    ("date-time", ["2024-05-01T12:30:00Z", "1999-12-31T23:59:59.123456+05:30"], ["2024-5-01T12:30:00Z", "2024-05-01 12:30"]),
    ("date", ["2024-02-29", "2000-02-29", "0001-01-01", "2023-04-30"],
     ["2024-13-01", "24-01-01", "2023-02-29", "1900-02-29", "2023-04-31", "0000-01-01"]),
    ("time", ["12:30:00", "23:59:59.5Z"], ["24:00:00", "12:30"]),
    ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000", "g23e4567-e89b-12d3-a456-426614174000"]),
    ("email", ["ada.lovelace+x@example.co.uk"],
     ["ada@", "ada@example", "a da@example.com", ".a@example.com", "a..b@example.com", "a@-x.com"]),
    ("uuid4", ["123e4567-e89b-42d3-a456-426614174000"], ["123e4567-e89b-12d3-a456-426614174000"]),
    ("ipv4", ["192.168.0.1", "0.0.0.0"], ["256.0.0.1", "1.2.3"]),
    ("hostname", ["example.org", "a-b"], ["-a.org", "a..b"]),
    ("uri", ["https://example.org/a?b=c#d", "http://127.0.0.1:8000/x"],
     ["example.org", "http:// x", "mailto:ada@example.com", "http://", "https://x.org:99999"]),
    ("duration", ["P1D", "PT1H30M", "P1Y2M3DT4H5M6.5S", "-P2W"], ["P", "PT", "P1DT", "1D", "P1000000000D"]),
])
def test_formats_accept_the_values_parsers_read(name, good, bad):
    assert_matches(compile_format(name), good, bad)


def assert_matches(regex, good: list[str], bad: list[str]) -> None:
    assert [text for text in good if not matches(regex, text)] == []
    assert [text for text in bad if matches(regex, text)] == []


@pytest.mark.parametrize("name, parse", [
    ("date-time", lambda s: datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))),
    ("date", datetime.date.fromisoformat), ("uuid", uuid.UUID), ("ipv4", ipaddress.IPv4Address),
])
def test_random_values_of_a_format_parse(name, parse):
    """Walk the automaton at random to a match: what it allows, the parser reads (a day past the
    month's end aside, which a pattern cannot know)."""
    regex, rng = compile_format(name), random.Random(name)
    for _ in range(50):
        states, data = regex.start, b""
        while not (regex.matches(states) and rng.random() < 0.3) or not data:
            allowed = [b for b in range(256) if regex.step(states, b)]
            if not allowed:
                assert regex.matches(states)
                break
            b = rng.choice(allowed)
            states, data = regex.step(states, b), data + bytes((b,))
        text = data.decode()
        if name in ("date-time", "date") and int(text[8:10]) > 28:
            continue
        parse(text)


@pytest.mark.parametrize("pattern, why", [
    ("(?=a)", "lookarounds"), ("(?<!a)b", "lookarounds"), (r"(a)\1", "backreferences"), (r"\bword", "word boundaries"),
    ("a^b", "ends of the pattern"), ("a{3,2}", "out of range"), ("a{5000}", "out of range"), ('^"$', "escapes"),
    (r"^\n$", "escapes"), ("[z-a]", "backwards"), ("(ab", "not closed"), ("*a", "nothing to repeat"),
    ("(a{1,1000}){1,1000}", "too large"), ("(?<name", "name"), ("\ud800", "UTF-16"), (r"\uD83D", "UTF-16"),
    ("a**", "nothing to repeat"), ("a{2}{3}", "nothing to repeat"), (r"\Aa", "not supported"), ("^$*", "ends of the pattern"),
    ("((a?){49}){49}", "too complex"), ("(a?){1000}", "too complex"), ("[]a]", "matches no string"),
    ("(" * 5000, "nested too deep"),
])
def test_what_cannot_be_compiled_is_refused_saying_why(pattern, why):
    with pytest.raises(RegexError, match=why):
        compile_pattern(pattern)


@pytest.mark.parametrize("pattern, good, bad", [
    (r"^[é-ü]+$", ["éü", "ñ"], ["e", "ÿ"]),  # classes hold any characters
    (r"^\S+$", ["a€"], ["\u00a0", "a b", "\u3000"]),  # ECMAScript's white space, not ASCII's alone
    (r"^[^\s]$", ["x"], ["\u2028"]),
    (r"^.$", ["é", "\U0001F600"], ["\u2028"]),  # . is one character, not a line end
    (r"^ab|cd$", ["abx", "xcd", "ab"], ["xab", "cdx"]),  # anchors belong to their alternative
    (r"^a$|^b$", ["a", "b"], ["ab", "ba"]),
    (r"[^]", ["x"], [""]),  # ECMAScript's: any character
    (r"a{١}", ["a{١}"], ["a"]),  # not an ASCII digit: a literal brace
    (r"[\x00-\x7F]+", ["abc"], [""]),  # a range may start at what JSON escapes
])
def test_ecmascript_meaning(pattern, good, bad):
    assert_matches(compile_pattern(pattern), good, bad)


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^[A-Z]{2}(\\d{4})?$", "minLength": 3, "maxLength": 4},
    {"type": "string", "pattern": "^\\d{3}(\\d{2})?$", "minLength": 4, "maxLength": 4},
    {"type": "string", "format": "date-time", "minLength": 21, "maxLength": 21},
    {"type": "string", "pattern": "^(aa)+$", "minLength": 3, "maxLength": 3},
])
def test_length_bounds_no_string_of_the_pattern_has_are_refused(schema):
    from workers.engine.json_grammar import SchemaError

    with pytest.raises(SchemaError, match="minLength/maxLength"):
        grammar(schema)


def test_a_utf16_pair_spells_one_character():
    assert matches(compile_pattern(r"^\uD83D\uDE00+$"), "\U0001F600\U0001F600")


def test_an_unknown_format_names_the_known_ones():
    with pytest.raises(RegexError, match="'password'.*date-time"):
        compile_format("password")
    assert set(FORMATS) >= {"date-time", "date", "time", "uuid", "email", "uri", "duration", "ipv4", "hostname"}


def grammar(schema) -> JsonGrammar:
    return JsonGrammar.from_response_format({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})


def accepts(g: JsonGrammar, value) -> bool:
    m = g.matcher()
    data = json.dumps(value, ensure_ascii=False).encode()
    if not m.accepts(data):
        return False
    m.advance(data)
    return m.done


def test_in_json_output_a_pattern_constrains_string_values_only():
    g = grammar({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-\\d+$"},
                                                  "any": {"type": ["string", "integer"], "pattern": "^x"}},
                 "required": ["code"], "additionalProperties": False})
    assert accepts(g, {"code": "AB-12"}) and accepts(g, {"code": "AB-1", "any": 5}) and accepts(g, {"code": "ZZ-0", "any": "xy"})
    assert not accepts(g, {"code": "ab-12"}) and not accepts(g, {"code": "AB-"}) and not accepts(g, {"code": "AB-1", "any": "y"})
    # Written as it is: an escape could spell any character, so none is taken.
    assert not grammar({"type": "string", "pattern": "^a+$"}).matcher().accepts(b'"\\u0061"')


@settings(max_examples=60, deadline=None)
@given(schema=st.sampled_from([
    {"type": "string", "pattern": r"^[a-z]+\d*$", "maxLength": 5},
    {"type": "string", "pattern": r"^(ab|abcdef)$", "minLength": 3},
    {"type": "string", "pattern": r"x", "minLength": 2, "maxLength": 4},
    {"type": "string", "format": "email", "maxLength": 12},
    {"type": "string", "pattern": "^(é|ü)+-?$", "maxLength": 3},
    {"type": "array", "items": {"type": "string", "format": "date"}, "maxItems": 2},
    {"type": "string", "pattern": "^(ab|abcde|a)+$", "minLength": 4, "maxLength": 5},
    {"type": "string", "pattern": "^[A-Z]{2}(\\d{4})?$", "minLength": 2, "maxLength": 6},
    {"type": "string", "pattern": "^[^a]{1,3}$", "maxLength": 2},
]), seed=st.integers(0, 2**32))
def test_no_prefix_of_a_patterned_value_is_a_dead_end(schema, seed):
    """A random walk through what the grammar allows always reaches a whole value, whose strings
    are instances of the schema (lengths counted in characters)."""
    import jsonschema

    g, rng = grammar(schema), random.Random(seed)
    m, data = g.matcher(), b""
    while not (m.done and rng.random() < 0.2):
        allowed = [b for b, ok in enumerate(m.allowed_first_bytes()) if ok]
        assert allowed or m.done, data
        if not allowed:
            break
        b = rng.choice(allowed)
        m.advance(bytes((b,)))
        data += bytes((b,))
        assert len(data) < 2000, data  # every schema here bounds its values
    jsonschema.validate(json.loads(data), schema)


@settings(max_examples=200, deadline=None)
@given(low=st.none() | st.integers(-10**6, 10**6), high=st.none() | st.integers(-10**6, 10**6),
       values=st.lists(st.integers(-2 * 10**6, 2 * 10**6), max_size=20))
def test_an_integer_range_matches_exactly_its_integers_as_json_writes_them(low, high, values):
    if low is not None and high is not None and low > high:
        low, high = high, low
    regex = compile_pattern(integer_pattern(low, high))
    edges = [v for bound in (low, high) if bound is not None for v in (bound - 1, bound, bound + 1)]
    for value in values + edges + [0, 1, -1, 9, 10, -10]:
        assert matches(regex, str(value)) == ((low is None or value >= low) and (high is None or value <= high))
    assert not any(matches(regex, text) for text in ("01", "-0", "00", "-", "1.0", "+1", " 1"))


def test_in_json_output_bounds_hold():
    from workers.engine.json_grammar import SchemaError

    g = grammar({"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "rank": {"type": ["integer", "null"], "exclusiveMinimum": 0, "exclusiveMaximum": 10.5}},
        "required": ["age"], "additionalProperties": False})
    assert accepts(g, {"age": 0}) and accepts(g, {"age": 120, "rank": 10}) and accepts(g, {"age": 7, "rank": None})
    assert not accepts(g, {"age": 121}) and not accepts(g, {"age": -1}) and not accepts(g, {"age": 7, "rank": 0})
    assert not accepts(g, {"age": 7, "rank": 11}) and not accepts(g, {"age": 1.5})
    assert accepts(grammar({"type": "integer", "minimum": 3}), 1234) and not accepts(grammar({"type": "integer", "minimum": 3}), 2)
    int64 = grammar({"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1})  # as generated schemas bound
    assert accepts(int64, 2**63 - 1) and not accepts(int64, 2**63)
    lat = grammar({"type": "number", "minimum": -90, "maximum": 90})
    assert all(accepts(lat, v) for v in (-90, -90.0, 0, 45.25, 90)) and not any(accepts(lat, v) for v in (-90.5, 90.01))
    positive = grammar({"type": "number", "exclusiveMinimum": 0})
    assert accepts(positive, 0.5) and accepts(positive, 12) and not accepts(positive, 0) and not accepts(positive, 0.0)
    assert not accepts(positive, 1e30)  # bounded numbers are written without an exponent
    half_up = grammar({"type": "number", "minimum": 0.5, "exclusiveMaximum": 2.75})  # pydantic's ge=0.5, lt=2.75
    assert all(accepts(half_up, v) for v in (0.5, 0.75, 1, 2, 2.7499)) and not any(accepts(half_up, v) for v in (0.4999, 2.75, 3))
    tenth = grammar({"type": "number", "exclusiveMinimum": -0.1, "maximum": 0.1})  # 0.1 as written, not as a float
    assert all(accepts(tenth, v) for v in (-0.09, 0, 0.1)) and not any(accepts(tenth, v) for v in (-0.1, 0.1001, -1))
    for schema, words in [({"type": "number", "minimum": 1e-21}, "more digits"),
                          ({"type": "number", "maximum": 1, "exclusiveMinimum": 1}, "no number"),
                          ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer"),
                          ({"type": "integer", "minimum": True}, "must be a number"),
                          ({"type": "integer", "maximum": 10**400}, "beyond")]:
        with pytest.raises(SchemaError, match=words):
            grammar(schema)


def test_the_widest_bounds_compile():
    widest = Decimal("98765432109876543210.01234567890123456789")  # 20 digits either side: the most
    regex = compile_pattern(decimal_pattern(-widest, widest, low_open=True))
    assert matches(regex, "98765432109876543210.0123456789012345678899")
    assert not matches(regex, "98765432109876543210.012345678901234567891")
    with pytest.raises(RegexError, match="more digits"):
        decimal_pattern(Decimal("0.123456789012345678901"), None)


@settings(max_examples=200, deadline=None)
@given(low=st.none() | st.integers(-300, 300) | BOUNDS, high=st.none() | st.integers(-300, 300) | BOUNDS,
       low_open=st.booleans(), high_open=st.booleans(),
       values=st.lists(st.decimals(-400, 400, places=3, allow_nan=False), max_size=20))
def test_a_decimal_range_matches_exactly_its_numbers(low, high, low_open, high_open, values):
    if low is not None and high is not None and (low > high or (low == high and (low_open or high_open))):
        with pytest.raises(RegexError):
            decimal_pattern(low, high, low_open=low_open, high_open=high_open)
        return
    regex = compile_pattern(decimal_pattern(low, high, low_open=low_open, high_open=high_open))
    steps = (Decimal("-0.5"), Decimal("-0.001"), 0, Decimal("0.001"), Decimal("0.0001"))
    around = [Decimal(b) + d for b in (low, high) if b is not None for d in steps]
    for value in values + around + [Decimal(0), Decimal("0.0"), Decimal("-0.25")]:
        text = str(value) if value else "0"  # JSON's zero; "-0.0" is no number a writer makes
        inside = (low is None or (value > low if low_open else value >= low)) and \
            (high is None or (value < high if high_open else value <= high))
        assert matches(regex, text) == inside, text
