"""A bounded number's text in JSON output: taken only if it is a multiple (``multipleOf``), within
its bounds, and read as a double, still within them; no prefix the grammar allows is a dead end."""

from __future__ import annotations

import json
import random
from decimal import Decimal, localcontext

import pytest
from typing import Annotated

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import Field, TypeAdapter, ValidationError

from workers.engine.json_grammar import SchemaError
from workers.engine.number_text import Divisibility
from tests.engine.test_byte_regex import grammar

MULTIPLES = st.sampled_from([5, 7, 12, 0.25, 0.01, 0.3, 12.5, 1e-3])
BOUND = st.none() | st.integers(-60, 60) | st.decimals(-60, 60, places=2, allow_nan=False)


def takes(g, text: str) -> bool:
    m = g.matcher()
    data = text.encode()
    if not m.accepts(data):
        return False
    m.advance(data)
    return m.done


def schema_of(kind, multiple, low, high):
    schema = {"type": kind, "multipleOf": multiple}
    if low is not None:
        schema["minimum"] = float(low) if isinstance(low, Decimal) else low
    if high is not None:
        schema["maximum"] = float(high) if isinstance(high, Decimal) else high
    return schema


def exact(value) -> Decimal:
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["number", "integer"]), multiple=MULTIPLES, low=BOUND, high=BOUND,
       values=st.lists(st.decimals(-80, 80, places=3, allow_nan=False), max_size=15))
def test_a_number_is_taken_exactly_when_it_is_a_multiple_in_range(kind, multiple, low, high, values):
    schema = schema_of(kind, multiple, low, high)
    low, high = (None if b is None else exact(schema[name]) for b, name in ((low, "minimum"), (high, "maximum")))
    step = exact(multiple)
    if kind == "integer":  # the integers in range
        low = None if low is None else low.to_integral_value(rounding="ROUND_CEILING")
        high = None if high is None else high.to_integral_value(rounding="ROUND_FLOOR")
    first = None if low is None else int((low / step).to_integral_value(rounding="ROUND_CEILING"))
    last = None if high is None else int((high / step).to_integral_value(rounding="ROUND_FLOOR"))
    first = first if first is not None else (last if last is not None else 0) - 1000  # a window where unbounded
    last = last if last is not None else first + 2000
    inside = [v for v in (step * k for k in range(first, min(last, first + 20_000) + 1))
              if kind == "number" or v == v.to_integral_value()]
    if not inside:
        with pytest.raises(SchemaError, match="no (number|integer)"):
            grammar(schema)
        return
    g = grammar(schema)
    for value in values + inside[:5] + inside[-5:]:
        if kind == "integer":
            value = value.to_integral_value()
        text = format(value.normalize(), "f") if value else "0"
        expected = (low is None or value >= low) and (high is None or value <= high) and value % step == 0
        assert takes(g, text) == expected, (schema, text)


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from(["number", "integer"]), multiple=MULTIPLES, low=BOUND, high=BOUND,
       seed=st.integers(0, 2**32))
def test_no_prefix_of_a_multiple_is_a_dead_end(kind, multiple, low, high, seed):
    """A random walk through what the grammar allows (an array of such numbers) always ends in
    multiples, in range."""
    schema = schema_of(kind, multiple, low, high)
    try:
        g = grammar({"type": "array", "items": schema, "maxItems": 3})
    except SchemaError:
        return  # no multiple in range (the test above checks when)
    rng, m, data = random.Random(seed), None, b""
    m = g.matcher()
    while not (m.done and rng.random() < 0.5):
        allowed = [b for b, ok in enumerate(m.allowed_first_bytes()) if ok]
        assert allowed or m.done, data
        if not allowed:
            break
        # Prefer ending a number: a walk of random digits would otherwise rarely stop.
        ends = [b for b in allowed if b in b",]"]
        b = rng.choice(ends if ends and rng.random() < 0.3 else allowed)
        m.advance(bytes((b,)))
        data += bytes((b,))
        assert len(data) < 2000, data
    with localcontext(prec=4000):  # a walk may write many digits
        for value in json.loads(data, parse_float=Decimal, parse_int=Decimal):
            assert value % exact(multiple) == 0, data
            assert ("minimum" not in schema or value >= exact(schema["minimum"])) and \
                ("maximum" not in schema or value <= exact(schema["maximum"])), data


