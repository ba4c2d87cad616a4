"""Every write of the billing app: recording usage, moving credit, spend limits, Stripe top-ups.

Money moves only as ledger entries, each unique by (kind, reference): a usage event delivered twice,
a webhook replayed, two workers racing on the same request all end with one entry.

A request is priced at the catalog's prices when the gateway admitted it: they travel with it to its
worker and on in its usage event, so a price changed while it runs, or while its event waits in a
backlogged billing queue, applies to the requests admitted after the change only. An event without
prices (one queued across the upgrade that added them) is priced at the catalog's when it is recorded.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any, Mapping

import stripe
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef, Subquery
from django.utils import timezone

from accounts.models import ApiKey, Membership, Organization
from inference_platform.read_cache import ReadCache
from models_catalog.models import CatalogModel, Deployment

from . import balance_alerts, reserved_capacity, selectors, spend_alerts, totals
from .errors import (
    CardDeclined,
    InvalidParameter,
    InvalidUsageEvent,
    NotAllowed,
    PaymentProviderError,
    QuotaExceeded,
    UnknownModel,
)
from .events import parse_usage_event
from .models import (LIMIT_MAX, ApiKeySpendLimit, BillingAccount, LedgerEntry, RefusedUsageEvent, SpendLimit,
                     StripeEvent, TopUp, UsageRecord)
from .pricing import COST_QUANTUM, Prices, charge, exact_cost, is_billed
from .stripe_api import stripe_client

logger = logging.getLogger(__name__)

CENTS = Decimal("0.01")


# --- credit -----------------------------------------------------------------------------------------


def _write_entry(*, organization_id: int, kind: str, amount: Decimal, reference: str = "",
                 description: str = "", carry: Decimal | None = None) -> LedgerEntry:
    """Write a ledger entry and add it to the organization's balance, in the caller's transaction
    (a usage charge's with the carry it leaves)."""
    entry = LedgerEntry.objects.create(organization_id=organization_id, kind=kind, amount=amount,
                                       reference=reference, description=description)
    _add_to_balance(organization_id=organization_id, amount=amount, carry=carry)
    return entry


def _add_to_balance(*, organization_id: int, amount: Decimal, carry: Decimal | None = None) -> None:
    """Add to the running balance in the caller's transaction; once it commits, the
    organization's low-balance alert looks at the new balance."""
    totals.add_to_balance(organization_id=organization_id, amount=amount, carry=carry)
    if amount:
        balance_alerts.after_commit(organization_id=organization_id)


def _post(*, organization_id: int, kind: str, amount: Decimal, reference: str = "",
          description: str = "") -> tuple[LedgerEntry, bool]:
    """Write a ledger entry and add it to the organization's balance, in one transaction. With a
    ``reference`` it happens once: a second call returns the first entry and adds nothing.
    Returns the entry and whether it was written now."""
    with transaction.atomic():
        if not reference:
            return _write_entry(organization_id=organization_id, kind=kind, amount=amount,
                                description=description), True
        entry, created = LedgerEntry.objects.get_or_create(
            kind=kind, reference=reference,
            defaults={"organization_id": organization_id, "amount": amount, "description": description},
        )
        if created:
            _add_to_balance(organization_id=entry.organization_id, amount=entry.amount)
    return entry, created


def grant_signup_credit(*, organization: Organization) -> LedgerEntry | None:
    """Credit ``BILLING_SIGNUP_CREDIT`` to the first organization its owner creates, once (None
    when the setting is 0, or when the owner already had a sign-up credit for another organization:
    creating organizations must not farm free credit). The entry's reference is the owner's user id,
    unique per kind, so two organizations created at once by the same user cannot both get it."""
    amount = settings.BILLING_SIGNUP_CREDIT
    if amount <= 0:
        return None
    existing = LedgerEntry.objects.filter(organization=organization, kind=LedgerEntry.Kind.SIGNUP_CREDIT).first()
    if existing is not None:
        return existing
    owner = (Membership.objects.filter(organization=organization, role=Membership.Role.OWNER)
             .order_by("created_at", "id").values("user_id", "user__email_verified_at").first())
    owner_id = owner["user_id"] if owner else None
    if owner is not None and owner["user__email_verified_at"] is None:
        return None  # not until they confirm their address (``grant_signup_credit_on_verification``)
    if owner_id is None:
        reference = f"organization:{organization.pk}"
    else:
        # Credits granted before they were referenced by user (by organization): one in an
        # organization this user founded (its first owner) counts too. Owning an organization
        # someone else founded (an invitation as owner) does not use up the user's own credit.
        founder = (Membership.objects.filter(organization=OuterRef("organization"), role=Membership.Role.OWNER)
                   .order_by("created_at", "id").values("user_id")[:1])
        if LedgerEntry.objects.filter(
            kind=LedgerEntry.Kind.SIGNUP_CREDIT, reference__startswith="organization:",
            organization__memberships__user_id=owner_id, organization__memberships__role=Membership.Role.OWNER,
        ).annotate(founder=Subquery(founder)).filter(founder=owner_id).exists():
            return None
        reference = f"user:{owner_id}"
    entry, _ = _post(organization_id=organization.pk, kind=LedgerEntry.Kind.SIGNUP_CREDIT,
                     amount=amount.quantize(COST_QUANTUM), reference=reference, description="Sign-up credit")
    return entry if entry.organization_id == organization.pk else None


def grant_signup_credit_on_verification(*, user) -> LedgerEntry | None:
    """``user`` confirmed their address: the sign-up credit of the first organization they founded
    (its first owner), held back until now. None when there is none to grant."""
    founder = (Membership.objects.filter(organization=OuterRef("pk"), role=Membership.Role.OWNER)
               .order_by("created_at", "id").values("user_id")[:1])
    founded = (Organization.objects.filter(memberships__user=user, memberships__role=Membership.Role.OWNER)
               .annotate(founder=Subquery(founder)).filter(founder=user.pk).order_by("created_at", "id").first())
    return grant_signup_credit(organization=founded) if founded is not None else None


def add_adjustment(*, organization: Organization, amount: Decimal, description: str,
                   reference: str = "") -> tuple[LedgerEntry, bool]:
    """An operator's manual credit (positive) or debit (negative); returns the entry and whether it
    was written now. With a ``reference`` it happens once: a second call with the same reference
    returns the first entry (one of another organization raises InvalidParameter: nothing would be
    credited where it was meant to be)."""
    if isinstance(amount, float) or not isinstance(amount, Decimal):
        raise InvalidParameter("amount", "amount must be a Decimal")
    try:
        amount = amount.quantize(COST_QUANTUM, rounding=ROUND_HALF_UP)
    except InvalidOperation:
        raise InvalidParameter("amount", f"amount {amount} is not a USD amount") from None
    if amount == 0:
        raise InvalidParameter("amount", "an adjustment cannot be zero")
    entry, created = _post(organization_id=organization.pk, kind=LedgerEntry.Kind.ADJUSTMENT, amount=amount,
                           reference=reference, description=description[:255])
    if entry.organization_id != organization.pk:
        raise InvalidParameter("reference", f"the reference {reference!r} was already used for another organization")
    return entry, created


# --- usage ------------------------------------------------------------------------------------------


# Catalog models (their prices) by slug, read once per process until one changes.
_catalog_models = ReadCache()


def _usage_references(parsed) -> tuple[int | None, int | None]:
    """The event's API key and deployment ids as they may be stored, in one query: a key or a
    deployment deleted since is None (the usage is kept; the names still say which it was).
    Raises InvalidUsageEvent for an unknown organization or a key of another organization."""
    row = (Organization.objects.filter(pk=parsed.organization_id)
           .annotate(key_owner=Subquery(ApiKey.objects.filter(pk=parsed.api_key_id).order_by().values("organization_id")),
                     deployment_exists=Exists(Deployment.objects.filter(pk=parsed.deployment_id)))
           .values("key_owner", "deployment_exists").first())
    if row is None:
        raise InvalidUsageEvent("organization_id", f"no organization has id {parsed.organization_id}")
    if row["key_owner"] is not None and row["key_owner"] != parsed.organization_id:
        raise InvalidUsageEvent("api_key_id", "the key belongs to another organization")
    return (parsed.api_key_id if row["key_owner"] is not None else None,
            parsed.deployment_id if row["deployment_exists"] else None)


def record_usage(*, event: Mapping[str, Any]) -> UsageRecord:
    """Record one usage event (:class:`billing.events.UsageEvent`) and charge its cost, once.

    Idempotent by ``request_id``: the record, its ledger charge and the running totals are written
    in one transaction, and the unique request id means a second delivery (a retry, a redelivery,
    a race between two billing workers) rolls its transaction back and returns the existing record
    without charging again. The prices applied, copied onto the record, are the event's (the
    catalog's when the request was admitted), or for an event without them the catalog model's now.
    Ten statements in all, the transaction's included: this runs once per request.

    Raises InvalidUsageEvent (malformed, unknown organization, a key of another organization) or
    UnknownModel (an event without prices for a model no longer in the catalog): permanent errors,
    redelivering the event cannot fix them.
    """
    parsed = parse_usage_event(event)
    try:
        record = _record_usage(parsed)
    except (InvalidUsageEvent, UnknownModel):
        # A redelivery of an event recorded before its model or organization went away is not
        # an error: it is recorded.
        existing = _recorded(parsed.request_id)
        if existing is None:
            raise
        return existing
    if parsed.replica_seconds and record.cost > 0:
        reserved_capacity.stop_if_unpaid(organization_id=parsed.organization_id)
    return record


def _recorded(request_id: str) -> UsageRecord | None:
    return UsageRecord.objects.filter(request_id=request_id).first()


def _catalog_prices(parsed) -> Prices:
    """The catalog model's prices now: for an event that does not carry the admission's."""
    catalog_model = _catalog_models.get(parsed.model, lambda: CatalogModel.objects.filter(slug=parsed.model).first())
    if catalog_model is None:
        raise UnknownModel(f"usage event {parsed.request_id}: no catalog model {parsed.model!r}", param="model")
    return Prices.of(catalog_model)


def _exact_cost(usage, prices: Prices) -> Decimal:
    """The exact cost of a usage event or record (``billing.pricing.exact_cost``)."""
    return exact_cost(prices=prices, prompt_tokens=usage.prompt_tokens, cached_prompt_tokens=usage.cached_prompt_tokens,
                      completion_tokens=usage.completion_tokens, status=usage.status,
                      replica_seconds=usage.replica_seconds)


def _record_usage(parsed) -> UsageRecord:
    prices = parsed.prices if parsed.prices is not None else _catalog_prices(parsed)
    cost = _exact_cost(parsed, prices)
    for attempt in range(2):
        try:
            return _write_usage(parsed, prices, cost)
        except IntegrityError:  # recorded meanwhile (request_id is unique): charged there, not here
            existing = _recorded(parsed.request_id)
            if existing is not None:
                if parsed.rerun and parsed.status == UsageRecord.Status.COMPLETED \
                        and existing.status != UsageRecord.Status.COMPLETED:
                    return _complete(existing, parsed, prices, cost)
                return existing
            if attempt:
                raise  # another constraint: a real error, not a duplicate
            # Or its key or deployment was deleted since they were looked up (PostgreSQL checks
            # foreign keys at commit): look them up again rather than lose the event.


def _entry_description(parsed) -> str:
    """The model, and the deployment that served it when it has a name of its own; for reserved
    capacity, the deployment and its replica-seconds."""
    if parsed.replica_seconds:
        return f"Reserved capacity: {parsed.deployment or parsed.model}, {parsed.replica_seconds} replica-seconds"
    return parsed.model + (f" on {parsed.deployment}" if parsed.deployment not in ("", parsed.model) else "")


def _write_usage(parsed, prices: Prices, exact: Decimal) -> UsageRecord:
    """The record, its charge and the totals, in one transaction; IntegrityError if any fails.
    The balance's row is taken first: the lock order reconcile relies on, and its carry decides
    the charge (``billing.pricing.charge``)."""
    api_key_id, deployment_id = _usage_references(parsed)
    with transaction.atomic():
        cost, carry = charge(cost=exact, carry=totals.take_carry(organization_id=parsed.organization_id))
        record = UsageRecord.objects.create(
            request_id=parsed.request_id,
            organization_id=parsed.organization_id,
            api_key_id=api_key_id,
            deployment_id=deployment_id,
            model=parsed.model,
            deployment_name=parsed.deployment,
            endpoint=parsed.endpoint,
            prompt_tokens=parsed.prompt_tokens,
            cached_prompt_tokens=parsed.cached_prompt_tokens,
            completion_tokens=parsed.completion_tokens,
            status=parsed.status,
            queue_ms=parsed.queue_ms,
            ttft_ms=parsed.ttft_ms,
            latency_ms=parsed.latency_ms,
            mean_batch_size=parsed.batch_size,
            price_input_per_mtok=prices.input_per_mtok,
            price_cached_input_per_mtok=prices.cached_input_per_mtok,
            price_output_per_mtok=prices.output_per_mtok,
            price_per_request=prices.per_request,
            replica_seconds=parsed.replica_seconds,
            price_per_replica_hour=prices.per_replica_hour,
            cost=cost,
            created_at=parsed.finished_at,
        )
        # The usage record is unique by request id, so its charge is written once with it.
        if cost > 0:
            _write_entry(organization_id=parsed.organization_id, kind=LedgerEntry.Kind.USAGE, amount=-cost,
                         reference=parsed.request_id, description=_entry_description(parsed), carry=carry)
        else:
            totals.add_to_balance(organization_id=parsed.organization_id, amount=Decimal(0), carry=carry)
        billed = is_billed(status=parsed.status, completion_tokens=parsed.completion_tokens)
        totals.add_usage(organization_id=parsed.organization_id, api_key_id=api_key_id,
                         created_at=record.created_at, cost=cost,
                         tokens=parsed.prompt_tokens + parsed.completion_tokens if billed else 0)
        if cost > 0:
            spend_alerts.after_commit(organization_id=parsed.organization_id, month=totals.month_of(record.created_at))
    return record


def _complete(existing: UsageRecord, parsed, prices: Prices, exact: Decimal) -> UsageRecord:
    """A request recorded as cancelled or failed ran again under its id and completed (a batch's
    line, run again after its runner stopped mid-answer: the event says ``rerun``): the record
    becomes the completed run's and its charge that run's cost, so the client pays for the one
    answer it got, once. A completed record is never changed. (An API request's id is its run's
    alone: a recovery's "failed, free" record of it stands, as the client was told.)"""
    with transaction.atomic():
        carry = totals.take_carry(organization_id=existing.organization_id)  # the lock order
        record = UsageRecord.objects.select_for_update().get(pk=existing.pk)
        if record.status == UsageRecord.Status.COMPLETED:
            return record
        was_billed = is_billed(status=record.status, completion_tokens=record.completion_tokens)
        old_cost, old_tokens = record.cost, record.prompt_tokens + record.completion_tokens if was_billed else 0
        # Charges plus carry stay the exact costs: the old run's exact cost leaves, its charge comes back.
        cost, carry = charge(cost=exact, carry=carry + old_cost - _exact_cost(record, Prices.of(record)))
        for name in ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "status", "queue_ms",
                     "ttft_ms", "latency_ms"):
            setattr(record, name, getattr(parsed, name))
        record.mean_batch_size = parsed.batch_size
        record.price_input_per_mtok, record.price_cached_input_per_mtok = prices.input_per_mtok, prices.cached_input_per_mtok
        record.price_output_per_mtok, record.price_per_request = prices.output_per_mtok, prices.per_request
        record.cost = cost
        record.save()
        entry = LedgerEntry.objects.select_for_update().filter(kind=LedgerEntry.Kind.USAGE,
                                                               reference=record.request_id).first()
        if entry is None and cost > 0:
            _write_entry(organization_id=record.organization_id, kind=LedgerEntry.Kind.USAGE, amount=-cost,
                         reference=record.request_id, description=_entry_description(parsed), carry=carry)
        else:
            if entry is not None:  # a usage entry is never zero: one that would be goes
                if cost > 0:
                    LedgerEntry.objects.filter(pk=entry.pk).update(amount=-cost)
                else:
                    LedgerEntry.objects.filter(pk=entry.pk).delete()
            _add_to_balance(organization_id=record.organization_id, amount=old_cost - cost, carry=carry)
        totals.add_usage(organization_id=record.organization_id, api_key_id=record.api_key_id,
                         created_at=record.created_at, cost=cost - old_cost,
                         tokens=parsed.prompt_tokens + parsed.completion_tokens - old_tokens, requests=0)
        if cost > old_cost:
            spend_alerts.after_commit(organization_id=record.organization_id, month=totals.month_of(record.created_at))
    return record


