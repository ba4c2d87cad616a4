"""The usage event's validating parser: the wire shape workers emit."""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal

import pytest

from billing.errors import InvalidUsageEvent
from billing.events import parse_usage_event
from billing.pricing import Prices


def event(**changes):
    base = {
        "request_id": "req-1", "organization_id": 1, "api_key_id": 2, "deployment_id": 3,
        "model": "tiny-llama", "deployment": "tiny", "prompt_tokens": 10, "cached_prompt_tokens": 4,
        "completion_tokens": 5, "status": "completed", "queue_ms": 1.4, "ttft_ms": 20, "latency_ms": 300.6,
        "batch_size": 3.5, "finished_at": "2025-03-01T12:00:00.500000Z",
    }
    base.update(changes)
    return base


def test_a_good_event_parses_with_python_types():
    parsed = parse_usage_event(event())
    assert parsed.finished_at == datetime(2025, 3, 1, 12, 0, 0, 500000, tzinfo=timezone.utc)
    assert (parsed.queue_ms, parsed.ttft_ms, parsed.latency_ms, parsed.batch_size) == (1, 20, 301, 3.5)
    wire = parsed.to_wire()
    assert wire["finished_at"] == "2025-03-01T12:00:00.500000+00:00"
    assert parse_usage_event(wire) == parsed


def test_optional_fields_may_be_null_or_missing():
    raw = event(api_key_id=None, deployment_id=None)
    del raw["queue_ms"], raw["ttft_ms"], raw["latency_ms"], raw["batch_size"]
    parsed = parse_usage_event(raw)
    assert parsed.api_key_id is None and parsed.latency_ms is None and parsed.batch_size is None


def test_other_time_zones_are_converted_to_utc():
    parsed = parse_usage_event(event(finished_at="2025-03-01T14:00:00+02:00"))
    assert parsed.finished_at == datetime(2025, 3, 1, 12, tzinfo=timezone.utc)


@pytest.mark.parametrize(("changes", "field"), [
    ({"request_id": ""}, "request_id"),
    ({"request_id": "x" * 129}, "request_id"),
    ({"request_id": "a\nb"}, "request_id"),
    ({"organization_id": "1"}, "organization_id"),
    ({"organization_id": None}, "organization_id"),
    ({"api_key_id": 0}, "api_key_id"),
    ({"model": ""}, "model"),
    ({"prompt_tokens": 1.5}, "prompt_tokens"),
    ({"prompt_tokens": -1}, "prompt_tokens"),
    ({"prompt_tokens": True}, "prompt_tokens"),
    ({"completion_tokens": 2**31}, "completion_tokens"),
    ({"cached_prompt_tokens": 11}, "cached_prompt_tokens"),
    ({"status": "done"}, "status"),
    ({"latency_ms": -1}, "latency_ms"),
    ({"latency_ms": float("nan")}, "latency_ms"),
    ({"batch_size": 0.5}, "batch_size"),
    ({"batch_size": "2"}, "batch_size"),
    ({"batch_size": float("inf")}, "batch_size"),
    ({"finished_at": "yesterday"}, "finished_at"),
    ({"finished_at": "2025-03-01T12:00:00"}, "finished_at"),
    ({"finished_at": 1700000000}, "finished_at"),
    ({"colour": "blue"}, "colour"),
    ({"endpoint": 5}, "endpoint"),
    ({"endpoint": "/v1/" + "x" * 40}, "endpoint"),
    ({"endpoint": "/v1/\nchat"}, "endpoint"),
    ({"rerun": "yes"}, "rerun"),
])
def test_bad_events_name_the_field(changes, field):
    with pytest.raises(InvalidUsageEvent) as caught:
        parse_usage_event(event(**changes))
    assert caught.value.field == field


def test_a_missing_required_field_is_named():
    raw = event()
    del raw["completion_tokens"]
    with pytest.raises(InvalidUsageEvent) as caught:
        parse_usage_event(raw)
    assert caught.value.field == "completion_tokens"


def test_not_a_mapping():
    with pytest.raises(InvalidUsageEvent):
        parse_usage_event(["req-1"])


# --- the prices of the request's admission --------------------------------------------------------

PRICES = {"input_per_mtok": "0.150000", "cached_input_per_mtok": "0.075", "output_per_mtok": "0.6",
          "per_request": "0"}


def test_prices_parse_to_decimals_and_travel_as_decimal_strings():
    parsed = parse_usage_event(event(prices=PRICES))
    assert parsed.prices == Prices(Decimal("0.15"), Decimal("0.075"), Decimal("0.6"), Decimal("0"))
    assert all(type(value) is Decimal for value in vars(parsed.prices).values())
    wire = parsed.to_wire()
    assert wire["prices"] == PRICES
    assert parse_usage_event(wire) == parsed
    # The widest a usage record holds.
    widest = {**PRICES, "output_per_mtok": "9999999999.9999999999", "per_request": "0.0000000001"}
    assert parse_usage_event(event(prices=widest)).to_wire()["prices"] == widest


