"""Query parameters in, JSON out, for the billing API. Money leaves as strings ("1.234500")."""

from __future__ import annotations

import re
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

from rest_framework import serializers

from .errors import InvalidParameter
from .pricing import COST_QUANTUM
from .selectors import GROUP_BYS, REPORT_DATES

MAX_REPORT_DAYS = 366
DEFAULT_REPORT_DAYS = 30
LEDGER_DEFAULT_LIMIT = 20
LEDGER_MAX_LIMIT = 100
ISO_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def money(value: Decimal) -> str:
    return str(value.quantize(COST_QUANTUM))


def _date(params, name: str, default: date) -> date:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    if not ISO_DAY.fullmatch(raw):  # date.fromisoformat alone also takes week dates (2026-W47-1)
        return _bad_date(name, raw)
    try:
        value = date.fromisoformat(raw)
    except ValueError:
        return _bad_date(name, raw)
    if not REPORT_DATES[0] <= value <= REPORT_DATES[1]:  # the day after, and 30 days before, must exist
        raise InvalidParameter(name, f"'{name}' must be between {REPORT_DATES[0]} and {REPORT_DATES[1]}, not {raw}.")
    return value


def _bad_date(name: str, raw: str):
    raise InvalidParameter(name, f"'{name}' must be a date as YYYY-MM-DD, not {raw!r}.")


def parse_period(params) -> tuple[date, date]:
    """``start`` and ``end`` (inclusive, UTC dates). Default: the last 30 days up to today."""
    end = _date(params, "end", datetime.now(timezone.utc).date())
    start = _date(params, "start", end - timedelta(days=DEFAULT_REPORT_DAYS - 1))
    if end < start:
        raise InvalidParameter("end", f"'end' ({end}) is before 'start' ({start}).")
    if (end - start).days + 1 > MAX_REPORT_DAYS:
        raise InvalidParameter("end", f"The period from 'start' to 'end' spans more than {MAX_REPORT_DAYS} days.")
    return start, end


def parse_group_by(params) -> str:
    group_by = params.get("group_by") or "day"
    if group_by not in GROUP_BYS:
        raise InvalidParameter("group_by", f"'group_by' must be one of {', '.join(GROUP_BYS)}, not {group_by!r}.")
    return group_by


def _positive_int(params, name: str, default: int | None, maximum: int | None = None) -> int | None:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    # isascii: "²" is a digit to isdigit() but no number to int(); 18 digits fit a bigint
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18) or int(raw) < 1 or \
            (maximum is not None and int(raw) > maximum):
        bound = f" from 1 to {maximum}" if maximum else " >= 1"
        raise InvalidParameter(name, f"'{name}' must be an integer{bound}, not {raw!r}.")
    return int(raw)


def parse_ledger_page(params) -> tuple[int, int | None]:
    return (_positive_int(params, "limit", LEDGER_DEFAULT_LIMIT, LEDGER_MAX_LIMIT),
            _positive_int(params, "after", None))


def _bucket_key(group_by: str, key):
    if group_by == "day":
        return key.date().isoformat()
    if group_by == "hour":
        return key.isoformat().replace("+00:00", "Z")
    return key


def _figures(values: dict) -> dict:
    return {
        "requests": values["requests"],
        "prompt_tokens": values["prompt_tokens"],
        "cached_prompt_tokens": values["cached_prompt_tokens"],
        "completion_tokens": values["completion_tokens"],
        "total_tokens": values["total_tokens"],
        "cost": money(values["cost"]),
        "replica_seconds": values["replica_seconds"],
        "latency_ms_p50": values["latency_ms_p50"],
        "latency_ms_p99": values["latency_ms_p99"],
    }


def usage_report(report: dict, *, start: date, end: date, group_by: str) -> dict:
    data = []
    for bucket in report["buckets"]:
        item = {"bucket": _bucket_key(group_by, bucket["key"]), **_figures(bucket)}
        if group_by == "api_key":
            item["api_key"] = bucket["api_key"]
        data.append(item)
    return {
        "object": "usage.report",
        "start": start.isoformat(),
        "end": end.isoformat(),
        "group_by": group_by,
        "currency": "usd",
        "data": data,
        "totals": _figures(report["totals"]),
    }


class LedgerEntrySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    object = serializers.SerializerMethodField()
    kind = serializers.CharField()
    amount = serializers.SerializerMethodField()
    currency = serializers.SerializerMethodField()
    reference = serializers.CharField()
    description = serializers.CharField()
    created_at = serializers.DateTimeField()

    def get_object(self, entry) -> str:
        return "billing.ledger_entry"

    def get_amount(self, entry) -> str:
        return money(entry.amount)

    def get_currency(self, entry) -> str:
        return "usd"


# A USD amount as a string: plain decimal notation (no sign, exponent or spaces inside).
_DECIMAL_STRING = re.compile(r"[0-9]{1,15}(\.[0-9]{1,15})?")


def usd_amount(data, *, param: str, integers: bool = True) -> Decimal:
    """A USD amount, exact, from a JSON value or a form field: a string such as ``"25.00"`` or,
    with ``integers``, a JSON integer. A JSON number with a fraction arrives as a binary float,
    already rounded (20.000000000000001 is 20.0 by then), so it is refused, asking for a string,
    rather than guessed at. Bounds and precision are the service's to check."""
    example = '"25.00"'
    if isinstance(data, float) or (isinstance(data, int) and not isinstance(data, bool) and not integers):
        number = "a JSON number with a fraction" if integers else "a JSON number"
        raise InvalidParameter(
            param, f"'{param}' must be sent as a string such as {example}, not as {number}: a JSON number "
                   "is read as a binary float, which cannot hold every amount exactly.")
    if isinstance(data, int) and not isinstance(data, bool):
        return Decimal(data)
    if not isinstance(data, str):
        raise InvalidParameter(param, f"'{param}' must be a decimal string such as {example}.")
    text = data.strip()
    if text.startswith("-") and _DECIMAL_STRING.fullmatch(text[1:]):
        raise InvalidParameter(param, f"'{param}' cannot be negative: {data[:40]!r}.")
    if not _DECIMAL_STRING.fullmatch(text):
        raise InvalidParameter(param, f"'{param}' must be a decimal string such as {example}, not {data[:40]!r}.")
    return Decimal(text)


class UsdAmountField(serializers.CharField):
    """A USD amount as :func:`usd_amount` reads it, as a Decimal (documented as a string)."""

    def __init__(self, *, integers: bool = True, **kwargs):
        self.integers = integers
        kwargs.setdefault("help_text", 'USD as a decimal string, e.g. "25.00"' + (
            " (a JSON integer is accepted; a JSON number with a fraction is refused: send the amount as a string)"
            if integers else " (a JSON number is refused: send the amount as a string)"))
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        return usd_amount(data, param=self.field_name, integers=self.integers)

    def to_representation(self, value):
        return str(value)


class RequestSerializer(serializers.Serializer):
    """A request body: a field it does not know is a 400 naming it, not ignored (a misspelt
    ``montly_limit`` must not answer 200 and leave the limit as it was). ``echoed``: the read-only
    fields of the matching GET's answer, taken and ignored, so that a client may send back what it
    read with a change."""

    echoed: tuple[str, ...] = ()

    def to_internal_value(self, data):
        if isinstance(data, dict):
            data = {name: value for name, value in data.items() if name not in self.echoed}
            for name in data:
                if name not in self.fields:
                    known = ", ".join(self.fields)
                    raise serializers.ValidationError({name: [serializers.ErrorDetail(
                        f"Unknown field '{str(name)[:40]}': this takes {known}.", code="unknown_parameter")]})
        return super().to_internal_value(data)


class TopUpRequestSerializer(RequestSerializer):
    """``{"amount": "20.00"}``: USD as a string, or a JSON integer; never a float."""

    amount = UsdAmountField()


