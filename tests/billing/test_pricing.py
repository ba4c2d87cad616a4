"""The one cost function: exact Decimal arithmetic, rounding, status rules, refusing floats."""

from __future__ import annotations

from decimal import ROUND_FLOOR, Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billing.pricing import COST_QUANTUM, FREE, Prices, charge, exact_cost, request_cost

SAMPLE = Prices(
    input_per_mtok=Decimal("0.15"),
    cached_input_per_mtok=Decimal("0.075"),
    output_per_mtok=Decimal("0.60"),
    per_request=Decimal("0.0001"),
)


def cost(**kwargs):
    kwargs.setdefault("prices", SAMPLE)
    kwargs.setdefault("cached_prompt_tokens", 0)
    return request_cost(**kwargs)


def test_cost_of_a_sample_request_is_exact():
    # 800 uncached * 0.15 + 200 cached * 0.075 + 500 out * 0.60 = 120 + 15 + 300 = 435 per M
    # = 0.000435, plus 0.0001 per request.
    result = cost(prompt_tokens=1000, cached_prompt_tokens=200, completion_tokens=500)
    assert result == Decimal("0.000535")
    assert isinstance(result, Decimal)
    assert result.as_tuple().exponent == -6


def test_cost_rounds_half_up_to_a_micro_dollar():
    prices = Prices(Decimal("1"), Decimal("0"), Decimal("0"), Decimal("0"))
    # 1 token at 1 USD / M = 0.000001 exactly; 1.5e-6 rounds half up to 0.000002; 0.5e-6 to 0.000001
    assert request_cost(prices=prices, prompt_tokens=1, cached_prompt_tokens=0, completion_tokens=0) == Decimal("0.000001")
    half = Prices(Decimal("1.5"), Decimal("0.5"), Decimal("0"), Decimal("0"))
    assert request_cost(prices=half, prompt_tokens=1, cached_prompt_tokens=0, completion_tokens=0) == Decimal("0.000002")
    assert request_cost(prices=half, prompt_tokens=1, cached_prompt_tokens=1, completion_tokens=0) == Decimal("0.000001")
    # 0.4e-6 rounds down to zero
    tiny = Prices(Decimal("0.4"), Decimal("0"), Decimal("0"), Decimal("0"))
    assert request_cost(prices=tiny, prompt_tokens=1, cached_prompt_tokens=0, completion_tokens=0) == Decimal("0.000000")


def test_large_counts_stay_exact():
    prices = Prices(Decimal("3.123457"), Decimal("0.000001"), Decimal("15.999999"), Decimal("0.010000"))
    result = request_cost(prices=prices, prompt_tokens=2_000_000_000, cached_prompt_tokens=1_999_999_999,
                          completion_tokens=1_234_567)
    expected = (Decimal(1) * Decimal("3.123457") + Decimal(1_999_999_999) * Decimal("0.000001")
                + Decimal(1_234_567) * Decimal("15.999999")) / Decimal(1_000_000) + Decimal("0.01")
    assert result == expected.quantize(COST_QUANTUM)


@pytest.mark.parametrize("status", ["cancelled", "failed"])
def test_cancelled_or_failed_without_output_is_free(status):
    assert cost(prompt_tokens=5000, completion_tokens=0, status=status) == Decimal("0.000000")


def test_a_completed_request_without_output_still_pays_its_prompt():
    assert cost(prompt_tokens=1000, completion_tokens=0) == Decimal("0.000250")


@pytest.mark.parametrize("status", ["cancelled", "failed"])
def test_a_cut_stream_pays_for_what_it_produced(status):
    assert cost(prompt_tokens=1000, completion_tokens=10, status=status) == cost(prompt_tokens=1000, completion_tokens=10)


@pytest.mark.parametrize("bad", [0.15, 1, "0.15", None, True])
def test_prices_must_be_decimals(bad):
    with pytest.raises(TypeError):
        Prices(bad, Decimal(0), Decimal(0), Decimal(0))


@pytest.mark.parametrize("field", ["prompt_tokens", "cached_prompt_tokens", "completion_tokens"])
@pytest.mark.parametrize("bad", [1.0, 10.5, Decimal("3"), "3", True])
def test_token_counts_must_be_ints(field, bad):
    counts = {"prompt_tokens": 100, "cached_prompt_tokens": 0, "completion_tokens": 10, field: bad}
    with pytest.raises(TypeError):
        request_cost(prices=SAMPLE, **counts)


def test_prices_object_is_required_not_a_dict_of_floats():
    with pytest.raises(TypeError):
        request_cost(prices={"input_per_mtok": 0.15}, prompt_tokens=1, cached_prompt_tokens=0, completion_tokens=1)


@pytest.mark.parametrize("counts", [
    {"prompt_tokens": -1, "cached_prompt_tokens": 0, "completion_tokens": 0},
    {"prompt_tokens": 10, "cached_prompt_tokens": 11, "completion_tokens": 0},
    {"prompt_tokens": 10, "cached_prompt_tokens": 0, "completion_tokens": -5},
])
def test_impossible_counts_are_refused(counts):
    with pytest.raises(ValueError):
        request_cost(prices=SAMPLE, **counts)


def test_negative_price_and_unknown_status_are_refused():
    with pytest.raises(ValueError):
        Prices(Decimal("-0.1"), Decimal(0), Decimal(0), Decimal(0))
    with pytest.raises(ValueError):
        cost(prompt_tokens=1, completion_tokens=1, status="done")


