"""The billing page (billing's view, the dashboard's template) and paying a top-up: the checks that
happen before Stripe is called. The whole payment through localstripe is a browser test."""

from __future__ import annotations

from decimal import Decimal

from billing.models import TopUp


def test_the_billing_page_shows_balance_and_ledger(ada, acme, settings):
    settings.STRIPE_SECRET_KEY = settings.STRIPE_PUBLISHABLE_KEY = ""
    page = ada.get("/billing/").content.decode()
    assert 'data-balance="5.000000"' in page and "Sign-up credit" in page and "+$5.00" in page
    assert "Card payments are not configured" in page


def test_the_top_up_form_loads_stripe_js_from_the_configured_url(ada, settings):
    settings.STRIPE_SECRET_KEY, settings.STRIPE_PUBLISHABLE_KEY = "sk_test_x", "pk_test_x"
    settings.STRIPE_JS_URL = "http://127.0.0.1:9/js.stripe.com/v3/"
    page = ada.get("/billing/").content.decode()
    assert '<script src="http://127.0.0.1:9/js.stripe.com/v3/"></script>' in page
    assert 'data-publishable-key="pk_test_x"' in page and 'id="card-element"' in page


def _pay(client, intent_id, token="tok_visa4242"):
    return client.post(f"/billing/topups/{intent_id}/pay/", {"token": token}, content_type="application/json")


def test_paying_checks_the_token_and_the_top_up_before_calling_stripe(ada, acme, globex, settings):
    settings.STRIPE_SECRET_KEY = ""  # nothing below may reach Stripe
    response = _pay(ada, "pi_unknown", token="not a token")
    assert response.status_code == 402 and response.json()["error"]["param"] == "card"
    response = _pay(ada, "pi_unknown")
    assert response.status_code == 400 and "does not exist" in response.json()["error"]["message"]
    TopUp.objects.create(organization=globex[1], payment_intent_id="pi_theirs", amount=Decimal("10"))
    response = _pay(ada, "pi_theirs")
    assert response.status_code == 400 and "does not exist" in response.json()["error"]["message"]
    TopUp.objects.create(organization=acme[1], payment_intent_id="pi_done", amount=Decimal("10"), status="succeeded")
    response = _pay(ada, "pi_done")
    assert response.status_code == 400 and "already succeeded" in response.json()["error"]["message"]
    assert ada.get("/billing/topups/pi_done/pay/").status_code == 405
    response = ada.post("/billing/topups/pi_done/pay/", "{not json", content_type="application/json")
    assert response.status_code == 400


def _ledger_kinds(page: str) -> list[str]:
    import re

    return re.findall(r'<tr data-kind="([a-z_]+)">', page)


def test_the_credit_history_pages_and_keeps_payments_within_reach(ada, acme, catalog):
    """One usage charge per request would push the top-ups off a fixed-length list."""
    from billing.services import add_adjustment
    from tests.dashboard.conftest import record

    add_adjustment(organization=acme[1], amount=Decimal("3"), description="Goodwill")
    for _ in range(25):
        record(acme[1], catalog[1])

    first = ada.get("/billing/").content.decode()
    assert _ledger_kinds(first) == ["usage"] * 20 and 'id="ledger-older"' in first
    older_id = int(first.split('id="ledger-older" href="?show=all&amp;before=')[1].split('"')[0])
    older = _ledger_kinds(ada.get(f"/billing/?show=all&before={older_id}").content.decode())
    assert older == ["usage"] * 5 + ["adjustment", "signup_credit"]

    payments = ada.get("/billing/?show=payments").content.decode()
    assert _ledger_kinds(payments) == ["adjustment", "signup_credit"] and 'id="ledger-older"' not in payments
    assert _ledger_kinds(ada.get("/billing/?show=usage&before=x").content.decode()) == ["usage"] * 20
    assert _ledger_kinds(ada.get("/billing/?show=nonsense").content.decode())[:1] == ["usage"]


def test_the_monthly_limit_shows_exactly_as_it_is_enforced(ada, acme, settings):
    """The limit refuses requests at $0.125: the page must not say $0.12."""
    from billing.services import set_spend_limit

    settings.STRIPE_SECRET_KEY = settings.STRIPE_PUBLISHABLE_KEY = ""
    set_spend_limit(organization=acme[1], monthly_limit=Decimal("0.125"))
    assert "of a $0.125 monthly limit" in ada.get("/billing/").content.decode()


def test_amounts_rounded_to_cents_round_half_up_as_billing_does():
    from dashboard.templatetags.dashboard import usd

    assert (usd(Decimal("1234.565")), usd(Decimal("0.015")), usd(Decimal("-2.345"))) == ("$1,234.57", "$0.02", "-$2.35")