def keep_refused_event(*, event: Any, error: str) -> RefusedUsageEvent:
    """Keep an event ``record_usage`` refused, for an operator to replay once its cause is fixed."""
    request_id = event.get("request_id") if isinstance(event, Mapping) else None
    return RefusedUsageEvent.objects.create(
        event=json.dumps(event, default=repr), error=error,
        request_id=request_id[:255] if isinstance(request_id, str) else "")


@dataclass
class Replayed:
    recorded: int = 0  # now recorded (or found recorded already)
    refused: int = 0  # refused again, its error updated


def replay_refused_events() -> Replayed:
    """Try each kept refused event again, oldest first (recording is idempotent by request id)."""
    outcome = Replayed()
    for kept in RefusedUsageEvent.objects.filter(replayed_at__isnull=True).iterator():
        try:
            record_usage(event=json.loads(kept.event))
        except (InvalidUsageEvent, UnknownModel) as exc:
            outcome.refused += 1
            RefusedUsageEvent.objects.filter(pk=kept.pk).update(error=exc.message)
        else:
            outcome.recorded += 1
            RefusedUsageEvent.objects.filter(pk=kept.pk).update(replayed_at=timezone.now())
    return outcome


# --- spend limits and the quota check ---------------------------------------------------------------


def _limit(name: str, value) -> Decimal | None:
    """A limit as given, exactly: a Decimal >= 0, at most ``LIMIT_MAX``, in micro-dollars at the
    finest (never rounded: a limit is what its setter wrote). The one check of every limit (the API,
    the billing page's form, a key's limit from the dashboard)."""
    if value is None:
        return None
    if isinstance(value, float) or not isinstance(value, Decimal) or not value.is_finite() or value < 0:
        raise InvalidParameter(name, f"{name} must be a Decimal >= 0 or None")
    if value > LIMIT_MAX:
        raise InvalidParameter(name, f"{name} must be at most {LIMIT_MAX:,f} USD")
    if value != value.quantize(COST_QUANTUM):
        raise InvalidParameter(name, f"{name} must have at most {-COST_QUANTUM.as_tuple().exponent} decimal places")
    return value.quantize(COST_QUANTUM)