def test_free_prices_cost_nothing():
    assert request_cost(prices=FREE, prompt_tokens=10**6, cached_prompt_tokens=0, completion_tokens=10**6) == 0


@given(
    prompt=st.integers(0, 10**7), cached_share=st.integers(0, 100), completion=st.integers(0, 10**7),
    prices=st.tuples(*[st.decimals(min_value=0, max_value=100, places=6) for _ in range(4)]),
)
def test_cost_equals_the_rational_formula_rounded_half_up(prompt, cached_share, completion, prices):
    from fractions import Fraction

    cached = prompt * cached_share // 100
    p = Prices(*prices)
    exact = (Fraction(prompt - cached) * Fraction(p.input_per_mtok) + Fraction(cached) * Fraction(p.cached_input_per_mtok)
             + Fraction(completion) * Fraction(p.output_per_mtok)) / 10**6 + Fraction(p.per_request)
    micro = exact * 10**6
    rounded = int(micro) + (1 if micro - int(micro) >= Fraction(1, 2) else 0)
    assert request_cost(prices=p, prompt_tokens=prompt, cached_prompt_tokens=cached,
                        completion_tokens=completion) == Decimal(rounded) / 10**6


@given(costs=st.lists(st.decimals(min_value=0, max_value=Decimal("0.00003"), places=16), max_size=60),
       carry=st.decimals(min_value=Decimal("-0.0000009999999999"), max_value=Decimal("0.0000009999999999"), places=16))
def test_charges_and_the_carry_always_add_up_to_the_exact_costs(costs, carry):
    """Whole micro-dollars, never below zero, and the rest carried: after any run of requests
    what was charged is the exact total (with the carry it started from), rounded down."""
    start, charged = carry, Decimal(0)
    for cost in costs:
        amount, carry = charge(cost=cost, carry=carry)
        assert amount >= 0 and amount == amount.quantize(COST_QUANTUM)
        assert -COST_QUANTUM < carry < COST_QUANTUM
        charged += amount
    assert charged + carry == start + sum(costs, Decimal(0))
    if start >= 0:
        assert charged == (start + sum(costs, Decimal(0))).quantize(COST_QUANTUM, rounding=ROUND_FLOOR)


def test_requests_cheaper_than_a_micro_dollar_are_charged_together():
    """Ten embeddings of two tokens at 0.05 USD per million cost a micro-dollar between them:
    rounded one by one they would cost nothing (or, at three tokens, twice their price)."""
    prices = Prices(Decimal("0.05"), Decimal(0), Decimal(0), Decimal(0))
    one = exact_cost(prices=prices, prompt_tokens=2, cached_prompt_tokens=0, completion_tokens=0)
    assert one == Decimal("0.0000001") and request_cost(prices=prices, prompt_tokens=2, cached_prompt_tokens=0,
                                                        completion_tokens=0) == 0
    carry, amounts = Decimal(0), []
    for _ in range(10):
        amount, carry = charge(cost=one, carry=carry)
        amounts.append(amount)
    assert amounts == [0] * 9 + [COST_QUANTUM] and carry == 0


def test_reserved_replica_seconds_cost_the_hours_price_pro_rata_rounded_down_below_the_exact_places():
    prices = Prices(Decimal(0), Decimal(0), Decimal(0), Decimal(0), per_replica_hour=Decimal("1"))
    # An hour's price over 3,600 seconds does not end: rounded up at the 16th place.
    assert exact_cost(prices=prices, prompt_tokens=0, cached_prompt_tokens=0, completion_tokens=0,
                      replica_seconds=1) == Decimal("0.0002777777777778")
    assert exact_cost(prices=Prices(Decimal(0), Decimal(0), Decimal(0), Decimal(0), Decimal("0.2")), prompt_tokens=0,
                      cached_prompt_tokens=0, completion_tokens=0, replica_seconds=60) == Decimal("0.0033333333333334")
    assert exact_cost(prices=prices, prompt_tokens=0, cached_prompt_tokens=0, completion_tokens=0,
                      replica_seconds=3600 * 5) == Decimal("5")
    # An hour billed in pieces that do not end (1/180 of an hour is 0.00555… USD) costs the hour's price.
    for seconds, price in ((20, Decimal("1")), (60, Decimal("1.8")), (60, Decimal("0.07")), (60, Decimal("0.2")),
                           (60, Decimal("0.000001")), (1, Decimal("123.456789"))):
        prices = Prices(Decimal(0), Decimal(0), Decimal(0), Decimal(0), per_replica_hour=price)
        carry, charged = Decimal(0), Decimal(0)
        for _ in range(3600 // seconds):
            cost, carry = charge(cost=exact_cost(prices=prices, prompt_tokens=0, cached_prompt_tokens=0,
                                                 completion_tokens=0, replica_seconds=seconds), carry=carry)
            charged += cost
        assert charged == price
    with pytest.raises(ValueError):
        exact_cost(prices=prices, prompt_tokens=0, cached_prompt_tokens=0, completion_tokens=0, replica_seconds=-1)


def test_a_requests_prices_on_the_wire_leave_out_a_replica_hour_price_of_zero():
    assert "per_replica_hour" not in FREE.as_strings()
    assert Prices(Decimal(0), Decimal(0), Decimal(0), Decimal(0), Decimal("0.5")).as_strings()["per_replica_hour"] == "0.5"
