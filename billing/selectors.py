"""Reads of the billing app: balances, spend, the ledger, usage reports and the CSV export.

Balances and spend come from the running totals that each charge adds to in its own transaction
(``billing.totals``): current to the last committed charge, in constant time however long the
history. Reports are computed by the database from the rows themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Iterable, Iterator

from django.conf import settings
from django.db import connection
from django.db.models import Aggregate, Count, F, IntegerField, Q, QuerySet, Sum, Value
from django.db.models.functions import Coalesce, TruncDay, TruncHour
from django.utils import timezone as dj_timezone

from accounts.models import MANAGER_ROLES, ApiKey, Membership, Organization

from . import totals
from .models import (
    ApiKeySpendLimit,
    ApiKeyTotals,
    LedgerEntry,
    MonthlySpend,
    OrganizationBalance,
    RefusedUsageEvent,
    SpendLimit,
    UsageRecord,
)
from .events import RESERVED_CAPACITY
from .pricing import COST_QUANTUM
from .stripe_api import card_topups_enabled

ZERO = Decimal(0).quantize(COST_QUANTUM)
_MONEY_ZERO = Value(Decimal(0), output_field=UsageRecord._meta.get_field("cost"))


def _money(value) -> Decimal:
    return (value if value is not None else ZERO).quantize(COST_QUANTUM)


# --- balances and spend ---------------------------------------------------------------------------


def balance(*, organization: Organization) -> Decimal:
    """The organization's credit balance in USD: the sum of its ledger entries."""
    return totals.usd(OrganizationBalance.objects.filter(organization=organization)
                      .values_list("micros", flat=True).first())


def refused_usage_events() -> list[RefusedUsageEvent]:
    """The usage events billing refused and kept, not recorded by a replay yet, oldest first."""
    return list(RefusedUsageEvent.objects.filter(replayed_at__isnull=True))


def month_start(now: datetime | None = None) -> datetime:
    """The start of the current calendar month, UTC."""
    now = (now or dj_timezone.now()).astimezone(timezone.utc)
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def monthly_spend(*, organization: Organization, now: datetime | None = None) -> Decimal:
    """What the organization's requests cost this calendar month (UTC)."""
    return totals.usd(MonthlySpend.objects.filter(organization=organization, month=month_start(now).date())
                      .values_list("micros", flat=True).first())


@dataclass(frozen=True)
class KeySpend:
    cost: Decimal
    tokens: int


def api_key_spend(*, api_key: ApiKey) -> KeySpend:
    """Everything a key has spent (USD) and used (prompt + completion tokens) since it was created."""
    cost, tokens, _ = api_key_totals(api_keys=[api_key]).get(api_key.pk, (ZERO, 0, 0))
    return KeySpend(cost=cost, tokens=tokens)


def api_key_totals(*, api_keys) -> dict[int, tuple[Decimal, int, int]]:
    """(spend in USD, tokens, requests) of each of ``api_keys`` over its lifetime; keys that made
    no request are absent."""
    rows = ApiKeyTotals.objects.filter(api_key__in=api_keys).values_list("api_key_id", "micros", "tokens", "requests")
    return {key_id: (totals.usd(cost), tokens, requests) for key_id, cost, tokens, requests in rows}


def organization_monthly_limit(*, organization: Organization) -> Decimal | None:
    return SpendLimit.objects.filter(organization=organization).values_list("monthly_limit", flat=True).first()


# What an organization set beside its balance: its limit and alerts (USD; None: not set).
LIMIT_FIELDS = ("monthly_limit", "balance_alert", "spend_alert")


def organization_limits(*, organization: Organization) -> dict[str, Decimal | None]:
    """The organization's monthly limit and alerts, in one read (``LIMIT_FIELDS``)."""
    row = SpendLimit.objects.filter(organization=organization).values(*LIMIT_FIELDS).first()
    return row or dict.fromkeys(LIMIT_FIELDS)


