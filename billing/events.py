"""The usage event: what a worker reports about one finished request, and its validating parser.

A GPU worker emits one event per request when it finishes (completed, cancelled by the client, or
failed) through :func:`billing.dispatch.emit_usage_event`; it travels as JSON on the Celery
``billing`` queue and :func:`billing.services.record_usage` records it, idempotently by
``request_id``. The wire form is :class:`UsageEvent` (JSON types only):

=====================  ==============  ===================================================
field                  type            meaning
=====================  ==============  ===================================================
request_id             str             the request's unique id (1-128 printable chars);
                                       the idempotency key of billing
organization_id        int             the calling organization
api_key_id             int | None      the key used (None: the dashboard's session)
deployment_id          int | None      the deployment served (None: unknown / deleted)
model                  str             catalog model slug
deployment             str             deployment name ("" when none)
prompt_tokens          int >= 0        every prompt token, cached ones included
cached_prompt_tokens   int >= 0        prompt tokens served from the prefix cache
                                       (<= prompt_tokens)
completion_tokens      int >= 0        output tokens produced
status                 str             "completed" | "cancelled" | "failed"
queue_ms               int | None      time from the gateway's admission until the engine
                                       first scheduled it (the task's queue, a model's
                                       load, a run whose worker died, the engine's queue)
ttft_ms                int | None      time from admission to the first token
latency_ms             int | None      total time, from admission to finished
batch_size             float | None    tokens the engine sampled per step, on average over
                                       the steps that sampled one of this request's (>= 1)
finished_at            str             ISO 8601 with a time zone, e.g.
                                       "2025-01-31T12:00:00.123+00:00" or "...Z"
prices                 object | None   the catalog model's prices when the gateway admitted
                                       the request, which bill it: input_per_mtok,
                                       cached_input_per_mtok, output_per_mtok, per_request
                                       (USD, decimal strings such as "0.150000"; None:
                                       the catalog's when billing records the event)
endpoint               str             the API it came through, e.g.
                                       "/v1/chat/completions", "/v1/batches" (1-40
                                       printable chars; "" or absent: not known)
rerun                  bool            a run of a request an earlier run may have
                                       recorded under this id (a batch line run again
                                       after its runner stopped): a completed one
                                       replaces a cancelled or failed record
replica_seconds        int >= 0        reserved capacity, not a request: seconds of ready
                                       replicas (``workers.metering``), billed at
                                       ``prices.per_replica_hour`` (an optional fifth
                                       price, "0" when absent)
=====================  ==============  ===================================================

``api_key_id``, ``deployment_id``, the three timings, ``batch_size`` and ``prices`` may be omitted (read as null),
``endpoint`` (read as ""), ``rerun`` (read as false) and ``replica_seconds`` (read as 0).
Timings may also be given as non-negative floats (milliseconds); they are rounded to whole milliseconds. Counts
and timings stop at 2**31 - 1. A price is a string of digits with at most 10 decimal places, below 10**10 (what a
usage record stores): never a float, a sign, an exponent, NaN or Infinity; all four are required. Unknown keys are
refused, so a typo in a worker fails loudly instead of being lost (so billing workers are upgraded before the GPU
workers whose events carry ``prices``, ``endpoint`` or ``rerun``; :meth:`ParsedUsageEvent.to_wire` leaves out a
null ``prices``, an empty ``endpoint`` and a false ``rerun``).
This module imports no Django models: a worker can validate an event before publishing it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any, Mapping, TypedDict

from .errors import InvalidUsageEvent
from .pricing import PRICE_DECIMAL_PLACES, PRICE_FIELDS, PRICE_MAX_DIGITS, STATUSES, Prices

REQUEST_ID_MAX_LENGTH = 128
NAME_MAX_LENGTH = 200
INT_MAX = 2**31 - 1  # the database's integer columns


class UsageEvent(TypedDict):
    """The wire form of a usage event (see the module's table)."""

    request_id: str
    organization_id: int
    api_key_id: int | None
    deployment_id: int | None
    model: str
    deployment: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    status: str
    queue_ms: int | float | None
    ttft_ms: int | float | None
    latency_ms: int | float | None
    batch_size: float | None
    finished_at: str
    prices: dict[str, str] | None
    endpoint: str
    rerun: bool
    replica_seconds: int


FIELDS = tuple(UsageEvent.__annotations__)
OPTIONAL_FIELDS = ("api_key_id", "deployment_id", "queue_ms", "ttft_ms", "latency_ms", "batch_size", "prices",
                   "endpoint", "rerun", "replica_seconds")
ENDPOINT_MAX_LENGTH = 40
BATCH_SIZE_MAX = 1_000_000
# A price as a usage record stores it: digits, at most PRICE_DECIMAL_PLACES of them after the point.
PRICE_INTEGER_DIGITS = PRICE_MAX_DIGITS - PRICE_DECIMAL_PLACES
OPTIONAL_PRICE = "per_replica_hour"
#: The ``endpoint`` of reserved capacity's usage (``workers.metering``): not a request.
RESERVED_CAPACITY = "reserved capacity"
PRICE_PATTERN = re.compile(rf"[0-9]{{1,{PRICE_INTEGER_DIGITS}}}(\.[0-9]{{1,{PRICE_DECIMAL_PLACES}}})?")


@dataclass(frozen=True)
class ParsedUsageEvent:
    """A validated usage event with Python types (``finished_at`` an aware datetime)."""

    request_id: str
    organization_id: int
    api_key_id: int | None
    deployment_id: int | None
    model: str
    deployment: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    status: str
    queue_ms: int | None
    ttft_ms: int | None
    latency_ms: int | None
    batch_size: float | None
    finished_at: datetime
    prices: Prices | None = None
    endpoint: str = ""
    rerun: bool = False
    replica_seconds: int = 0

    def to_wire(self) -> UsageEvent:
        """The JSON-safe form, as published on the queue (without ``prices`` when there are none,
        ``endpoint`` when empty, nor ``rerun`` when false, nor ``replica_seconds`` when 0)."""
        wire = {name: getattr(self, name) for name in FIELDS}
        wire["finished_at"] = self.finished_at.isoformat()
        if self.prices is None:
            del wire["prices"]
        else:
            wire["prices"] = self.prices.as_strings()
        if not self.rerun:
            del wire["rerun"]
        if not self.replica_seconds:
            del wire["replica_seconds"]
        if not self.endpoint:
            del wire["endpoint"]
        return UsageEvent(**wire)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _id(event: Mapping, name: str, *, optional: bool) -> int | None:
    value = event.get(name)
    if value is None and optional:
        return None
    if not _is_int(value) or value <= 0:
        raise InvalidUsageEvent(name, f"must be a positive integer id{' or null' if optional else ''}, not {value!r}")
    return value


def _count(event: Mapping, name: str) -> int:
    value = event.get(name)
    if not _is_int(value) or not 0 <= value <= INT_MAX:
        raise InvalidUsageEvent(name, f"must be an integer from 0 to {INT_MAX}, not {value!r}")
    return value


def _millis(event: Mapping, name: str) -> int | None:
    value = event.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 <= value <= INT_MAX):
        raise InvalidUsageEvent(name, f"must be a number of milliseconds from 0 to {INT_MAX} or null, not {value!r}")
    return int(value) if isinstance(value, int) else int(round(value))