def test_a_multiple_counts_in_the_schema_size_as_the_work_of_following_it():
    """Compiling one can search every state a reading of its pattern meets: a schema of many large
    ones is refused before it takes seconds of the gateway's."""
    def of(properties: int) -> dict:
        return {"type": "object", "properties": {f"p{i}": {"type": "integer", "multipleOf": 499} for i in range(properties)}}

    grammar(of(4))  # 499 × 2 each, and the object and its properties
    with pytest.raises(SchemaError, match="more than 5000 parts"):
        grammar(of(6))


@settings(max_examples=200, deadline=None)
@given(divisor=st.integers(1, 3000) | st.sampled_from([3600, 5000, 8192, 86400, 100_000]),
       values=st.lists(st.integers(0, 10**12), min_size=1, max_size=20))
def test_divisibility_read_digit_by_digit_is_the_remainder_s(divisor, values):
    divisible = Divisibility(divisor)
    for value in [*values, *(divisor * v for v in values), divisor]:
        state = divisible.start
        for digit in str(value):
            state = divisible.step[state][int(digit)]
        assert (state == divisible.start) == (value % divisor == 0), value


def test_divisibility_keeps_only_the_states_digits_to_come_tell_apart():
    """A divisor prime to 10 needs every remainder; 10**k needs how many of the last k digits are
    zeros; what a multiple of both needs, their product at most."""
    assert [Divisibility(d).states for d in (7, 499, 10, 1000, 100_000, 25, 3600)] == [7, 499, 2, 4, 6, 4, 17]


