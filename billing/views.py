"""Billing's plain Django views: Stripe's webhook endpoint and the dashboard's billing page."""

from __future__ import annotations

import logging

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from accounts.middleware import SESSION_ORGANIZATION_KEY
from accounts.selectors import current_organization_for_user

from . import selectors, services
from .models import LedgerEntry
from .stripe_api import InvalidWebhook, construct_webhook_event

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


@login_required
@require_GET
def billing_page(request: HttpRequest):
    """The dashboard's billing page: balance, recent ledger entries, a Stripe top-up form."""
    organization = current_organization_for_user(
        user=request.user, organization_id=request.session.get(SESSION_ORGANIZATION_KEY)
    )
    context = {"organization": organization}
    if organization is not None:
        show = request.GET.get("show") if request.GET.get("show") in LEDGER_VIEWS else "all"
        before = _entry_id(request.GET.get("before"))
        entries, more = selectors.ledger_page(organization=organization, limit=LEDGER_PAGE_SIZE, after=before,
                                              kinds=LEDGER_VIEWS[show])
        context.update(
            ledger_show=show,
            ledger_views=list(LEDGER_VIEWS),
            ledger_older=entries[-1].pk if more else None,
            ledger_paged=before is not None,
            balance=selectors.balance(organization=organization),
            monthly_spend=selectors.monthly_spend(organization=organization),
            monthly_limit=selectors.organization_monthly_limit(organization=organization),
            entries=entries,
            stripe_enabled=bool(settings.STRIPE_SECRET_KEY and settings.STRIPE_PUBLISHABLE_KEY),
            stripe_publishable_key=settings.STRIPE_PUBLISHABLE_KEY,
            stripe_js_url=settings.STRIPE_JS_URL,
            topup_min=settings.TOPUP_MIN,
            topup_max=settings.TOPUP_MAX,
        )
    return render(request, "billing/overview.html", context)
