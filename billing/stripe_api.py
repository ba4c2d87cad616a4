"""The Stripe client and webhook verification: the only module that talks to Stripe's library.

``STRIPE_API_BASE`` (unset: Stripe itself) lets the tests and a development setup point the client
at localstripe. Webhooks are verified with Stripe's own ``Webhook.construct_event`` (HMAC-SHA256
over ``"{timestamp}.{payload}"`` with the endpoint secret, timestamp within 300 seconds; the
library checks only the past side, so a timestamp more than that ahead is refused here).
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any

import stripe
from django.conf import settings

from .errors import BillingError, PaymentsNotConfigured

WEBHOOK_TOLERANCE_SECONDS = 300


class InvalidWebhook(BillingError):
    """A webhook request that is not a genuine, fresh Stripe event: answered 400, nothing done."""

    code = "invalid_webhook"


@lru_cache(maxsize=4)
def _client(secret_key: str, api_base: str | None) -> stripe.StripeClient:
    base_addresses = {"api": api_base.rstrip("/")} if api_base else None
    return stripe.StripeClient(secret_key, base_addresses=base_addresses, max_network_retries=2)


def card_topups_enabled() -> bool:
    """Whether users can top up by card: the billing page's form needs both keys."""
    return bool(settings.STRIPE_SECRET_KEY and settings.STRIPE_PUBLISHABLE_KEY)


def stripe_client() -> stripe.StripeClient:
    """A client for the configured account; raises PaymentsNotConfigured without a secret key."""
    if not settings.STRIPE_SECRET_KEY:
        raise PaymentsNotConfigured()
    return _client(settings.STRIPE_SECRET_KEY, settings.STRIPE_API_BASE)


def construct_webhook_event(*, payload: bytes, signature: str | None) -> dict[str, Any]:
    """The verified event as a plain dict. Raises InvalidWebhook for a missing, wrong or stale
    signature, a body that is not JSON, or JSON that is not an event."""
    secret = settings.STRIPE_WEBHOOK_SECRET
    if not secret:
        raise InvalidWebhook("Webhooks are not configured on this platform (STRIPE_WEBHOOK_SECRET is unset).")
    try:
        event = stripe.Webhook.construct_event(payload, signature, secret, tolerance=WEBHOOK_TOLERANCE_SECONDS)
    except stripe.SignatureVerificationError as exc:
        raise InvalidWebhook(f"Invalid Stripe-Signature: {exc.user_message or exc}", param="Stripe-Signature") from None
    except Exception:  # undecodable bytes, not JSON, JSON that is no event
        raise InvalidWebhook("The body is not a Stripe event.", param="body") from None
    if _signed_at(signature) > time.time() + WEBHOOK_TOLERANCE_SECONDS:
        raise InvalidWebhook("Invalid Stripe-Signature: its timestamp is in the future.", param="Stripe-Signature")
    event = event.to_dict()
    data = event.get("data")
    if (not isinstance(event.get("id"), str) or not event["id"] or not isinstance(event.get("type"), str)
            or not isinstance(data, dict) or not isinstance(data.get("object"), dict)):
        raise InvalidWebhook("The body is not a Stripe event (id, type and data.object are required).", param="body")
    return event


def _signed_at(signature: str) -> int:
    """The ``t=`` of a Stripe-Signature header that verified (so it has one, and it is a number)."""
    return max(int(item[2:]) for item in signature.split(",") if item.startswith("t="))
