"""``POST /v1/billing/topups``: the amount arrives exactly as sent. A JSON string or a JSON integer
is an exact amount; a JSON number with a fraction has been rounded to a binary float by the time it
is parsed (20.000000000000001 is 20.0), so it is refused rather than guessed at."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from billing.models import TopUp
from tests.billing.conftest import make_key, make_organization

pytestmark = pytest.mark.django_db

TOPUPS = "/v1/billing/topups"


@pytest.fixture
def manager(db):
    organization = make_organization("Payer")
    _, plaintext = make_key(organization, scopes=["manage"], name="manager")
    return organization, plaintext


def _post(client, plaintext: str, raw_body: str):
    """The body as these exact bytes: a float literal must reach the server as the client wrote it."""
    return client.generic("POST", TOPUPS, raw_body, content_type="application/json",
                          headers={"Authorization": f"Bearer {plaintext}"})


@pytest.mark.parametrize("literal", ["20.000000000000001", "25.0", "25.50", "1e2", "2.5E1", "-0.0"])
def test_a_json_number_with_a_fraction_is_refused_naming_amount(client, manager, settings, literal):
    settings.STRIPE_SECRET_KEY = ""  # never reached: the amount is refused first
    organization, plaintext = manager
    response = _post(client, plaintext, '{"amount": %s}' % literal)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "amount" and error["type"] == "invalid_request_error"
    assert "as a string" in error["message"]
    assert not TopUp.objects.filter(organization=organization).exists()


@pytest.mark.parametrize("value", ["1e2", "-25.00", "25,00", "$25", "25.", ".5", "0x19", "2 5", "NaN",
                                   "Infinity", "", "   ", None, True, [], {}, ["25.00"]])
def test_anything_but_a_decimal_string_or_integer_is_refused_naming_amount(client, manager, settings, value):
    settings.STRIPE_SECRET_KEY = ""
    organization, plaintext = manager
    response = _post(client, plaintext, json.dumps({"amount": value}))
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "amount" and set(error) == {"message", "type", "param", "code"}
    assert not TopUp.objects.filter(organization=organization).exists()


@pytest.mark.parametrize("value", ["10.001", "4.99", 4, 1001, 10**40, "9" * 15])
def test_exact_amounts_out_of_bounds_or_finer_than_cents_are_refused(client, manager, settings, value):
    settings.STRIPE_SECRET_KEY = ""
    organization, plaintext = manager
    response = _post(client, plaintext, json.dumps({"amount": value}))
    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == "amount"
    assert not TopUp.objects.filter(organization=organization).exists()


def test_a_top_up_above_what_sqlite_holds_exactly_is_refused_whatever_topup_max_says(client, manager, settings):
    settings.STRIPE_SECRET_KEY = ""
    settings.TOPUP_MAX = Decimal("10000000000000")
    organization, plaintext = manager
    response = _post(client, plaintext, json.dumps({"amount": "999999999999.99"}))
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "amount" and "999999999.99 USD" in error["message"]
    assert not TopUp.objects.filter(organization=organization).exists()


@pytest.mark.parametrize("raw, amount", [
    ('"25.00"', Decimal("25.00")),
    ('"25.5"', Decimal("25.50")),
    ('" 25 "', Decimal("25.00")),
    ('"1000.00"', Decimal("1000.00")),
    ("25", Decimal("25.00")),
    ("5", Decimal("5.00")),
])
def test_a_decimal_string_or_a_json_integer_creates_the_top_up(client, manager, stripe_settings, raw, amount):
    organization, plaintext = manager
    response = _post(client, plaintext, '{"amount": %s}' % raw)
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["amount"] == str(amount) and body["id"].startswith("pi_")
    topup = TopUp.objects.get(payment_intent_id=body["id"])
    assert topup.organization == organization and topup.amount == amount and topup.status == "pending"
