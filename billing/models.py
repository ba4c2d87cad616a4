"""Billing data: usage records, the credit ledger, spend limits, and Stripe top-ups.

Invariants live in the database: one usage record per request id, one ledger entry per
(kind, reference) where a reference is given, signs of ledger amounts by kind, cached prompt tokens
never above prompt tokens, one Stripe event processed once.

An organization's balance is the sum of its ledger entries, and its spend the sum of its usage
records; the rows are the truth. Every request's quota check needs those sums, and summing rows
costs time in proportion to the history (45 ms at 100,000 rows on SQLite), so running totals
(``OrganizationBalance``, ``MonthlySpend``, ``ApiKeyTotals``) are kept beside them: in integer
micro-dollars (exact on SQLite too), added to by the same transaction that writes the rows, with
an atomic upsert (``billing.totals``). ``manage.py reconcile_billing`` recomputes them from the rows.
"""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.db import models
from django.db.models import Q

from .pricing import (
    COST_DECIMAL_PLACES,
    PRICE_DECIMAL_PLACES,
    PRICE_MAX_DIGITS,
    STATUS_CANCELLED,
    STATUS_COMPLETED,
    STATUS_FAILED,
    STATUSES,
)

# USD amounts: 12 digits before the point, 6 after (a micro-dollar).
MONEY = {"max_digits": 18, "decimal_places": COST_DECIMAL_PLACES}
# The largest amount a customer may set as a limit: SQLite (the default database) stores a decimal
# with more than 15 significant digits as a float, which reads back rounded, or not at all once
# it rounds up past the column (999999999999.999999 became 1e12: a 500 on every billing page).
# 15 digits with the 6 decimal places leaves 9 before the point, exact on SQLite as on PostgreSQL.
SQLITE_EXACT_DIGITS = 15
LIMIT_MAX = Decimal(10) ** (SQLITE_EXACT_DIGITS - COST_DECIMAL_PLACES) - Decimal(1).scaleb(-COST_DECIMAL_PLACES)
# Per-million-token prices as applied: 10 decimal places, as fine as a catalog may set them.
PRICE = {"max_digits": PRICE_MAX_DIGITS, "decimal_places": PRICE_DECIMAL_PLACES}