def set_spend_limit(*, organization: Organization, monthly_limit: Decimal | None, actor=None) -> SpendLimit:
    """Set (or clear, with None) the organization's monthly spend limit in USD. ``actor``: the
    member making the change (the dashboard's user, or the creator of the calling API key:
    ``accounts.authentication.key_actor``), who must be an owner or an admin (NotAllowed
    otherwise); None for a key the operator's command line made for no user, the admin site, or
    code."""
    if actor is not None and not selectors.may_change_spend_limit(user=actor, organization=organization):
        raise NotAllowed("Only owners and admins can change the organization's spend limit.")
    limit, _ = SpendLimit.objects.update_or_create(
        organization=organization, defaults={"monthly_limit": _limit("monthly_limit", monthly_limit)}
    )
    return limit


def set_balance_alert(*, organization: Organization, amount: Decimal | None, actor=None) -> SpendLimit:
    """Email the organization's owners and admins when its balance falls below ``amount`` USD
    (None: never). A new amount starts armed: set while the balance is already below it, it is
    sent at once; the same amount saved again changes nothing. ``actor``: as for ``set_spend_limit``."""
    return _set_alert(organization, "balance_alert", amount, actor, balance_alerts.after_commit)


def set_spend_alert(*, organization: Organization, amount: Decimal | None, actor=None) -> SpendLimit:
    """Email the organization's owners and admins when a calendar month's spend (UTC) reaches
    ``amount`` USD, once a month (None: never). A new amount starts armed, as a balance alert."""
    return _set_alert(organization, "spend_alert", amount, actor, lambda organization_id: spend_alerts.after_commit(
        organization_id=organization_id, month=totals.month_of(timezone.now())))


