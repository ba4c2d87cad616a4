"""Paying a top-up from the billing page: the card tokenized by Stripe.js confirms the PaymentIntent."""

from __future__ import annotations

from django.http import JsonResponse
from django.views.decorators.http import require_POST

from billing import services as billing_services
from billing.errors import BillingError
from inference_platform import jsonbody

from .common import organization_required


def _error(status: int, message: str, *, param=None, code=None, type="invalid_request_error") -> JsonResponse:
    return JsonResponse({"error": {"message": message, "type": type, "param": param, "code": code}}, status=status)


@organization_required
@require_POST
def topup_pay(request, payment_intent_id: str):
    """``POST /billing/topups/<pi>/pay {"token": "tok_..."}`` (session + CSRF) → ``{"status", "client_secret"}``."""
    try:
        body = jsonbody.loads(request.body or b"{}")
    except ValueError:
        return _error(400, "The body must be JSON.", code="invalid_json")
    if not isinstance(body, dict):
        return _error(400, "The body must be a JSON object.", code="invalid_json")
    try:
        payment = billing_services.pay_topup_with_card_token(organization=request.organization,
                                                             payment_intent_id=payment_intent_id,
                                                             card_token=body.get("token"))
    except BillingError as exc:
        return JsonResponse(exc.as_error(), status=exc.status)
    return JsonResponse({"status": payment.status, "client_secret": payment.client_secret})