def _batch_size(event: Mapping) -> float | None:
    value = event.get("batch_size")
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 1 <= value <= BATCH_SIZE_MAX):
        raise InvalidUsageEvent("batch_size", f"must be a number from 1 to {BATCH_SIZE_MAX} or null, not {value!r}")
    return float(value)


def _text(event: Mapping, name: str, *, max_length: int, allow_empty: bool) -> str:
    value = event.get(name)
    if not isinstance(value, str) or len(value) > max_length or (not value and not allow_empty):
        raise InvalidUsageEvent(
            name, f"must be a {'' if allow_empty else 'non-empty '}string of at most {max_length} characters"
        )
    if not value.isprintable():
        raise InvalidUsageEvent(name, "must contain printable characters only")
    return value


def _prices(event: Mapping) -> Prices | None:
    value = event.get("prices")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidUsageEvent("prices", f"must be an object of the four prices or null, not {value!r}")
    unknown = sorted(set(value) - set(PRICE_FIELDS) - {OPTIONAL_PRICE}, key=str)
    if unknown:
        raise InvalidUsageEvent(f"prices.{unknown[0]}", "is not a price")
    prices = {}
    for name in (*PRICE_FIELDS, OPTIONAL_PRICE):
        if name not in value:
            if name == OPTIONAL_PRICE:
                continue
            raise InvalidUsageEvent(f"prices.{name}", "is required")
        price = value[name]
        if not isinstance(price, str) or not PRICE_PATTERN.fullmatch(price):
            raise InvalidUsageEvent(
                f"prices.{name}", f"must be a decimal string of USD >= 0 with at most {PRICE_DECIMAL_PLACES} decimal "
                                  f"places, below 10**{PRICE_INTEGER_DIGITS}, not {price!r}")
        prices[name] = Decimal(price)
    return Prices(**prices)


