"""The billing page's spend-limit form speaks in its own words, not the API's parameter names."""

from __future__ import annotations

from billing.selectors import organization_monthly_limit


def test_a_limit_finer_than_a_micro_dollar_is_refused_with_the_forms_label(ada, acme):
    _, org = acme
    response = ada.post("/billing/limit/", {"monthly_limit": "1.0000001", "action": "save"})
    html = response.content.decode()
    assert response.status_code == 400
    assert "Monthly limit must have at most 6 decimal places" in html and "monthly_limit must" not in html
    assert organization_monthly_limit(organization=org) is None