def test_the_endpoint_and_rerun_travel_when_set_and_stay_off_the_wire_when_not():
    """So that a billing worker of before, which refuses unknown fields, reads an event that has neither."""
    plain = parse_usage_event(event())
    assert (plain.endpoint, plain.rerun) == ("", False) and not {"endpoint", "rerun"} & set(plain.to_wire())
    marked = parse_usage_event(event(endpoint="/v1/batches", rerun=True))
    assert (marked.endpoint, marked.rerun) == ("/v1/batches", True) and parse_usage_event(marked.to_wire()) == marked


def test_reserved_capacity_travels_with_its_hour_price_and_a_request_without_either():
    plain = parse_usage_event(event(prices=PRICES))
    assert plain.replica_seconds == 0 and "replica_seconds" not in plain.to_wire()
    assert "per_replica_hour" not in plain.to_wire()["prices"]
    capacity = parse_usage_event(event(prices={**PRICES, "per_replica_hour": "2.5"}, replica_seconds=120,
                                       endpoint="reserved capacity"))
    assert (capacity.replica_seconds, capacity.prices.per_replica_hour) == (120, Decimal("2.5"))
    assert parse_usage_event(capacity.to_wire()) == capacity
    for bad, field in (({"replica_seconds": -1}, "replica_seconds"), ({"replica_seconds": 1.5}, "replica_seconds"),
                       ({"prices": {**PRICES, "per_replica_hour": "-1"}}, "prices.per_replica_hour")):
        with pytest.raises(InvalidUsageEvent) as refused:
            parse_usage_event(event(**bad))
        assert refused.value.param == field


def test_an_event_without_prices_is_published_without_them():
    assert parse_usage_event(event()).prices is None
    assert parse_usage_event(event(prices=None)).prices is None
    assert "prices" not in parse_usage_event(event(prices=None)).to_wire()  # what a billing worker of before reads


@pytest.mark.parametrize(("prices", "field", "says"), [
    ({**PRICES, "output_per_mtok": 0.6}, "prices.output_per_mtok", "decimal string"),
    ({**PRICES, "output_per_mtok": 1}, "prices.output_per_mtok", "decimal string"),
    ({**PRICES, "output_per_mtok": True}, "prices.output_per_mtok", "decimal string"),
    ({**PRICES, "output_per_mtok": None}, "prices.output_per_mtok", "decimal string"),
    ({**PRICES, "output_per_mtok": Decimal("0.6")}, "prices.output_per_mtok", "decimal string"),
    ({**PRICES, "input_per_mtok": "-0.15"}, "prices.input_per_mtok", "decimal string"),
    ({**PRICES, "input_per_mtok": "NaN"}, "prices.input_per_mtok", "decimal string"),
    ({**PRICES, "input_per_mtok": "Infinity"}, "prices.input_per_mtok", "decimal string"),
    ({**PRICES, "input_per_mtok": "1.5e-7"}, "prices.input_per_mtok", "decimal string"),
    ({**PRICES, "input_per_mtok": " 0.15"}, "prices.input_per_mtok", "decimal string"),
    ({**PRICES, "input_per_mtok": ""}, "prices.input_per_mtok", "decimal string"),
    ({**PRICES, "input_per_mtok": ".15"}, "prices.input_per_mtok", "decimal string"),
    ({**PRICES, "input_per_mtok": "1_000"}, "prices.input_per_mtok", "decimal string"),
    ({**PRICES, "input_per_mtok": "\u0661"}, "prices.input_per_mtok", "decimal string"),  # an Arabic-Indic 1
    ({**PRICES, "per_request": "0.00000000001"}, "prices.per_request", "decimal string"),  # finer than stored
    ({**PRICES, "per_request": "10000000000"}, "prices.per_request", "decimal string"),  # larger than stored
    ({k: v for k, v in PRICES.items() if k != "per_request"}, "prices.per_request", "is required"),
    ({**PRICES, "discount": "0"}, "prices.discount", "is not a price"),
    (["0.15", "0.075", "0.6", "0"], "prices", "object of the four prices"),
    ("0.15", "prices", "object of the four prices"),
])
def test_bad_prices_are_refused_naming_the_price(prices, field, says):
    with pytest.raises(InvalidUsageEvent) as caught:
        parse_usage_event(event(prices=prices))
    assert caught.value.field == field and says in caught.value.message