def _finished_at(event: Mapping) -> datetime:
    value = event.get("finished_at")
    if isinstance(value, datetime):
        parsed = value
    elif isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            raise InvalidUsageEvent("finished_at", f"must be an ISO 8601 date-time, not {value!r}") from None
    else:
        raise InvalidUsageEvent("finished_at", f"must be an ISO 8601 date-time string, not {value!r}")
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise InvalidUsageEvent("finished_at", "must include a time zone (e.g. +00:00 or Z)")
    return parsed.astimezone(timezone.utc)


def parse_usage_event(event: Any) -> ParsedUsageEvent:
    """Validate a usage event (the wire form, a mapping) and return it with Python types.

    Raises :class:`billing.errors.InvalidUsageEvent` naming the first offending field.
    """
    if not isinstance(event, Mapping):
        raise InvalidUsageEvent("event", f"must be a JSON object, not {type(event).__name__}")
    unknown = sorted(set(event) - set(FIELDS))
    if unknown:
        raise InvalidUsageEvent(unknown[0], "is not a field of a usage event")
    missing = [name for name in FIELDS if name not in event and name not in OPTIONAL_FIELDS]
    if missing:
        raise InvalidUsageEvent(missing[0], "is required")

    status = event.get("status")
    if status not in STATUSES:
        raise InvalidUsageEvent("status", f"must be one of {', '.join(STATUSES)}, not {status!r}")
    prompt_tokens = _count(event, "prompt_tokens")
    cached_prompt_tokens = _count(event, "cached_prompt_tokens")
    if cached_prompt_tokens > prompt_tokens:
        raise InvalidUsageEvent(
            "cached_prompt_tokens", f"({cached_prompt_tokens}) cannot exceed prompt_tokens ({prompt_tokens})"
        )
    return ParsedUsageEvent(
        request_id=_text(event, "request_id", max_length=REQUEST_ID_MAX_LENGTH, allow_empty=False),
        organization_id=_id(event, "organization_id", optional=False),
        api_key_id=_id(event, "api_key_id", optional=True),
        deployment_id=_id(event, "deployment_id", optional=True),
        model=_text(event, "model", max_length=NAME_MAX_LENGTH, allow_empty=False),
        deployment=_text(event, "deployment", max_length=NAME_MAX_LENGTH, allow_empty=True),
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached_prompt_tokens,
        completion_tokens=_count(event, "completion_tokens"),
        status=status,
        queue_ms=_millis(event, "queue_ms"),
        ttft_ms=_millis(event, "ttft_ms"),
        latency_ms=_millis(event, "latency_ms"),
        batch_size=_batch_size(event),
        finished_at=_finished_at(event),
        prices=_prices(event),
        endpoint=_text(event, "endpoint", max_length=ENDPOINT_MAX_LENGTH, allow_empty=True) if event.get(
            "endpoint") is not None else "",
        rerun=_flag(event, "rerun"),
        replica_seconds=_count(event, "replica_seconds") if event.get("replica_seconds") is not None else 0,
    )


def _flag(event: Mapping, name: str) -> bool:
    value = event.get(name, False)
    if not isinstance(value, bool):
        raise InvalidUsageEvent(name, f"must be true or false, not {value!r}")
    return value
