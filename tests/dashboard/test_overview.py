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
