"""The running totals beside the billing rows: added to in the transaction that writes the rows,
read in constant time by the quota check, recomputed from the rows by ``reconcile``.

Amounts are integer micro-dollars: exact on SQLite, which does arithmetic on decimals in floating
point. An addition is one upsert (``INSERT ... ON CONFLICT DO UPDATE SET x = x + excluded.x``,
PostgreSQL and SQLite alike): concurrent writers never lose one another's amounts, and a row locked
by a charge stays locked only until that charge commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from decimal import Decimal

from django.db import connection, transaction
from django.db.models import Count, F, Q, Sum, Value
from django.db.models.functions import Round, TruncMonth

from .models import ApiKeyTotals, LedgerEntry, MonthlySpend, OrganizationBalance, UsageRecord
from .pricing import COST_QUANTUM, EXACT_PLACES, STATUS_COMPLETED


def micros(amount: Decimal) -> int:
    """USD (at most 6 decimal places, as every billing amount is) as integer micro-dollars."""
    scaled = amount.scaleb(6)
    if scaled != scaled.to_integral_value():
        raise ValueError(f"{amount} USD is finer than a micro-dollar")
    return int(scaled)


def usd(value: int | None) -> Decimal:
    """Micro-dollars (None: none) as USD."""
    return Decimal(value or 0).scaleb(-6).quantize(COST_QUANTUM)


def month_of(moment: datetime) -> date:
    """The first day of ``moment``'s calendar month, UTC: what monthly spend is keyed by."""
    return moment.astimezone(timezone.utc).date().replace(day=1)


def _add(model, key: dict, *, assign: dict | None = None, **amounts: int) -> None:
    """Add ``amounts`` to the row of ``model`` that ``key`` names (created at zero if missing), and
    set the columns of ``assign``."""
    quote = connection.ops.quote_name
    table = quote(model._meta.db_table)
    values = {**key, **amounts, **(assign or {})}
    column = {name: quote(model._meta.get_field(name).column) for name in values}
    updates = [f"{column[c]} = {table}.{column[c]} + excluded.{column[c]}" for c in amounts]
    updates += [f"{column[c]} = excluded.{column[c]}" for c in assign or {}]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({', '.join(column[c] for c in values)}) VALUES ({', '.join(['%s'] * len(values))}) "
            f"ON CONFLICT ({', '.join(column[c] for c in key)}) DO UPDATE SET {', '.join(updates)}",
            list(values.values()),
        )


def add_to_balance(*, organization_id: int, amount: Decimal, carry: Decimal | None = None) -> None:
    """A ledger entry of ``amount`` was written for the organization (in this transaction); with
    ``carry``, a charge leaves that carry (``take_carry``)."""
    assign = None if carry is None else {"carry": _carry_units(carry)}
    _add(OrganizationBalance, {"organization": organization_id}, assign=assign, micros=micros(amount))


def take_carry(*, organization_id: int) -> Decimal:
    """Lock the organization's balance row (made if need be) until this transaction ends, and read
    its carry (USD): what its usage cost beyond its charges (``billing.pricing.charge``). The
    charge gives the new one to ``add_to_balance``."""
    _add(OrganizationBalance, {"organization": organization_id}, micros=0)  # the upsert locks the row
    units = OrganizationBalance.objects.filter(organization_id=organization_id).values_list("carry", flat=True).get()
    return Decimal(units).scaleb(-EXACT_PLACES)


def _carry_units(carry: Decimal) -> int:
    units = carry.scaleb(EXACT_PLACES)
    if units != units.to_integral_value():
        raise ValueError(f"a carry of {carry} USD is finer than an exact cost")
    return int(units)


def add_usage(*, organization_id: int, api_key_id: int | None, created_at: datetime, cost: Decimal,
              tokens: int, requests: int = 1) -> None:
    """A usage record was written (in this transaction): its cost counts toward its month's
    spend, and it counts toward its key's cost, tokens (those of a billed request: the caller's
    ``tokens``) and requests. (A record changed: the differences, and ``requests=0``.)"""
    _add(MonthlySpend, {"organization": organization_id, "month": month_of(created_at)}, micros=micros(cost))
    if api_key_id is not None:
        _add(ApiKeyTotals, {"api_key": api_key_id}, micros=micros(cost), tokens=tokens, requests=requests)


# --- recomputing them from the rows ---------------------------------------------------------------