def may_change_spend_limit(*, user, organization: Organization) -> bool:
    """Whether ``user`` (a dashboard session's, or an API key's creator) is an owner or an admin
    of ``organization``. A key's principal without a user (``ApiKeyUser``) is neither."""
    if organization is None or not getattr(user, "is_authenticated", False) or getattr(user, "pk", None) is None:
        return False
    return Membership.objects.filter(user=user, organization=organization, role__in=MANAGER_ROLES).exists()


def api_key_limits(*, api_key: ApiKey) -> ApiKeySpendLimit | None:
    return ApiKeySpendLimit.objects.filter(api_key=api_key).first()


@dataclass(frozen=True)
class QuotaFigures:
    """What the pre-dispatch quota check compares; a spend figure is None when no limit needs it."""

    balance: Decimal
    monthly_limit: Decimal | None
    monthly_spend: Decimal | None
    key_amount_limit: Decimal | None
    key_token_limit: int | None
    key_spend: KeySpend | None


def _db_money(value) -> Decimal | None:
    """A money figure as the driver returns it: Decimal (PostgreSQL) or int/float (SQLite stores
    decimals as numbers; a float's shortest repr is the decimal it stands for)."""
    if value is None:
        return None
    return Decimal(repr(value) if isinstance(value, float) else value).quantize(COST_QUANTUM)


def quota_figures(*, organization: Organization, api_key: ApiKey | None = None,
                  now: datetime | None = None) -> QuotaFigures:
    """The balance, the spend limits and the spend they limit, in one statement of constant cost:
    every request runs this before dispatch, so it reads the running totals (``billing.totals``),
    in plain SQL rather than an ORM query that costs more to compile than to run. The same figures
    as :func:`balance`, :func:`monthly_spend` and :func:`api_key_spend`; a spend is None when no
    limit applies to it."""
    table = {model: connection.ops.quote_name(model._meta.db_table)
             for model in (OrganizationBalance, MonthlySpend, ApiKeyTotals, SpendLimit, ApiKeySpendLimit)}
    sql = f"""
        SELECT b.micros, ol.monthly_limit, ms.micros, kl.amount_limit, kl.token_limit, kt.micros, kt.tokens
        FROM (SELECT 1 AS anchor) AS one
        LEFT JOIN {table[OrganizationBalance]} AS b ON b.organization_id = %s
        LEFT JOIN {table[SpendLimit]} AS ol ON ol.organization_id = %s
        LEFT JOIN {table[MonthlySpend]} AS ms ON ms.organization_id = %s AND ms.month = %s
        LEFT JOIN {table[ApiKeySpendLimit]} AS kl ON kl.api_key_id = %s
        LEFT JOIN {table[ApiKeyTotals]} AS kt ON kt.api_key_id = %s
    """
    key_id = api_key.pk if api_key is not None else None
    month = connection.ops.adapt_datefield_value(month_start(now).date())
    with connection.cursor() as cursor:
        cursor.execute(sql, [organization.pk, organization.pk, organization.pk, month, key_id, key_id])
        balance_, monthly_limit, spent, amount_limit, token_limit, key_cost, key_tokens = cursor.fetchone()
    key_limited = amount_limit is not None or token_limit is not None
    return QuotaFigures(
        balance=totals.usd(balance_),
        monthly_limit=_db_money(monthly_limit),
        monthly_spend=totals.usd(spent) if monthly_limit is not None else None,
        key_amount_limit=_db_money(amount_limit),
        key_token_limit=None if token_limit is None else int(token_limit),
        key_spend=KeySpend(cost=totals.usd(key_cost), tokens=int(key_tokens or 0)) if key_limited else None,
    )


# --- the ledger -----------------------------------------------------------------------------------


