"""Stripe top-ups end to end: PaymentIntents on localstripe, its signed webhooks delivered to the
platform served by uvicorn, refunds, declines, and webhook signature checks."""

from __future__ import annotations

import json
import time
import uuid
from decimal import Decimal

import httpx
import pytest
import stripe

from billing import selectors, services
from billing.errors import InvalidParameter
from billing.models import BillingAccount, LedgerEntry, StripeEvent, TopUp
from billing.stripe_api import stripe_client
from tests.billing.conftest import WEBHOOK_SECRET, make_organization
from tests.support import wait_until

SIGNUP = Decimal("5.000000")
WEBHOOK_PATH = "/billing/stripe/webhook"


def signed(payload: str, *, secret: str = WEBHOOK_SECRET, timestamp: int | None = None) -> dict:
    header = stripe.WebhookSignature.generate_signature_header(payload, secret, timestamp=timestamp)
    return {"Stripe-Signature": header, "Content-Type": "application/json"}


def pay(intent_id: str, card_number: str) -> None:
    """Confirm a PaymentIntent with a card PaymentMethod created through the API."""
    client = stripe_client()
    intent = client.v1.payment_intents.retrieve(intent_id)
    method = client.v1.payment_methods.create(params={
        "type": "card", "card": {"number": card_number, "exp_month": 12, "exp_year": 2034, "cvc": "123"},
    })
    client.v1.payment_methods.attach(method.id, params={"customer": intent.customer})
    client.v1.payment_intents.update(intent_id, params={"payment_method": method.id})
    client.v1.payment_intents.confirm(intent_id)


def balance_of(organization) -> Decimal:
    return selectors.balance(organization=organization)


def event_payload(event_type: str, obj: dict, *, event_id: str | None = None) -> str:
    return json.dumps({"id": event_id or f"evt_{uuid.uuid4().hex[:14]}", "object": "event", "type": event_type,
                       "created": int(time.time()), "livemode": False, "data": {"object": obj}})


# --- end to end through localstripe and uvicorn ------------------------------------------------------

e2e = pytest.mark.django_db(transaction=True)


@e2e
def test_topup_with_a_test_card_is_credited_once(asgi_server, stripe_settings, localstripe):
    organization = make_organization("Payer")
    intent = services.create_topup(organization=organization, amount=Decimal("20.00"))
    assert intent.id.startswith("pi_") and intent.client_secret.startswith(f"{intent.id}_secret_")
    assert BillingAccount.objects.get(organization=organization).stripe_customer_id.startswith("cus_")
    assert balance_of(organization) == SIGNUP  # nothing until Stripe says it succeeded

    pay(intent.id, "4242424242424242")
    wait_until(lambda: LedgerEntry.objects.filter(kind="topup", reference=intent.id).exists(), timeout=30,
               message="localstripe's payment_intent.succeeded webhook")
    assert balance_of(organization) == SIGNUP + Decimal("20")
    assert TopUp.objects.get(payment_intent_id=intent.id).status == "succeeded"

    # Replays: the very same event (Stripe retries), then another event for the same PaymentIntent.
    original = stripe_client().v1.events.list(params={"type": "payment_intent.succeeded"})
    event = next(e for e in original.data if e.data.object["id"] == intent.id).to_dict()
    body = json.dumps(event)
    response = httpx.post(asgi_server + WEBHOOK_PATH, content=body, headers=signed(body))
    assert response.status_code == 200 and response.json()["duplicate"] is True
    again = event_payload("payment_intent.succeeded", event["data"]["object"])
    response = httpx.post(asgi_server + WEBHOOK_PATH, content=again, headers=signed(again))
    assert response.status_code == 200 and response.json()["duplicate"] is False
    assert LedgerEntry.objects.filter(kind="topup").count() == 1
    assert balance_of(organization) == SIGNUP + Decimal("20")

    # A second top-up reuses the organization's Stripe customer.
    second = services.create_topup(organization=organization, amount=Decimal("5.00"))
    assert BillingAccount.objects.filter(organization=organization).count() == 1
    assert stripe_client().v1.payment_intents.retrieve(second.id).customer == \
        BillingAccount.objects.get(organization=organization).stripe_customer_id