@dataclass
class Totals:
    """An organization's running totals: balance, spend by month, (cost, tokens, requests) by key."""

    balance: int = 0
    months: dict[date, int] = field(default_factory=dict)
    keys: dict[int, tuple[int, int, int]] = field(default_factory=dict)


# The rows billing.pricing.is_billed charges: only their tokens count toward a key's token limit.
BILLED = Q(status=STATUS_COMPLETED) | Q(completion_tokens__gt=0)


def micros_sum(expression) -> Sum:
    """The sum of a money column in micro-dollars, rounded to an integer row by row: exact on
    SQLite too, which keeps decimals as floating point (and before 3.43 sums them so)."""
    return Sum(Round(expression * Value(10**6)))


def from_rows(*, organization_id: int) -> Totals:
    """The totals as the rows add up now (time in proportion to the organization's history)."""
    usage = UsageRecord.objects.filter(organization_id=organization_id)
    balance = LedgerEntry.objects.filter(organization_id=organization_id).aggregate(total=micros_sum(F("amount")))
    months = usage.annotate(month=TruncMonth("created_at", tzinfo=timezone.utc)).values("month").annotate(
        cost=micros_sum(F("cost"))).values_list("month", "cost")
    keys = usage.filter(api_key__isnull=False).values("api_key").annotate(
        cost=micros_sum(F("cost")), requests=Count("id"),
        tokens=Sum(F("prompt_tokens") + F("completion_tokens"), filter=BILLED, default=0),
    ).values_list("api_key", "cost", "tokens", "requests")
    return Totals(
        balance=_integer(balance["total"]),
        months={month_of(m) if isinstance(m, datetime) else m.replace(day=1): _integer(c) for m, c in months if c},
        keys={k: (_integer(c), int(t), n) for k, c, t, n in keys},
    )


def _integer(value) -> int:
    """An integral sum as the driver returns it (Decimal, float or int; None: no rows)."""
    return int(round(value or 0))


def stored(*, organization_id: int) -> Totals:
    """The running totals as stored."""
    return Totals(
        balance=OrganizationBalance.objects.filter(organization_id=organization_id)
        .values_list("micros", flat=True).first() or 0,
        months={m: v for m, v in MonthlySpend.objects.filter(organization_id=organization_id)
                .values_list("month", "micros") if v},
        keys={k: (c, t, n) for k, c, t, n in ApiKeyTotals.objects.filter(api_key__organization_id=organization_id)
              .values_list("api_key", "micros", "tokens", "requests") if n},
    )


def reconcile(*, organization_id: int, fix: bool = True) -> tuple[Totals, Totals]:
    """Compare an organization's stored totals with its rows; with ``fix``, store the rows' sums.
    Returns (stored, from the rows).

    Safe while charges run. A fix locks the totals' rows first, in the order charges take them
    (balance, month, key), so a charge either committed before the sums were taken (and is in
    them) or adds itself after the fix. A check takes no lock and writes nothing: on PostgreSQL
    it reads one snapshot of both (REPEATABLE READ), so a charge committing meanwhile is not
    reported as a difference."""
    outermost = not connection.in_atomic_block
    with transaction.atomic():
        if fix:
            _lock(organization_id)
        elif outermost and connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        before, truth = stored(organization_id=organization_id), from_rows(organization_id=organization_id)
        if fix and before != truth:
            _store(organization_id, truth)
    return before, truth


def _lock(organization_id: int) -> None:
    _add(OrganizationBalance, {"organization": organization_id}, micros=0)  # the upsert locks the row (made if need be)
    list(MonthlySpend.objects.select_for_update().filter(organization_id=organization_id))
    # of=("self",): the totals' rows only, not the API keys they are joined to (the gateway writes those)
    list(ApiKeyTotals.objects.select_for_update(of=("self",)).filter(api_key__organization_id=organization_id))


def _store(organization_id: int, truth: Totals) -> None:
    OrganizationBalance.objects.filter(organization_id=organization_id).update(micros=truth.balance)
    MonthlySpend.objects.filter(organization_id=organization_id).exclude(month__in=truth.months).delete()
    for month, value in truth.months.items():
        MonthlySpend.objects.update_or_create(organization_id=organization_id, month=month, defaults={"micros": value})
    ApiKeyTotals.objects.filter(api_key__organization_id=organization_id).exclude(api_key_id__in=truth.keys).delete()
    for key_id, (cost, tokens, requests) in truth.keys.items():
        ApiKeyTotals.objects.update_or_create(api_key_id=key_id,
                                              defaults={"micros": cost, "tokens": tokens, "requests": requests})