_ALERT_SENT = {"balance_alert": "balance_alert_sent_at", "spend_alert": "spend_alert_sent_for"}


def _set_alert(organization: Organization, field: str, amount: Decimal | None, actor, look) -> SpendLimit:
    if actor is not None and not selectors.may_change_spend_limit(user=actor, organization=organization):
        raise NotAllowed("Only owners and admins can change the organization's alerts.")
    amount, sent = _limit(field, amount), _ALERT_SENT[field]
    with transaction.atomic():
        limit, created = SpendLimit.objects.select_for_update().get_or_create(organization=organization)
        if created or getattr(limit, field) != amount:
            setattr(limit, field, amount)
            setattr(limit, sent, None)
            limit.save(update_fields=[field, sent, "updated_at"])
            if amount is not None:
                look(organization_id=organization.pk)
    return limit


def update_limits(*, organization: Organization, actor=None, **changes: Decimal | None) -> None:
    """Set the ``monthly_limit``, ``balance_alert`` and ``spend_alert`` given: all or none."""
    unknown = set(changes) - {"monthly_limit", "balance_alert", "spend_alert"}
    if unknown:
        raise TypeError(f"unknown limits: {', '.join(sorted(unknown))}")
    with transaction.atomic():
        if "monthly_limit" in changes:
            set_spend_limit(organization=organization, monthly_limit=changes["monthly_limit"], actor=actor)
        if "balance_alert" in changes:
            set_balance_alert(organization=organization, amount=changes["balance_alert"], actor=actor)
        if "spend_alert" in changes:
            set_spend_alert(organization=organization, amount=changes["spend_alert"], actor=actor)


