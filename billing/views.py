"""Billing's plain Django views: Stripe's webhook endpoint, the dashboard's billing page and its
forms for the spend limit and the alerts (monthly spend, low balance)."""

from __future__ import annotations

import logging

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from accounts.middleware import SESSION_ORGANIZATION_KEY
from accounts.selectors import current_organization_for_user

from . import selectors, serializers, services
from .alert_mail import dollars
from .errors import BillingError, InvalidParameter
from .models import LedgerEntry
from .stripe_api import InvalidWebhook, card_topups_enabled, construct_webhook_event

logger = logging.getLogger(__name__)


@csrf_exempt
@require_POST
def stripe_webhook(request: HttpRequest) -> JsonResponse:
    """``POST /billing/stripe/webhook``: a Stripe event, verified by its signature, applied once.

    400 for a missing, wrong or stale (over 300 s) signature and for a body that is not an event:
    nothing is credited. 200 for a genuine event, new or already processed (Stripe stops retrying).
    """
    try:
        event = construct_webhook_event(payload=request.body, signature=request.headers.get("Stripe-Signature"))
    except InvalidWebhook as exc:
        logger.warning("Stripe webhook refused: %s", exc.message)
        return JsonResponse(exc.as_error(), status=400)
    processed = services.handle_stripe_event(event=event)
    return JsonResponse({"received": True, "duplicate": not processed})


# The billing page's views of the ledger: payments and credits are what people look for, and
# would drown among one usage charge per request.
LEDGER_VIEWS = {
    "all": None,
    "payments": [LedgerEntry.Kind.SIGNUP_CREDIT, LedgerEntry.Kind.TOPUP, LedgerEntry.Kind.ADJUSTMENT,
                 LedgerEntry.Kind.REFUND],
    "usage": [LedgerEntry.Kind.USAGE],
}
LEDGER_PAGE_SIZE = 20


def _entry_id(value: str | None) -> int | None:
    return int(value) if value and value.isascii() and value.isdigit() and len(value) < 19 else None


def _organization(request: HttpRequest):
    return current_organization_for_user(user=request.user, organization_id=request.session.get(SESSION_ORGANIZATION_KEY))


def _render_page(request: HttpRequest, organization, *, status: int = 200, **extra):
    context = {"organization": organization}
    if organization is not None:
        show = request.GET.get("show") if request.GET.get("show") in LEDGER_VIEWS else "all"
        before = _entry_id(request.GET.get("before"))
        entries, more = selectors.ledger_page(organization=organization, limit=LEDGER_PAGE_SIZE, after=before,
                                              kinds=LEDGER_VIEWS[show])
        limits = selectors.organization_limits(organization=organization)
        for field, (name, _, _) in AMOUNT_FORMS.items():  # each form's value, error and whether it is set
            context.update({f"{name}_value": _plain(limits[field]), f"{name}_error": None,
                            f"{name}_set": limits[field] is not None})
        context.update(
            ledger_show=show,
            ledger_views=list(LEDGER_VIEWS),
            ledger_older=entries[-1].pk if more else None,
            ledger_paged=before is not None,
            balance=selectors.balance(organization=organization),
            monthly_spend=selectors.monthly_spend(organization=organization),
            monthly_limit=limits["monthly_limit"],
            can_change_limit=selectors.may_change_spend_limit(user=request.user, organization=organization),
            entries=entries,
            stripe_enabled=card_topups_enabled(),
            stripe_publishable_key=settings.STRIPE_PUBLISHABLE_KEY,
            stripe_js_url=settings.STRIPE_JS_URL,
            topup_min=settings.TOPUP_MIN,
            topup_max=settings.TOPUP_MAX,
        )
    context.update(extra)
    return render(request, "billing/overview.html", context, status=status)


def _form_message(exc: BillingError, field: str, label: str) -> str:
    """The service's message as the form shows it: the service words it for the API, naming the
    parameter ("monthly_limit must ..."), where the page has a label."""
    if isinstance(exc, InvalidParameter) and exc.param == field and exc.message.startswith(f"{field} "):
        return f"{label} " + exc.message.removeprefix(f"{field} ")
    return exc.message


def _plain(limit) -> str:
    """A limit as the form shows it: 100.000000 → "100.00", 0.125000 → "0.125"."""
    if limit is None:
        return ""
    text = format(limit.normalize(), "f")
    whole, _, fraction = text.partition(".")
    return f"{whole}.{fraction.ljust(2, '0')}"


@login_required
@require_GET
def billing_page(request: HttpRequest):
    """The dashboard's billing page: balance, recent ledger entries, a Stripe top-up form and, for
    owners and admins, the monthly spend limit's form."""
    return _render_page(request, _organization(request))


# The amounts the billing page's forms set: field -> (its context name, label, what it is called).
AMOUNT_FORMS = {
    "monthly_limit": ("limit", "Monthly limit", "The monthly spend limit"),
    "balance_alert": ("alert", "Alert", "The low-balance alert"),
    "spend_alert": ("spend_alert", "Alert", "The monthly spend alert"),
}


@login_required
@require_POST
def spend_limit_update(request: HttpRequest):
    """``POST /billing/limit/`` (the billing page's form, CSRF-checked): ``monthly_limit`` in USD,
    or empty (or ``action=remove``) to remove the limit. Owners and admins only (403 otherwise)."""
    return _update_amount(request, "monthly_limit")


@login_required
@require_POST
def spend_alert_update(request: HttpRequest):
    """``POST /billing/spend-alert/``: ``spend_alert`` in USD (owners and admins are emailed when a
    month's spend reaches it), or empty (or ``action=remove``) for none. Owners and admins only."""
    return _update_amount(request, "spend_alert")


@login_required
@require_POST
def balance_alert_update(request: HttpRequest):
    """``POST /billing/alert/``: ``balance_alert`` in USD (owners and admins are emailed when the
    balance falls below it), or empty (or ``action=remove``) for none. Owners and admins only."""
    return _update_amount(request, "balance_alert")


def _update_amount(request: HttpRequest, field: str):
    organization = _organization(request)
    if organization is None:
        return redirect("billing")
    name, label, called = AMOUNT_FORMS[field]
    raw = (request.POST.get(field) or "").strip()
    removing = request.POST.get("action") == "remove" or not raw
    try:
        value = None if removing else serializers.usd_amount(raw, param=field)
    except InvalidParameter:
        return _render_page(request, organization, status=400, **{
            f"{name}_value": raw[:40], f"{name}_error": f"Enter the {label.lower()} in US dollars, such as 100 or 100.50."})
    try:
        services.update_limits(organization=organization, actor=request.user, **{field: value})
    except BillingError as exc:
        return _render_page(request, organization, status=exc.status, **{
            f"{name}_value": raw[:40], f"{name}_error": _form_message(exc, field, label)})
    messages.success(request, f"{called} is removed." if value is None else f"{called} is now {dollars(value)}.")
    return redirect("billing")