def quota_refusal(*, organization: Organization, api_key: ApiKey | None = None) -> str | None:
    """Why a new request is refused, if it is: the organization's balance is zero or below, its
    monthly spend limit is reached, or the key's amount or token limit is. The figures are the
    running totals, current to the last committed charge, read in one query (``billing.totals``)."""
    figures = quota_figures(organization=organization, api_key=api_key)
    if figures.balance <= 0:
        remedy = ("Top up your credits on the dashboard's billing page to continue." if card_topups_enabled() else
                  "Card top-ups are not set up on this platform: ask its operator to credit your organization.")
        if _credit_awaits_confirmation(organization):  # new, not spent: say what comes
            return ("Your organization has no credit yet: its sign-up credit comes once its founder confirms their "
                    f"email address (the link mailed at sign-up). {remedy}")
        return f"You exceeded your current quota: your credit balance is {figures.balance} USD. {remedy}"
    if figures.monthly_limit is not None and figures.monthly_spend >= figures.monthly_limit:
        return (f"You reached your organization's monthly spend limit ({figures.monthly_limit} USD; spent "
                f"{figures.monthly_spend} USD this month). An owner or admin can raise or remove it on the billing "
                "page or with PUT /v1/billing/limits.")
    spend = figures.key_spend
    if spend is not None:
        if figures.key_amount_limit is not None and spend.cost >= figures.key_amount_limit:
            return f"This API key reached its spend limit ({figures.key_amount_limit} USD; spent {spend.cost} USD)."
        if figures.key_token_limit is not None and spend.tokens >= figures.key_token_limit:
            return f"This API key reached its token limit ({figures.key_token_limit} tokens; used {spend.tokens})."
    return None


def _credit_awaits_confirmation(organization: Organization) -> bool:
    """Whether the organization's sign-up credit waits for its founder (its first owner) to confirm
    their address: it is the first they founded, and their credit was never granted
    (``billing.services.grant_signup_credit_on_verification``)."""
    if settings.BILLING_SIGNUP_CREDIT <= 0 or \
            LedgerEntry.objects.filter(organization=organization, kind=LedgerEntry.Kind.SIGNUP_CREDIT).exists():
        return False
    founder = (Membership.objects.filter(organization=organization, role=Membership.Role.OWNER)
               .order_by("created_at", "id").values("user_id", "user__email_verified_at").first())
    if founder is None or founder["user__email_verified_at"] is not None:
        return False
    first_founded = (Membership.objects.filter(user_id=founder["user_id"], role=Membership.Role.OWNER)
                     .order_by("organization__created_at", "organization_id").values_list("organization_id", flat=True)
                     .first())
    return first_founded == organization.pk


def ledger_page(*, organization: Organization, limit: int, after: int | None = None,
                kinds: Iterable[str] | None = None) -> tuple[list[LedgerEntry], bool]:
    """Up to ``limit`` entries (of ``kinds``, or all), newest first, older than entry id ``after``;
    and whether more follow."""
    entries = LedgerEntry.objects.filter(organization=organization).order_by("-id")
    if kinds is not None:
        entries = entries.filter(kind__in=list(kinds))
    if after is not None:
        entries = entries.filter(id__lt=after)
    rows = list(entries[: limit + 1])
    return rows[:limit], len(rows) > limit


# --- usage reports --------------------------------------------------------------------------------

GROUP_BYS = ("day", "hour", "model", "deployment", "api_key", "endpoint")


# The dates a report's period may span: far enough inside the calendar that its bounds and its
# default start (30 days before its end) exist.
REPORT_DATES = (date(2000, 1, 1), date(2999, 12, 31))


def period_bounds(start: date, end: date) -> tuple[datetime, datetime]:
    """[start 00:00 UTC, the day after end 00:00 UTC): ``end`` is inclusive."""
    return (datetime.combine(start, time.min, tzinfo=timezone.utc),
            datetime.combine(end + timedelta(days=1), time.min, tzinfo=timezone.utc))


def usage_records(*, organization: Organization, start: date, end: date) -> QuerySet[UsageRecord]:
    since, until = period_bounds(start, end)
    return UsageRecord.objects.filter(organization=organization, created_at__gte=since, created_at__lt=until)