def set_api_key_spend_limit(*, api_key: ApiKey, amount_limit: Decimal | None = None,
                            token_limit: int | None = None) -> ApiKeySpendLimit:
    """Set (or clear, with None) what a key may spend over its lifetime: USD and/or tokens."""
    if token_limit is not None and (isinstance(token_limit, bool) or not isinstance(token_limit, int) or token_limit < 0):
        raise InvalidParameter("token_limit", "token_limit must be an integer >= 0 or None")
    limit, _ = ApiKeySpendLimit.objects.update_or_create(
        api_key=api_key,
        defaults={"amount_limit": _limit("amount_limit", amount_limit), "token_limit": token_limit},
    )
    return limit


def check_quota(*, organization: Organization, api_key: ApiKey | None = None) -> None:
    """Refuse a new request (QuotaExceeded, code ``insufficient_quota``) for the reason
    ``selectors.quota_refusal`` gives, if any."""
    refusal = selectors.quota_refusal(organization=organization, api_key=api_key)
    if refusal is not None:
        raise QuotaExceeded(refusal)


# --- Stripe top-ups ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopUpIntent:
    """What the dashboard needs to confirm a top-up with Stripe.js."""

    id: str
    client_secret: str
    amount: Decimal
    currency: str


def _topup_amount(amount) -> Decimal:
    if isinstance(amount, float) or isinstance(amount, bool):
        raise InvalidParameter("amount", "amount must be a decimal string such as \"20.00\", not a float")
    try:
        value = Decimal(str(amount)) if not isinstance(amount, Decimal) else amount
        if not value.is_finite() or value != value.quantize(CENTS):  # quantize: too many digits raise
            raise InvalidParameter("amount", "amount must be in USD with at most 2 decimal places")
    except InvalidOperation:
        raise InvalidParameter("amount", f"amount must be a decimal amount in USD, not {amount!r}") from None
    # Never above LIMIT_MAX, whatever TOPUP_MAX says: a larger amount would not round-trip on SQLite.
    highest = min(settings.TOPUP_MAX, LIMIT_MAX.quantize(CENTS, rounding=ROUND_DOWN))
    if not settings.TOPUP_MIN <= value <= highest:
        raise InvalidParameter(
            "amount", f"amount must be between {settings.TOPUP_MIN} and {highest} USD, not {value}"
        )
    return value.quantize(CENTS)


