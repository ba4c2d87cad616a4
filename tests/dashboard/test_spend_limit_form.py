"""The spend-limit forms: the billing page's speaks in its own words, not the API's parameter
names; an API key's takes what billing stores (to the micro-dollar) and the keys page shows it whole."""

from __future__ import annotations

from decimal import Decimal

import pytest

from accounts.models import ApiKey
from accounts.services import create_api_key
from billing.errors import InvalidParameter
from billing.models import ApiKeySpendLimit
from billing.selectors import organization_monthly_limit
from billing.services import set_api_key_spend_limit
from dashboard.forms import ApiKeyForm
from tests.dashboard.test_keys_table import _limit


def test_a_limit_finer_than_a_micro_dollar_is_refused_with_the_forms_label(ada, acme):
    _, org = acme
    response = ada.post("/billing/limit/", {"monthly_limit": "1.0000001", "action": "save"})
    html = response.content.decode()
    assert response.status_code == 400
    assert "Monthly limit must have at most 6 decimal places" in html and "monthly_limit must" not in html
    assert organization_monthly_limit(organization=org) is None


# --- an API key's spend limit (the create-key form on /api-keys/) ------------------------------------

def _create(client, name: str, spend_limit: str):
    return client.post("/api-keys/", {"name": name, "scopes": ["inference"], "spend_limit": spend_limit})


@pytest.mark.parametrize("typed,stored,shown", [
    ("0.123456", "0.123456", "of $0.123456"),
    ("1234.5678", "1234.5678", "of $1,234.5678"),
    ("0.000001", "0.000001", "of $0.000001"),
    ("12.50", "12.5", "of $12.50"),
    ("999999999.999999", "999999999.999999", "of $999,999,999.999999"),
])
def test_a_key_limit_to_the_micro_dollar_is_stored_and_shown_whole(ada, acme, typed, stored, shown):
    response = _create(ada, "budget", typed)
    assert response.status_code == 302
    key = ApiKey.objects.get(organization=acme[1], name="budget")
    assert ApiKeySpendLimit.objects.get(api_key=key).amount_limit == Decimal(stored)
    assert _limit(ada.get("/api-keys/").content.decode(), "budget") == shown


@pytest.mark.parametrize("typed,says", [
    ("0.1234567", "up to 6 decimal places"),
    ("999999999999.999999", "at most $999,999,999.999999"),
    ("1000000000", "at most $999,999,999.999999"),
    ("-0.01", "greater than or equal to 0"),
    ("NaN", "Enter a number"),
])
def test_a_key_limit_the_service_would_refuse_is_refused_by_the_form_and_no_key_is_made(ada, acme, typed, says):
    response = _create(ada, "budget", typed)
    assert response.status_code == 400
    assert says in response.content.decode()
    assert not ApiKey.objects.filter(organization=acme[1]).exists()


@pytest.mark.parametrize("typed", [
    "0", "0.000001", "0.1234567", "1E+3", "1E-7", "12.50", "-0.000001", "999999999.999999", "1000000000",
    "999999999999.999999", "1000000000000",
])
def test_the_key_form_accepts_exactly_the_limits_billing_accepts(acme, typed):
    form = ApiKeyForm({"name": "k", "scopes": ["inference"], "spend_limit": typed})
    key, _ = create_api_key(organization=acme[1], name="k", scopes=["inference"])
    try:
        set_api_key_spend_limit(api_key=key, amount_limit=Decimal(typed))
    except InvalidParameter:
        billing_accepts = False
    else:
        billing_accepts = True
    assert form.is_valid() == billing_accepts, form.errors


def test_a_key_limit_too_large_for_sqlite_is_refused_and_the_keys_page_keeps_working(ada, acme):
    """SQLite (the default under ``up``) read 999999999999.999999 back as a float, 1e12, and failed:
    /api-keys/ was a 500 for the whole organization. Refused now, naming the maximum."""
    response = _create(ada, "budget", "999999999999.999999")
    assert response.status_code == 400
    assert "at most $999,999,999.999999" in response.content.decode()
    assert not ApiKey.objects.filter(organization=acme[1]).exists()
    assert ada.get("/api-keys/").status_code == 200


@pytest.mark.parametrize("typed", ["999999999.999999", "999999999999.999999", "1000000000"])
def test_the_billing_pages_form_names_the_maximum(ada, acme, typed):
    _, org = acme
    response = ada.post("/billing/limit/", {"monthly_limit": typed, "action": "save"})
    if typed == "999999999.999999":
        assert response.status_code == 302
        assert organization_monthly_limit(organization=org) == Decimal(typed)
    else:
        assert response.status_code == 400
        assert "Monthly limit must be at most 999,999,999.999999 USD" in response.content.decode()
        assert organization_monthly_limit(organization=org) is None
    assert ada.get("/billing/").status_code == 200