@pytest.mark.parametrize("multiple", [1000, 3600, 86400, 2500, 0.125, 1e4])
def test_a_multiple_with_many_digits_but_few_states_is_followed(multiple):
    """Seconds in an hour or a day, whole thousands: exact, and cheap to compile."""
    schema = {"type": "integer" if multiple >= 1 else "number", "multipleOf": multiple, "minimum": -10**6,
              "maximum": 10**6}
    g = grammar(schema)
    step = exact(multiple)
    rng = random.Random(multiple)
    for value in [0, step, -step, step * 11, *(Decimal(rng.randrange(-10**6, 10**6)) for _ in range(200)),
                  *(step * rng.randrange(-10**6 // int(step) if step >= 1 else -1000, 1000) for _ in range(50))]:
        text = format(value.normalize(), "f") if value else "0"
        assert takes(g, text) == (value % step == 0 and -10**6 <= value <= 10**6), text


def test_a_multiple_the_engine_cannot_follow_is_refused_by_name():
    for schema, words in [({"type": "number", "multipleOf": 0}, "greater than 0"),
                          ({"type": "number", "multipleOf": "2"}, "greater than 0"),
                          ({"type": "integer", "multipleOf": 997}, "more digits"),  # 997 states
                          ({"type": "integer", "multipleOf": 65536}, "more digits"),  # 2,829
                          ({"type": "integer", "multipleOf": 10**6}, "at most 100,000"),  # too many to sort
                          ({"type": "integer", "multipleOf": 10, "minimum": 1, "maximum": 9}, "no number")]:
        with pytest.raises(SchemaError, match=words):
            grammar(schema)


def closest_to_a_bound(g, bound: str, *, largest: bool) -> str:
    """The number the grammar lets a writer take nearest ``bound``: its characters while they are
    allowed, then each step the largest (or smallest) digit allowed, a point when no digit is,
    until nothing more is."""
    m, text, following = g.matcher(), "", True
    while True:
        allowed = [chr(b) for b, ok in enumerate(m.allowed_first_bytes()) if ok]
        digits = sorted(c for c in allowed if c.isdigit())
        if following and len(text) < len(bound) and bound[len(text)] in allowed:
            choice = bound[len(text)]
        elif not text and allowed == ["-"]:
            choice = "-"
        else:
            choice = (digits[-1] if largest else digits[0]) if digits else "." if "." in allowed else None
        following = following and choice == bound[len(text):len(text) + 1]
        if choice is None:
            assert m.done, text
            return text
        m.advance(choice.encode())
        text += choice
        assert len(text) < 60, text  # a double holds no more


FLOAT_BOUND = st.floats(-1e6, 1e6, allow_nan=False) | st.sampled_from([0.0, 0.1, 0.5, 1 / 3, 2 / 3, 1e-5, 99.99, 0.3])


@settings(max_examples=150, deadline=None)
@given(low=st.none() | FLOAT_BOUND, high=st.none() | FLOAT_BOUND, low_open=st.booleans(), high_open=st.booleans(),
       multiple=st.none() | st.sampled_from([0.25, 0.01, 7]), toward_high=st.booleans(), largest=st.booleans())
def test_a_number_written_near_its_bound_is_still_inside_it_when_read_as_a_double(
        low, high, low_open, high_open, multiple, toward_high, largest):
    """pydantic reads the JSON number as a double and checks the bounds then: 0.49999999999999999999
    is below 0.5, but as a double it is 0.5, which ``lt=0.5`` refuses."""
    if low is not None and high is not None and low > high:
        low, high = high, low
    bounds = {}
    if low is not None:
        bounds["gt" if low_open else "ge"] = low
    if high is not None:
        bounds["lt" if high_open else "le"] = high
    if multiple is not None:
        bounds["multiple_of"] = multiple
    assume(bounds)  # (a number without either is written freely: no double can cross a bound)
    adapter = TypeAdapter(Annotated[float, Field(**bounds)])
    try:
        g = grammar(adapter.json_schema())
    except SchemaError:
        return  # an empty range (the tests above check when)
    bound = high if toward_high and high is not None or low is None else low
    text = closest_to_a_bound(g, "" if bound is None else format(Decimal(repr(bound)), "f"), largest=largest)
    try:
        adapter.validate_json(text)
    except ValidationError as exc:
        if multiple is None or "multiple" not in str(exc):  # (pydantic's multiple check is a float's)
            raise AssertionError(f"{text} for {bounds}: {exc}") from None


def test_numbers_past_what_a_double_holds_are_not_taken():
    below_half = grammar({"type": "number", "exclusiveMaximum": 0.5})
    assert takes(below_half, "0.499999999999999") and not takes(below_half, "0.4999999999999999")
    assert takes(below_half, "-123456789012345") and not takes(below_half, "-1234567890123456")
    positive = grammar({"type": "number", "exclusiveMinimum": 0})  # at most 20 places, 20 zeros in a row
    assert takes(positive, "0." + "0" * 19 + "1") and not takes(positive, "0." + "0" * 20 + "1")
    assert takes(positive, "0.5" + "0" * 13) and not takes(positive, "0.5" + "0" * 14)  # no digit could follow
    assert takes(positive, "1732800000000000") and takes(positive, "1" + "0" * 20) and not takes(positive, "1" + "0" * 21)
    assert takes(positive, "10000000000000.5") and not takes(positive, "100000000000000.5")
    # Past the fifteenth digit, a zero after the point only pads: a model short of the digit it
    # wanted wrote 0.87118818330974500000.
    assert takes(positive, "0.871188183309745") and not takes(positive, "0.8711881833097450")
    assert takes(positive, "0.87118818330974") and not takes(positive, "0.871188183309740")
    assert takes(positive, "123456789012345") and not takes(positive, "123456789012345.0")
    assert not takes(positive, "100000000000000.0") and takes(positive, "10000000000000.5")
    assert takes(grammar({"type": "integer", "minimum": 0}), "12345678901234567890")  # an integer is no double
    with pytest.raises(SchemaError, match="at most 15 significant digits"):
        grammar({"type": "number", "exclusiveMinimum": 0.1, "exclusiveMaximum": 0.1000000000000001})
    with pytest.raises(SchemaError, match="multiple of 0.25 and has at most 15"):
        grammar({"type": "number", "minimum": 1e14 + 0.25, "maximum": 1e14 + 0.5, "multipleOf": 0.25})