class SpendLimitRequestSerializer(RequestSerializer):
    """``{"monthly_limit": "100.00"}``, ``{"balance_alert": "10.00"}``, ``{"spend_alert": "80.00"}``,
    or several; null removes one, and one left out stays as it is."""

    echoed = ("object", "monthly_spend", "currency")

    monthly_limit = UsdAmountField(integers=False, allow_null=True, required=False,
                                   help_text='USD per calendar month (UTC) as a decimal string, e.g. "100.00", at most '
                                             "6 decimal places; null removes the limit. A JSON number is refused.")
    balance_alert = UsdAmountField(integers=False, allow_null=True, required=False,
                                   help_text="Email the organization's owners and admins when the balance falls "
                                             'below this many USD, e.g. "10.00" (once, until it is back up); null: '
                                             "never.")
    spend_alert = UsdAmountField(integers=False, allow_null=True, required=False,
                                 help_text="Email the organization's owners and admins when a calendar month's spend "
                                           '(UTC) reaches this many USD, e.g. "80.00" (once a month); null: never.')

    def validate(self, attrs):
        if not attrs:
            raise serializers.ValidationError({"monthly_limit": ["Send monthly_limit, balance_alert, spend_alert or "
                                                                 "any of them together."]})
        return attrs


# --- response shapes (documentation for the OpenAPI document) -------------------------------------


class UsageFiguresSerializer(serializers.Serializer):
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    cached_prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    cost = serializers.CharField(help_text="USD, 6 decimal places")
    replica_seconds = serializers.IntegerField(
        help_text="seconds of reserved replicas billed by the hour (endpoint \"reserved capacity\"; not requests)")
    latency_ms_p50 = serializers.IntegerField(allow_null=True)
    latency_ms_p99 = serializers.IntegerField(allow_null=True)


class UsageBucketSerializer(UsageFiguresSerializer):
    bucket = serializers.CharField(
        allow_null=True,
        help_text="YYYY-MM-DD (day), YYYY-MM-DDTHH:00:00Z (hour), model slug, deployment name or API key id",
    )
    api_key = serializers.DictField(required=False, allow_null=True, help_text="group_by=api_key: id, name, prefix")


class UsageReportSerializer(serializers.Serializer):
    object = serializers.CharField(default="usage.report")
    start = serializers.DateField()
    end = serializers.DateField()
    group_by = serializers.ChoiceField(choices=GROUP_BYS)
    currency = serializers.CharField(default="usd")
    data = UsageBucketSerializer(many=True)
    totals = UsageFiguresSerializer()


class BalanceSerializer(serializers.Serializer):
    object = serializers.CharField(default="billing.balance")
    balance = serializers.CharField(help_text="USD")
    currency = serializers.CharField(default="usd")
    monthly_spend = serializers.CharField(help_text="USD spent this calendar month (UTC)")
    monthly_limit = serializers.CharField(allow_null=True)


class LedgerPageSerializer(serializers.Serializer):
    object = serializers.CharField(default="list")
    data = LedgerEntrySerializer(many=True)
    has_more = serializers.BooleanField()
    first_id = serializers.IntegerField(allow_null=True)
    last_id = serializers.IntegerField(allow_null=True)


class TopUpSerializer(serializers.Serializer):
    object = serializers.CharField(default="billing.topup")
    id = serializers.CharField(help_text="the Stripe PaymentIntent id")
    client_secret = serializers.CharField()
    amount = serializers.CharField()
    currency = serializers.CharField()
    publishable_key = serializers.CharField()


class SpendLimitSerializer(serializers.Serializer):
    object = serializers.CharField(default="billing.spend_limit")
    monthly_limit = serializers.CharField(allow_null=True, help_text="USD per calendar month (UTC); null: no limit")
    monthly_spend = serializers.CharField(help_text="USD spent this calendar month (UTC)")
    balance_alert = serializers.CharField(allow_null=True, help_text="USD; owners and admins are emailed when the "
                                                                     "balance falls below it; null: never")
    spend_alert = serializers.CharField(allow_null=True, help_text="USD; owners and admins are emailed when a month's "
                                                                   "spend reaches it; null: never")
    currency = serializers.CharField(default="usd")
