"""The overview's money figures: exact, as the billing page shows them, never rounded to cents."""

from __future__ import annotations

import re
from decimal import Decimal

from billing.selectors import balance
from billing.services import add_adjustment


def _shown(page: str, element_id: str) -> str:
    return re.search(rf'id="{element_id}"[^>]*>([^<]*)<', page).group(1)


def test_the_overview_shows_the_exact_balance_the_billing_page_shows(ada, acme):
    _, org = acme
    add_adjustment(organization=org, amount=Decimal("-0.000078"), description="A fraction of a cent")
    assert balance(organization=org) == Decimal("4.999922")  # rounds up to $5.00 at cents
    overview = ada.get("/").content.decode()
    billing = ada.get("/billing/").content.decode()
    assert _shown(overview, "overview-balance") == _shown(billing, "billing-balance") == "$4.999922"
    assert _shown(overview, "overview-monthly-spend") == _shown(billing, "monthly-spend")


def test_every_page_says_when_new_requests_are_refused_and_why(ada, acme):
    """The API and the playground refuse requests at a zero balance or a reached spend limit:
    the dashboard says so wherever the user is, not only on the billing card."""
    from billing.services import set_spend_limit

    _, org = acme
    for path in ("/", "/playground/", "/usage/"):
        assert 'id="quota-refusal"' not in ada.get(path).content.decode()
    add_adjustment(organization=org, amount=Decimal("-5.00"), description="Used up")
    for path in ("/", "/playground/", "/usage/"):
        page = ada.get(path).content.decode()
        assert 'id="quota-refusal"' in page and "credit balance is 0" in page and 'href="/billing/"' in page
    add_adjustment(organization=org, amount=Decimal("10.00"), description="Topped up")
    set_spend_limit(organization=org, monthly_limit=Decimal("0.01"))
    assert 'id="quota-refusal"' not in ada.get("/").content.decode()
    set_spend_limit(organization=org, monthly_limit=Decimal("0"))
    page = ada.get("/billing/").content.decode()
    assert 'id="quota-refusal"' in page and "monthly spend limit" in page