def _stripe_call(call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except stripe.StripeError as exc:
        logger.warning("Stripe refused %s: %s", getattr(call, "__qualname__", call), exc)
        raise PaymentProviderError(exc.user_message or None) from exc


def ensure_stripe_customer(*, organization: Organization) -> str:
    """The organization's Stripe customer id, created once (the row lock keeps it to one)."""
    client = stripe_client()
    with transaction.atomic():
        account, _ = BillingAccount.objects.select_for_update().get_or_create(organization=organization)
        if account.stripe_customer_id:
            return account.stripe_customer_id
        customer = _stripe_call(
            client.v1.customers.create,
            params={"name": organization.name, "metadata": {"organization_id": str(organization.pk)}},
            options={"idempotency_key": f"customer-organization-{organization.pk}"},
        )
        account.stripe_customer_id = customer.id
        account.save(update_fields=["stripe_customer_id"])
        return customer.id


def create_topup(*, organization: Organization, amount: Decimal, created_by=None) -> TopUpIntent:
    """Start a top-up of ``amount`` USD (TOPUP_MIN..TOPUP_MAX, cents): a PaymentIntent for the
    organization's Stripe customer. Nothing is credited until Stripe's signed
    ``payment_intent.succeeded`` webhook arrives (:func:`handle_stripe_event`)."""
    value = _topup_amount(amount)
    customer_id = ensure_stripe_customer(organization=organization)
    intent = _stripe_call(
        stripe_client().v1.payment_intents.create,
        params={
            "amount": int(value * 100),
            "currency": "usd",
            "customer": customer_id,
            "payment_method_types": ["card"],
            "metadata": {"organization_id": str(organization.pk), "purpose": "topup"},
        },
    )
    TopUp.objects.create(organization=organization, payment_intent_id=intent.id, amount=value,
                         currency="usd", created_by=created_by)
    return TopUpIntent(id=intent.id, client_secret=intent.client_secret, amount=value, currency="usd")


_CARD_TOKEN = re.compile(r"^tok_[A-Za-z0-9_]{4,250}$")


@dataclass(frozen=True)
class TopUpPayment:
    """Where a top-up's payment stands after confirmation: ``succeeded`` / ``processing`` (the
    webhook credits it), ``requires_action`` (Stripe.js finishes 3-D Secure with the client secret)."""

    status: str
    client_secret: str


def pay_topup_with_card_token(*, organization: Organization, payment_intent_id: str, card_token: str) -> TopUpPayment:
    """Confirm a pending top-up of ``organization`` (from :func:`create_topup`) with the card
    Stripe.js tokenized in the browser (``stripe.createToken(cardElement)``): the card is saved on
    the organization's Stripe customer, set on the PaymentIntent, and the PaymentIntent confirmed.
    Credits nothing itself: Stripe's signed ``payment_intent.succeeded`` webhook does, once.
    Raises CardDeclined (unreadable or refused card), InvalidParameter (unknown or finished
    top-up), PaymentProviderError or PaymentsNotConfigured."""
    if not isinstance(card_token, str) or not _CARD_TOKEN.match(card_token):
        raise CardDeclined("The card details could not be read: enter them again.")
    topup = TopUp.objects.filter(organization=organization, payment_intent_id=payment_intent_id).first()
    if topup is None:
        raise InvalidParameter("payment_intent", "This top-up does not exist.")
    if topup.status != TopUp.Status.PENDING:
        raise InvalidParameter("payment_intent", f"This top-up is already {topup.get_status_display().lower()}.")
    customer_id = ensure_stripe_customer(organization=organization)
    client = stripe_client()
    try:
        card = client.v1.customers.payment_sources.create(customer_id, params={"source": card_token})
        client.v1.payment_intents.update(payment_intent_id, params={"payment_method": card.id})
        intent = client.v1.payment_intents.confirm(payment_intent_id)
    except stripe.CardError as exc:
        raise CardDeclined(exc.user_message or None) from None
    except stripe.StripeError as exc:
        logger.warning("Stripe refused to confirm %s: %s", payment_intent_id, exc)
        raise PaymentProviderError(exc.user_message or None) from exc
    return TopUpPayment(status=intent.status, client_secret=intent.client_secret)


def _usd_from_cents(value) -> Decimal | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return (Decimal(value) / 100).quantize(COST_QUANTUM)


def _on_payment_intent_succeeded(intent: dict) -> None:
    topup = TopUp.objects.select_for_update().filter(payment_intent_id=intent.get("id")).first()
    if topup is None:
        logger.warning("payment_intent.succeeded for %s: not a top-up of this platform, ignored", intent.get("id"))
        return
    amount = _usd_from_cents(intent.get("amount_received") or intent.get("amount"))
    if amount is None or (intent.get("currency") or "").lower() != "usd":
        logger.error("payment_intent.succeeded for %s: unusable amount/currency %r %r, not credited",
                     topup.payment_intent_id, intent.get("amount"), intent.get("currency"))
        return
    _post(organization_id=topup.organization_id, kind=LedgerEntry.Kind.TOPUP, amount=amount,
          reference=topup.payment_intent_id, description="Top-up (Stripe)")
    if topup.status != TopUp.Status.SUCCEEDED:
        topup.status = TopUp.Status.SUCCEEDED
        topup.save(update_fields=["status", "updated_at"])


def _on_payment_intent_failed(intent: dict) -> None:
    updated = TopUp.objects.filter(payment_intent_id=intent.get("id"), status=TopUp.Status.PENDING).update(
        status=TopUp.Status.FAILED
    )
    if not updated:
        logger.info("payment_intent.payment_failed for %s: no pending top-up", intent.get("id"))


def _refunds_of(charge: dict) -> list[dict]:
    """The charge's refunds: from the event when it carries them all, else listed from Stripe."""
    embedded = charge.get("refunds")
    if isinstance(embedded, dict) and isinstance(embedded.get("data"), list) and not embedded.get("has_more"):
        return embedded["data"]
    listing = _stripe_call(stripe_client().v1.refunds.list, params={"charge": charge["id"], "limit": 100})
    return [refund.to_dict() for refund in listing.auto_paging_iter()]


def _apply_refund(topup: TopUp, refund: dict) -> None:
    """A refund of a top-up in its current state: debited once when it succeeded (reference its
    id); credited back once if it failed or was cancelled after that. Pending: nothing yet (Stripe
    reports the change in ``charge.refund.updated``)."""
    amount, refund_id = _usd_from_cents(refund.get("amount")), refund.get("id")
    if amount is None or not refund_id:
        return
    if refund.get("status") == "succeeded":
        _post(organization_id=topup.organization_id, kind=LedgerEntry.Kind.REFUND, amount=-amount,
              reference=refund_id, description=f"Refund of top-up {topup.payment_intent_id}")
    elif refund.get("status") in ("failed", "canceled") and \
            LedgerEntry.objects.filter(kind=LedgerEntry.Kind.REFUND, reference=refund_id).exists():
        _post(organization_id=topup.organization_id, kind=LedgerEntry.Kind.ADJUSTMENT, amount=amount,
              reference=f"refund-reversed:{refund_id}", description=f"Refund {refund_id} {refund['status']}: "
                                                                   "credit restored")


def _topup_paid_by(payment_intent_id: str | None, event: str) -> TopUp | None:
    topup = TopUp.objects.filter(payment_intent_id=payment_intent_id or "").first()
    if topup is None:
        logger.warning("%s for %s: not a top-up of this platform, ignored", event, payment_intent_id)
    return topup


def _on_charge_refunded(charge: dict) -> None:
    topup = _topup_paid_by(charge.get("payment_intent"), "charge.refunded")
    for refund in _refunds_of(charge) if topup is not None else ():
        _apply_refund(topup, refund)


def _on_refund_updated(refund: dict) -> None:
    topup = _topup_paid_by(refund.get("payment_intent"), "refund update")
    if topup is not None:
        _apply_refund(topup, _current_refund(refund))


def _current_refund(refund: dict) -> dict:
    """The refund as Stripe has it now: its update events may arrive out of order (a "failed"
    before the "succeeded" it follows would leave the refund debited). Without Stripe configured
    here (tests), the event's own copy."""
    if not settings.STRIPE_SECRET_KEY or not refund.get("id"):
        return refund
    return _stripe_call(stripe_client().v1.refunds.retrieve, refund["id"]).to_dict()


_STRIPE_HANDLERS = {
    "payment_intent.succeeded": _on_payment_intent_succeeded,
    "payment_intent.payment_failed": _on_payment_intent_failed,
    "charge.refunded": _on_charge_refunded,
    # A refund that was pending when charge.refunded came, or that failed afterwards.
    "charge.refund.updated": _on_refund_updated,
    "refund.updated": _on_refund_updated,
}


def handle_stripe_event(*, event: dict) -> bool:
    """Apply a verified Stripe event (see ``stripe_api.construct_webhook_event``) exactly once.

    ``payment_intent.succeeded`` credits the top-up (amount from the PaymentIntent, reference its
    id); ``charge.refunded`` and the refund updates debit each succeeded refund once (reference the
    refund id) and credit back one that failed after that; ``payment_intent.payment_failed`` marks
    the top-up failed. Other types are stored and ignored.
    Returns False for an event id already processed. A handler that raises rolls everything back,
    the event included, so Stripe's retry can process it later.
    """
    with transaction.atomic():
        _, created = StripeEvent.objects.get_or_create(
            event_id=event["id"], defaults={"type": event["type"][:100], "livemode": bool(event.get("livemode"))}
        )
        if not created:
            return False
        handler = _STRIPE_HANDLERS.get(event["type"])
        if handler is not None:
            handler(event["data"]["object"])
        return True