class UsageRecord(models.Model):
    """One finished request, what it used and what it cost. Written once per ``request_id``."""

    class Status(models.TextChoices):
        COMPLETED = STATUS_COMPLETED, "Completed"
        CANCELLED = STATUS_CANCELLED, "Cancelled"
        FAILED = STATUS_FAILED, "Failed"

    request_id = models.CharField(max_length=128, unique=True)
    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="usage_records")
    api_key = models.ForeignKey(
        "accounts.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records"
    )
    # SET_NULL: deleting a deployment keeps its history (the name stays in ``deployment_name``).
    deployment = models.ForeignKey(
        "models_catalog.Deployment", null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records"
    )
    model = models.CharField(max_length=200, help_text="Catalog model slug.")
    deployment_name = models.CharField(max_length=200, blank=True)
    # The API the request came through ("/v1/chat/completions", "/v1/embeddings", "/v1/batches",
    # ...); "" for a record from before it was kept. db_default too: a billing worker older than
    # this field, still running during an upgrade, writes records without it.
    endpoint = models.CharField(max_length=40, blank=True, default="", db_default="")
    prompt_tokens = models.PositiveIntegerField()
    cached_prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices)
    queue_ms = models.PositiveIntegerField(null=True, blank=True)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField(null=True, blank=True)
    # The engine's batch while it decoded this request: tokens sampled per step, on average.
    mean_batch_size = models.FloatField(null=True, blank=True)
    # The prices applied (USD; per million tokens, and per request): the catalog's when the request
    # was admitted, carried by its usage event (an event without them: the catalog's when recorded).
    price_input_per_mtok = models.DecimalField(**PRICE)
    price_cached_input_per_mtok = models.DecimalField(**PRICE)
    price_output_per_mtok = models.DecimalField(**PRICE)
    price_per_request = models.DecimalField(**PRICE)
    # Reserved capacity (``endpoint`` ``billing.events.RESERVED_CAPACITY``, no tokens): seconds of ready replicas in one
    # minute, at this price per replica-hour. db_default: see ``endpoint``.
    replica_seconds = models.PositiveIntegerField(default=0, db_default=0)
    price_per_replica_hour = models.DecimalField(**PRICE, default=0, db_default=0)
    cost = models.DecimalField(**MONEY)
    # When the request finished (from the event): what reports group by.
    created_at = models.DateTimeField()
    # When billing recorded it (later than created_at when the billing queue was behind).
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["organization", "created_at"], name="billing_usage_org_created",
                         include=["cost"]),
            models.Index(fields=["api_key", "created_at"], name="billing_usage_key_created",
                         include=["cost", "prompt_tokens", "completion_tokens"]),
        ]
        constraints = [
            models.CheckConstraint(condition=Q(cached_prompt_tokens__lte=models.F("prompt_tokens")),
                                   name="billing_usage_cached_le_prompt"),
            models.CheckConstraint(condition=Q(cost__gte=0), name="billing_usage_cost_not_negative"),
            models.CheckConstraint(condition=Q(status__in=list(STATUSES)), name="billing_usage_status_valid"),
            models.CheckConstraint(condition=~Q(request_id=""), name="billing_usage_request_id_not_empty"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.cost}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class LedgerEntry(models.Model):
    """A signed movement of an organization's prepaid credit (USD). Credits are positive, charges
    negative; the balance is their sum. ``reference`` ties an entry to what caused it (a request id
    for usage, a PaymentIntent id for a top-up, a refund id for a refund) and is unique per kind, so
    the same cause can never move money twice."""

    class Kind(models.TextChoices):
        SIGNUP_CREDIT = "signup_credit", "Sign-up credit"
        TOPUP = "topup", "Top-up"
        USAGE = "usage", "Usage"
        ADJUSTMENT = "adjustment", "Adjustment"
        REFUND = "refund", "Refund"

    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="ledger_entries")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    amount = models.DecimalField(**MONEY)
    reference = models.CharField(max_length=255, blank=True, default="")
    description = models.CharField(max_length=255, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "ledger entries"
        indexes = [
            # Balance = SUM(amount) per organization: an index-only scan on PostgreSQL.
            models.Index(fields=["organization", "created_at"], name="billing_ledger_org_created", include=["amount"]),
            # The billing page's history by kind ("Payments & credits" among many usage charges), newest first.
            models.Index(fields=["organization", "kind", "-id"], name="billing_ledger_org_kind_id"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["kind", "reference"], condition=~Q(reference=""),
                                    name="billing_ledger_kind_reference_unique"),
            models.CheckConstraint(condition=Q(kind__in=["signup_credit", "topup", "usage", "adjustment", "refund"]), name="billing_ledger_kind_valid"),
            models.CheckConstraint(
                condition=(
                    (Q(kind__in=["signup_credit", "topup"]) & Q(amount__gt=0))
                    | (Q(kind__in=["usage", "refund"]) & Q(amount__lt=0))
                    | (Q(kind="adjustment") & ~Q(amount=0))
                ),
                name="billing_ledger_amount_sign_by_kind",
            ),
            # Usage, top-ups and refunds always say what caused them.
            models.CheckConstraint(condition=Q(kind__in=["adjustment"]) | ~Q(reference=""),
                                   name="billing_ledger_reference_required"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.amount} ({self.reference or '-'})"


class SpendLimit(models.Model):
    """An organization's monthly spend limit (USD, calendar month in UTC; null: no limit), and its
    alerts: low balance (``billing.balance_alerts``) and monthly spend (``billing.spend_alerts``)."""

    organization = models.OneToOneField("accounts.Organization", on_delete=models.CASCADE, related_name="spend_limit")
    monthly_limit = models.DecimalField(**MONEY, null=True, blank=True)
    # Owners and admins are emailed when the balance falls below this (USD); null: never.
    balance_alert = models.DecimalField(**MONEY, null=True, blank=True)
    # When they were (null: not since the balance was last at or above the alert).
    balance_alert_sent_at = models.DateTimeField(null=True, blank=True)
    # They are emailed when a calendar month's spend (UTC) reaches this (USD); null: never.
    spend_alert = models.DecimalField(**MONEY, null=True, blank=True)
    # The month (its first day) whose spend they were told of: once a month.
    spend_alert_sent_for = models.DateField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(monthly_limit__isnull=True) | Q(monthly_limit__gte=0),
                                   name="billing_spendlimit_not_negative"),
            models.CheckConstraint(condition=Q(balance_alert__isnull=True) | Q(balance_alert__gte=0),
                                   name="billing_spendlimit_alert_not_negative"),
            models.CheckConstraint(condition=Q(spend_alert__isnull=True) | Q(spend_alert__gte=0),
                                   name="billing_spendlimit_spend_alert_not_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.organization}: {self.monthly_limit if self.monthly_limit is not None else 'no limit'}"


class ApiKeySpendLimit(models.Model):
    """Limits on what one API key may spend over its lifetime: an amount (USD) and/or a number of
    tokens (prompt + completion); null: no limit."""

    api_key = models.OneToOneField("accounts.ApiKey", on_delete=models.CASCADE, related_name="spend_limit")
    amount_limit = models.DecimalField(**MONEY, null=True, blank=True)
    token_limit = models.PositiveBigIntegerField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(amount_limit__isnull=True) | Q(amount_limit__gte=0),
                                   name="billing_keylimit_amount_not_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.api_key}: {self.amount_limit} USD / {self.token_limit} tokens"


class BillingAccount(models.Model):
    """An organization's customer at Stripe, created on its first top-up."""

    organization = models.OneToOneField("accounts.Organization", on_delete=models.CASCADE, related_name="billing_account")
    stripe_customer_id = models.CharField(max_length=255, unique=True, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.organization} ({self.stripe_customer_id or 'no customer yet'})"


class TopUp(models.Model):
    """A top-up started in the dashboard: one Stripe PaymentIntent. The credit itself is the ledger
    entry written when Stripe's signed ``payment_intent.succeeded`` webhook arrives."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"

    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="topups")
    payment_intent_id = models.CharField(max_length=255, unique=True)
    amount = models.DecimalField(**MONEY)
    currency = models.CharField(max_length=3, default="usd")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=Q(amount__gt=0), name="billing_topup_amount_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.payment_intent_id} {self.amount} {self.status}"


class StripeEvent(models.Model):
    """A Stripe webhook event already processed: its id is the key, so a replay does nothing."""

    event_id = models.CharField(max_length=255, primary_key=True)
    type = models.CharField(max_length=100)
    livemode = models.BooleanField(default=False)
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-received_at"]

    def __str__(self) -> str:
        return f"{self.event_id} {self.type}"


class RefusedUsageEvent(models.Model):
    """A usage event billing could not record (malformed, an unknown organization or model): kept
    rather than dropped, since it is money, for an operator to fix the cause and replay it
    (``manage.py replay_usage_events``). ``replayed_at`` is set once a replay recorded it."""

    event = models.TextField(help_text="The event as JSON text, exactly as it came (it may hold what a JSON column "
                                       "refuses, such as NaN).")
    request_id = models.CharField(max_length=255, blank=True, db_index=True)
    error = models.TextField()
    refused_at = models.DateTimeField(auto_now_add=True)
    replayed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["refused_at", "id"]

    def __str__(self) -> str:
        return f"{self.request_id or '(no request id)'}: {self.error}"


# --- running totals (see the module's docstring; written only through ``billing.totals``) -----------


class OrganizationBalance(models.Model):
    """The sum of an organization's ledger entries, in micro-dollars; and what its usage cost
    beyond its charges, below a micro-dollar (``billing.pricing.charge``), in units of
    10**-EXACT_PLACES USD: taken by its next charge."""

    organization = models.OneToOneField("accounts.Organization", on_delete=models.CASCADE, primary_key=True,
                                        related_name="+")
    micros = models.BigIntegerField(default=0)
    carry = models.BigIntegerField(db_default=0)  # a database default: the totals are raw upserts

    def __str__(self) -> str:
        return f"{self.organization_id}: {self.micros} micro-USD"


class MonthlySpend(models.Model):
    """The cost of an organization's usage records in one calendar month (UTC), in micro-dollars."""

    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="+")
    month = models.DateField(help_text="The month's first day.")
    micros = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["organization", "month"], name="billing_monthlyspend_unique")]

    def __str__(self) -> str:
        return f"{self.organization_id} {self.month:%Y-%m}: {self.micros} micro-USD"


class ApiKeyTotals(models.Model):
    """What a key's usage records add up to: cost in micro-dollars, prompt + completion tokens of
    the billed ones (``billing.pricing.is_billed``), and how many there are."""

    api_key = models.OneToOneField("accounts.ApiKey", on_delete=models.CASCADE, primary_key=True, related_name="+")
    micros = models.BigIntegerField(default=0)
    tokens = models.BigIntegerField(default=0)
    requests = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.api_key_id}: {self.micros} micro-USD, {self.tokens} tokens, {self.requests} requests"
