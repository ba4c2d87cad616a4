"""API keys: the secret shown once, the list with use and spend, revocation, isolation."""

from __future__ import annotations

from decimal import Decimal

import pytest

from accounts.errors import RevokedApiKey
from accounts.models import ApiKey
from accounts.selectors import authenticate_api_key
from accounts.services import create_api_key
from billing.models import ApiKeySpendLimit
from tests.dashboard.conftest import record


def test_a_new_key_is_shown_once_and_works(ada, acme):
    _, org = acme
    response = ada.post("/api-keys/", {"name": "backend", "scopes": ["inference", "read_usage"],
                                       "expires_in_days": "30", "spend_limit": "12.50"})
    assert response.status_code == 302
    page = ada.get("/api-keys/").content.decode()
    key = ApiKey.objects.get(organization=org)
    secret = page.split('id="new-key-secret">')[1].split("<")[0]
    assert secret.startswith(f"sk-{key.prefix}_")
    assert authenticate_api_key(secret) == key
    assert key.scopes == ["inference", "read_usage"] and key.expires_at is not None
    assert ApiKeySpendLimit.objects.get(api_key=key).amount_limit == Decimal("12.50")
    again = ada.get("/api-keys/").content.decode()
    assert secret not in again and key.display_prefix in again
    from django.contrib.sessions.models import Session

    assert all(secret not in str(s.get_decoded()) for s in Session.objects.all())  # stored nowhere


def test_a_new_key_is_shown_only_on_its_organizations_page(ada, acme):
    from accounts.services import create_organization

    user, _ = acme
    other = create_organization(name="Second", owner=user)
    ada.post("/api-keys/", {"name": "backend", "scopes": ["inference"]})
    ada.post("/organizations/switch/", {"organization": other.pk})
    page = ada.get("/api-keys/")
    assert page.context["new_key"] is None and "new-key-secret" not in page.content.decode()


def test_a_key_needs_a_name_and_a_scope(ada, acme):
    response = ada.post("/api-keys/", {"name": "", "scopes": []})
    assert response.status_code == 400
    assert set(response.context["form"].errors) == {"name", "scopes"}
    assert not ApiKey.objects.exists()


def test_the_list_shows_spend_and_tokens_from_usage(ada, acme, catalog):
    _, org = acme
    _, public = catalog
    key, _ = create_api_key(organization=org, name="metered", scopes=["inference"])
    record(org, public, api_key=key, prompt_tokens=1_000_000, completion_tokens=0)
    record(org, public, api_key=key, prompt_tokens=10, completion_tokens=5)
    row = ada.get("/api-keys/").content.decode().split('data-key="metered"')[1].split("</tr>")[0]
    assert "$0.05" in row  # a million input tokens at $0.05 per million
    assert "in 2 requests" in row and "1,000,015 tokens" in row


def test_revoke_makes_the_key_fail(ada, acme):
    _, org = acme
    key, secret = create_api_key(organization=org, name="old", scopes=["inference"])
    response = ada.post(f"/api-keys/{key.pk}/revoke/")
    assert response.status_code == 302
    with pytest.raises(RevokedApiKey):
        authenticate_api_key(secret)
    assert "Revoked" in ada.get("/api-keys/").content.decode()


def test_keys_of_another_organization_are_invisible_and_untouchable(ada, globex):
    _, globex_org = globex
    key, secret = create_api_key(organization=globex_org, name="globex-prod", scopes=["inference"])
    assert "globex-prod" not in ada.get("/api-keys/").content.decode()
    assert ada.post(f"/api-keys/{key.pk}/revoke/").status_code == 404
    assert authenticate_api_key(secret) == key


def test_the_list_shows_when_a_key_was_last_used_and_when_it_expires(ada, acme):
    from datetime import datetime, timedelta, timezone

    _, org = acme
    used, _ = create_api_key(organization=org, name="used", scopes=["inference"],
                             expires_at=datetime(2031, 5, 17, tzinfo=timezone.utc))
    create_api_key(organization=org, name="idle", scopes=["inference"])
    ApiKey.objects.filter(pk=used.pk).update(last_used_at=datetime.now(timezone.utc) - timedelta(hours=3))
    page = ada.get("/api-keys/").content.decode()
    used_row = page.split('data-key="used"')[1].split("</tr>")[0]
    idle_row = page.split('data-key="idle"')[1].split("</tr>")[0]
    assert "3\xa0hours ago" in used_row and "expires May 17, 2031" in used_row
    assert "Never" in idle_row and "never expires" in idle_row


def test_a_key_whose_limit_is_refused_is_not_made_at_all(acme):
    """The key and its limit are one write: no key is left without the limit it was asked with."""
    from accounts.errors import InvalidInput
    from dashboard import services

    user, organization = acme
    with pytest.raises(InvalidInput) as refused:
        services.create_api_key(organization=organization, created_by=user, name="capped", scopes=["inference"],
                                spend_limit=Decimal("-1"))
    assert refused.value.field == "spend_limit"
    assert not ApiKey.objects.filter(organization=organization, name="capped").exists()
    api_key, _ = services.create_api_key(organization=organization, created_by=user, name="capped",
                                         scopes=["inference"], spend_limit=Decimal("2.5"))
    assert api_key.spend_limit.amount_limit == Decimal("2.5")