@e2e
def test_refunds_are_reversed_once_each(asgi_server, stripe_settings):
    organization = make_organization("Refunded")
    intent = services.create_topup(organization=organization, amount=Decimal("30.00"))
    pay(intent.id, "4242424242424242")
    wait_until(lambda: LedgerEntry.objects.filter(kind="topup", reference=intent.id).exists(), timeout=30,
               message="the top-up to be credited")
    client = stripe_client()
    refund = client.v1.refunds.create(params={"payment_intent": intent.id, "amount": 1250})

    # localstripe records refunds but sends no charge.refunded event: send Stripe's event for the
    # real charge object it holds, signed as Stripe signs.
    def charge_refunded() -> str:
        charge = client.v1.charges.retrieve(refund.charge).to_dict()
        return event_payload("charge.refunded", charge)

    first = charge_refunded()
    assert httpx.post(asgi_server + WEBHOOK_PATH, content=first, headers=signed(first)).status_code == 200
    assert balance_of(organization) == SIGNUP + Decimal("30") - Decimal("12.50")
    entry = LedgerEntry.objects.get(kind="refund")
    assert entry.reference == refund.id and entry.amount == Decimal("-12.5")
    # The same event replayed: nothing more.
    assert httpx.post(asgi_server + WEBHOOK_PATH, content=first, headers=signed(first)).json()["duplicate"] is True

    # A second partial refund: its own event lists both refunds; only the new one moves money.
    client.v1.refunds.create(params={"payment_intent": intent.id, "amount": 250})
    second = charge_refunded()
    assert httpx.post(asgi_server + WEBHOOK_PATH, content=second, headers=signed(second)).status_code == 200
    assert LedgerEntry.objects.filter(kind="refund").count() == 2
    assert balance_of(organization) == SIGNUP + Decimal("30") - Decimal("15")

    # An update that arrives out of order says "failed" of a refund Stripe has as succeeded: the
    # platform asks Stripe for the refund as it is now, and credits nothing back.
    stale = event_payload("charge.refund.updated", {**refund.to_dict(), "status": "failed"})
    assert httpx.post(asgi_server + WEBHOOK_PATH, content=stale, headers=signed(stale)).status_code == 200
    assert balance_of(organization) == SIGNUP + Decimal("30") - Decimal("15")


@e2e
def test_declined_cards_credit_nothing(asgi_server, stripe_settings):
    """Declines as localstripe and the webhook see them (paid through Stripe's API directly); the
    platform's own pay endpoint with a declined card is tested below."""
    organization = make_organization("Declined")
    # 4000 0000 0000 0002: the card is declined.
    intent = services.create_topup(organization=organization, amount=Decimal("10.00"))
    with pytest.raises(stripe.CardError) as caught:
        pay(intent.id, "4000000000000002")
    assert caught.value.code == "card_declined"
    # 4000 0000 0000 0341: attaches, then the charge is declined; Stripe sends payment_failed.
    failing = services.create_topup(organization=organization, amount=Decimal("10.00"))
    with pytest.raises(stripe.CardError):
        pay(failing.id, "4000000000000341")
    wait_until(lambda: TopUp.objects.get(payment_intent_id=failing.id).status == "failed", timeout=30,
               message="localstripe's payment_intent.payment_failed webhook")
    assert StripeEvent.objects.filter(type="payment_intent.payment_failed").exists()
    assert not LedgerEntry.objects.filter(kind="topup").exists()
    assert balance_of(organization) == SIGNUP
    assert TopUp.objects.get(payment_intent_id=intent.id).status == "pending"


# --- paying through the platform's own code: the API creates the top-up, the dashboard's pay endpoint
# confirms it with a card token (what Stripe.js sends from the billing page) -----------------------------


def card_token(number: str) -> str:
    """A card token from localstripe, as ``stripe.createToken(cardElement)`` gets in the browser."""
    token = stripe_client().v1.tokens.create(params={"card": {
        "number": number, "exp_month": 12, "exp_year": 2034, "cvc": "123"}})
    return token.id


@pytest.fixture
def owner_client(client):
    """The dashboard session of a new organization's owner (Django's test client: CSRF off)."""
    organization = make_organization("Card payer")
    client.force_login(organization.memberships.get().user)
    return client, organization