class PercentileDisc(Aggregate):
    """PostgreSQL's ``percentile_disc(p) WITHIN GROUP (ORDER BY x)``: the smallest value whose
    cumulative share reaches ``p`` (an actual observation, nulls ignored)."""

    function = "PERCENTILE_DISC"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = IntegerField()

    def __init__(self, expression, fraction: float, **extra):
        if not 0 < fraction <= 1:
            raise ValueError("fraction must be in (0, 1]")
        super().__init__(expression, fraction=repr(float(fraction)), **extra)


def percentile_disc(sorted_values: list[int], fraction: float) -> int | None:
    """The same definition in Python, for databases without percentile_disc (SQLite)."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(fraction * len(sorted_values)) - 1)]


# A usage record of a request, not of reserved capacity (``billing.events.RESERVED_CAPACITY``).
IS_REQUEST = ~Q(endpoint=RESERVED_CAPACITY)

_BUCKETS = {
    "day": lambda: TruncDay("created_at", tzinfo=timezone.utc),
    "hour": lambda: TruncHour("created_at", tzinfo=timezone.utc),
    "model": lambda: F("model"),
    "deployment": lambda: F("deployment_name"),
    "api_key": lambda: F("api_key_id"),
    "endpoint": lambda: F("endpoint"),
}


def _sums(queryset: QuerySet) -> dict:
    return {
        "requests": Count("id", filter=IS_REQUEST),
        "replica_seconds": Coalesce(Sum("replica_seconds"), Value(0)),
        "prompt_tokens": Coalesce(Sum("prompt_tokens"), Value(0)),
        "cached_prompt_tokens": Coalesce(Sum("cached_prompt_tokens"), Value(0)),
        "completion_tokens": Coalesce(Sum("completion_tokens"), Value(0)),
        "cost": Coalesce(Sum("cost"), _MONEY_ZERO),
    }


def _with_percentiles(aggregates: dict) -> dict:
    if connection.vendor == "postgresql":
        aggregates["latency_ms_p50"] = PercentileDisc("latency_ms", 0.5)
        aggregates["latency_ms_p99"] = PercentileDisc("latency_ms", 0.99)
    return aggregates


def _python_percentiles(records: QuerySet, bucket_expr=None) -> dict:
    """{bucket: (p50, p99)} computed by streaming latencies in order (non-PostgreSQL only)."""
    rows = records.filter(latency_ms__isnull=False)
    if bucket_expr is None:
        values = list(rows.order_by("latency_ms").values_list("latency_ms", flat=True).iterator())
        return {None: (percentile_disc(values, 0.5), percentile_disc(values, 0.99))}
    result, current, values = {}, object(), []
    ordered = rows.annotate(bucket=bucket_expr).order_by("bucket", "latency_ms").values_list("bucket", "latency_ms")
    for bucket, latency in ordered.iterator(chunk_size=5000):
        if bucket != current:
            if values:
                result[current] = (percentile_disc(values, 0.5), percentile_disc(values, 0.99))
            current, values = bucket, []
        values.append(latency)
    if values:
        result[current] = (percentile_disc(values, 0.5), percentile_disc(values, 0.99))
    return result


def _figures(row: dict) -> dict:
    return {
        "requests": int(row["requests"]),
        "prompt_tokens": int(row["prompt_tokens"]),
        "cached_prompt_tokens": int(row["cached_prompt_tokens"]),
        "completion_tokens": int(row["completion_tokens"]),
        "total_tokens": int(row["prompt_tokens"]) + int(row["completion_tokens"]),
        "cost": _money(row["cost"]),
        "replica_seconds": int(row["replica_seconds"]),
        "latency_ms_p50": row.get("latency_ms_p50"),
        "latency_ms_p99": row.get("latency_ms_p99"),
    }


def _empty_figures() -> dict:
    return _figures({"requests": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0, "completion_tokens": 0,
                     "cost": ZERO, "replica_seconds": 0})


def _time_buckets(group_by: str, since: datetime, until: datetime) -> Iterator[datetime]:
    step = timedelta(days=1) if group_by == "day" else timedelta(hours=1)
    moment = since
    while moment < until:
        yield moment
        moment += step


def usage_report(*, organization: Organization, start: date, end: date, group_by: str) -> dict:
    """Usage of one organization between two dates (inclusive, UTC), grouped by ``group_by``.

    Returns ``{"buckets": [...], "totals": {...}}``; each bucket has ``key`` (a datetime for
    day/hour — every day/hour of the period is present, empty ones with zeros —, the model slug,
    the deployment name, the API key id, or the endpoint: "" for records from before it was kept)
    and the figures: requests, token sums, cost (Decimal), the seconds of reserved replicas billed
    (``replica_seconds``: their records are not requests; their endpoint is "reserved capacity")
    and latency p50/p99 in ms (percentile_disc, None when no request reported a latency).
    For ``api_key`` buckets, ``api_key`` is ``{"id", "name", "prefix"}`` (None: the dashboard); that
    grouping covers requests only, reserved capacity being no key's (``endpoint`` shows it).
    """
    if group_by not in GROUP_BYS:
        raise ValueError(f"group_by must be one of {', '.join(GROUP_BYS)}")
    records = usage_records(organization=organization, start=start, end=end)
    if group_by == "api_key":  # reserved capacity is no key's (its bucket would read as the dashboard's)
        records = records.filter(IS_REQUEST)
    bucket_expr = _BUCKETS[group_by]()
    rows = (
        records.annotate(bucket=bucket_expr).order_by().values("bucket")
        .annotate(**_with_percentiles(_sums(records))).order_by("bucket")
    )
    totals = records.aggregate(**_with_percentiles(_sums(records)))
    figures = {row["bucket"]: _figures(row) for row in rows}
    if connection.vendor != "postgresql":
        for key, (p50, p99) in _python_percentiles(records, bucket_expr).items():
            figures[key].update(latency_ms_p50=p50, latency_ms_p99=p99)
        totals["latency_ms_p50"], totals["latency_ms_p99"] = _python_percentiles(records)[None]

    if group_by in ("day", "hour"):
        since, until = period_bounds(start, end)
        buckets = [{"key": moment, **figures.get(moment, _empty_figures())}
                   for moment in _time_buckets(group_by, since, until)]
    else:
        buckets = [{"key": key, **value} for key, value in figures.items()]
        buckets.sort(key=lambda bucket: (bucket["key"] is None, bucket["key"] if bucket["key"] is not None else 0))
    if group_by == "api_key":
        keys = {key.pk: key for key in ApiKey.objects.filter(organization=organization,
                                                            pk__in=[b["key"] for b in buckets if b["key"]])}
        for bucket in buckets:
            key = keys.get(bucket["key"])
            bucket["api_key"] = (
                {"id": key.pk, "name": key.name, "prefix": key.display_prefix} if key is not None else None
            )
    return {"buckets": buckets, "totals": _figures(totals)}


# --- the CSV export -------------------------------------------------------------------------------

EXPORT_COLUMNS = (
    "request_id", "created_at", "model", "deployment", "api_key_id", "status",
    "prompt_tokens", "cached_prompt_tokens", "completion_tokens", "queue_ms", "ttft_ms", "latency_ms",
    "price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "price_per_request", "cost",
    # Columns added after the others go last, so that readers by position still work.
    "endpoint", "api_key_name", "replica_seconds", "price_per_replica_hour",
)
_EXPORT_SOURCES = {"deployment": "deployment_name", "api_key_name": "api_key__name"}
_EXPORT_FIELDS = tuple(_EXPORT_SOURCES.get(column, column) for column in EXPORT_COLUMNS)


def usage_export_rows(*, organization: Organization, start: date, end: date, chunk_size: int = 2000) -> Iterator[tuple]:
    """Raw usage records as tuples in :data:`EXPORT_COLUMNS` order, oldest first, fetched
    ``chunk_size`` rows at a time (a server-side cursor on PostgreSQL): never the whole period in
    memory."""
    records = usage_records(organization=organization, start=start, end=end).order_by("created_at", "id")
    return records.values_list(*_EXPORT_FIELDS).iterator(chunk_size=chunk_size)