def start_topup(client, amount: str = "10.00") -> str:
    response = client.post("/v1/billing/topups", {"amount": amount}, content_type="application/json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def pay_through_the_platform(client, intent_id: str, number: str):
    return client.post(f"/billing/topups/{intent_id}/pay/", {"token": card_token(number)},
                       content_type="application/json")


@e2e
def test_a_declined_card_paid_through_the_platform_is_402_and_credits_nothing(asgi_server, stripe_settings,
                                                                               owner_client):
    client, organization = owner_client
    # 4000 0000 0000 0002: the bank refuses the card as soon as it is saved on the customer.
    intent_id = start_topup(client)
    response = pay_through_the_platform(client, intent_id, "4000000000000002")
    assert response.status_code == 402, response.content
    error = response.json()["error"]
    assert error["code"] == "card_declined" and error["param"] == "card" and "declined" in error["message"]
    assert TopUp.objects.get(payment_intent_id=intent_id).status == "pending"  # another card may still pay it

    # 4000 0000 0000 0341: saved, then the charge is declined at confirmation; Stripe's
    # payment_intent.payment_failed webhook marks the top-up failed.
    failing_id = start_topup(client)
    response = pay_through_the_platform(client, failing_id, "4000000000000341")
    assert response.status_code == 402 and response.json()["error"]["code"] == "card_declined"
    wait_until(lambda: TopUp.objects.get(payment_intent_id=failing_id).status == "failed", timeout=30,
               message="localstripe's payment_intent.payment_failed webhook")

    assert not LedgerEntry.objects.filter(organization=organization, kind="topup").exists()
    assert balance_of(organization) == SIGNUP
    assert not TopUp.objects.filter(organization=organization, status="succeeded").exists()


@e2e
def test_a_good_card_paid_through_the_platform_is_credited_once_by_the_signed_webhook(
        asgi_server, stripe_settings, owner_client):
    client, organization = owner_client
    intent_id = start_topup(client, "12.34")
    assert balance_of(organization) == SIGNUP
    response = pay_through_the_platform(client, intent_id, "4242424242424242")
    assert response.status_code == 200, response.content
    assert response.json()["status"] == "succeeded"
    # The pay endpoint credits nothing itself: localstripe's signed webhook, delivered to the
    # platform under uvicorn, does.
    wait_until(lambda: TopUp.objects.get(payment_intent_id=intent_id).status == "succeeded", timeout=30,
               message="localstripe's payment_intent.succeeded webhook")
    assert StripeEvent.objects.filter(type="payment_intent.succeeded").count() == 1
    entries = LedgerEntry.objects.filter(organization=organization, kind="topup")
    assert [(e.reference, e.amount) for e in entries] == [(intent_id, Decimal("12.34"))]
    assert balance_of(organization) == SIGNUP + Decimal("12.34")
    # Paying the same top-up again is refused before Stripe is asked.
    response = pay_through_the_platform(client, intent_id, "4242424242424242")
    assert response.status_code == 400 and "already succeeded" in response.json()["error"]["message"]
    assert balance_of(organization) == SIGNUP + Decimal("12.34")


# --- webhook checks (Django's test client is enough: nothing leaves the process) ----------------------


@pytest.fixture
def pending_topup(db, settings):
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    organization = make_organization("Pending")
    topup = TopUp.objects.create(organization=organization, payment_intent_id="pi_pendingtopup01",
                                 amount=Decimal("50.00"))
    succeeded = {"id": topup.payment_intent_id, "object": "payment_intent", "amount": 5000,
                 "amount_received": 5000, "currency": "usd", "status": "succeeded"}
    return organization, event_payload("payment_intent.succeeded", succeeded)


def _post(client, body, headers):
    return client.generic("POST", WEBHOOK_PATH, body, content_type="application/json",
                          headers={k: v for k, v in headers.items() if k != "Content-Type"})


@pytest.mark.parametrize("headers", [
    pytest.param(lambda body: signed(body, secret="whsec_wrong"), id="wrong-secret"),
    pytest.param(lambda body: signed(body, timestamp=int(time.time()) - 301), id="stale"),
    pytest.param(lambda body: signed(body, timestamp=int(time.time()) + 3600), id="from-the-future"),
    pytest.param(lambda body: signed(body + " "), id="other-body"),
    pytest.param(lambda body: {}, id="missing"),
    pytest.param(lambda body: {"Stripe-Signature": "t=abc,v1=zz"}, id="malformed"),
])
def test_a_bad_or_stale_signature_is_400_and_credits_nothing(client, pending_topup, headers):
    organization, body = pending_topup
    response = _post(client, body, headers(body))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_webhook" and error["param"] == "Stripe-Signature"
    assert balance_of(organization) == SIGNUP
    assert not StripeEvent.objects.exists()


def test_a_good_signature_credits_and_a_replay_does_not(client, pending_topup):
    organization, body = pending_topup
    assert _post(client, body, signed(body)).json() == {"received": True, "duplicate": False}
    assert _post(client, body, signed(body)).json() == {"received": True, "duplicate": True}
    assert balance_of(organization) == SIGNUP + Decimal("50")


@pytest.mark.parametrize("body", ["garbage", "\xff\xfe not json", "[]", '{"id": "evt_1"}',
                                  '{"id": "evt_1", "type": "x", "data": {"object": "no"}}'])
def test_a_garbage_body_is_400(client, pending_topup, body):
    response = _post(client, body.encode("latin-1"), signed(body))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_webhook"
    assert not StripeEvent.objects.exists()


def test_only_post(client):
    assert client.get(WEBHOOK_PATH).status_code == 405


def test_a_refund_pending_at_charge_refunded_is_debited_when_it_succeeds_and_credited_back_if_it_fails(
        client, pending_topup):
    """Stripe reports a pending refund in charge.refunded and its later states in refund updates."""
    organization, succeeded = pending_topup
    _post(client, succeeded, signed(succeeded))
    refund = {"id": "re_pendingrefund1", "object": "refund", "amount": 1000, "payment_intent": "pi_pendingtopup01",
              "charge": "ch_pendingtopup01"}
    charge = {"id": "ch_pendingtopup01", "object": "charge", "payment_intent": "pi_pendingtopup01",
              "refunds": {"object": "list", "has_more": False, "data": [{**refund, "status": "pending"}]}}

    def deliver(event_type: str, obj: dict) -> None:
        body = event_payload(event_type, obj)
        assert _post(client, body, signed(body)).status_code == 200

    deliver("charge.refunded", charge)
    assert balance_of(organization) == SIGNUP + Decimal("50")  # pending: nothing yet
    deliver("charge.refund.updated", {**refund, "status": "succeeded"})
    deliver("refund.updated", {**refund, "status": "succeeded"})  # the same change, as the other event type
    assert balance_of(organization) == SIGNUP + Decimal("40")
    deliver("charge.refund.updated", {**refund, "status": "failed"})
    deliver("charge.refund.updated", {**refund, "status": "failed"})
    assert balance_of(organization) == SIGNUP + Decimal("50")
    restored = LedgerEntry.objects.get(kind="adjustment", organization=organization)
    assert restored.amount == Decimal("10") and "re_pendingrefund1" in restored.reference


def test_a_payment_for_another_platform_is_ignored(client, pending_topup):
    organization, _ = pending_topup
    body = event_payload("payment_intent.succeeded", {"id": "pi_notours", "object": "payment_intent",
                                                      "amount": 100000, "currency": "usd"})
    assert _post(client, body, signed(body)).status_code == 200
    assert not LedgerEntry.objects.filter(kind="topup").exists()


# --- top-up bounds -----------------------------------------------------------------------------------


@pytest.mark.parametrize("amount", [Decimal("4.99"), Decimal("1000.01"), Decimal("10.001"), 10.0, "ten", Decimal("NaN")])
def test_topup_amounts_out_of_bounds_are_refused_before_stripe(db, settings, amount):
    settings.STRIPE_SECRET_KEY = ""  # never reached: the amount is checked first
    organization = make_organization("Bounds")
    with pytest.raises(InvalidParameter) as caught:
        services.create_topup(organization=organization, amount=amount)
    assert caught.value.param == "amount"
    assert not TopUp.objects.exists()


def test_topups_without_stripe_configured_are_503(db, settings):
    from billing.errors import PaymentsNotConfigured

    settings.STRIPE_SECRET_KEY = ""
    with pytest.raises(PaymentsNotConfigured):
        services.create_topup(organization=make_organization("NoStripe"), amount=Decimal("10"))


def test_a_topup_without_stripe_configured_is_a_503_logged_as_a_warning(db, client, settings, caplog):
    """The platform as its operator set it up, not a failure: no ERROR for alerting to page on."""
    settings.STRIPE_SECRET_KEY = ""
    client.force_login(make_organization("NoStripeApi").memberships.get().user)
    with caplog.at_level("WARNING"):
        response = client.post("/v1/billing/topups", {"amount": "10.00"}, content_type="application/json")
    assert response.status_code == 503 and response.json()["error"]["code"] == "payments_not_configured"
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert any(r.levelname == "WARNING" and "payments_not_configured" in r.getMessage() for r in caplog.records)
