"""ApiKeyAuthentication and require_scope through real DRF views and Django's test client."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from accounts.models import ApiKey
from accounts.permissions import require_scope
from accounts.services import create_api_key, create_organization, create_user, revoke_api_key

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.accounts.urls")]


@pytest.fixture
def owner():
    return create_user(email="ada@example.com", password="a-long-pass-phrase-42")


@pytest.fixture
def org(owner):
    return create_organization(name="Acme", owner=owner)


def bearer(raw):
    return {"HTTP_AUTHORIZATION": f"Bearer {raw}"}


def test_a_valid_key_authenticates_as_its_creator_and_records_use(client, org, owner):
    api_key, raw = create_api_key(organization=org, name="k", scopes=["inference"], created_by=owner)
    response = client.get("/whoami", **bearer(raw))
    assert response.status_code == 200, response.content
    assert response.json() == {"user": "ada@example.com", "authenticated": True, "key_id": api_key.pk,
                               "organization": "acme"}
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at is not None


def test_a_key_without_a_creator_is_its_own_principal(client, org):
    _, raw = create_api_key(organization=org, name="k", scopes=["inference"])
    body = client.get("/whoami", **bearer(raw)).json()
    assert body["authenticated"] is True and body["user"].startswith("api-key sk-")


def test_a_deleted_users_keys_are_revoked(client, org, owner):
    _, raw = create_api_key(organization=org, name="k", scopes=["inference"], created_by=owner)
    assert client.get("/whoami", **bearer(raw)).status_code == 200  # cached by the read cache
    owner.delete()
    response = client.get("/whoami", **bearer(raw))
    assert response.status_code == 401 and "revoked" in response.json()["detail"]


def test_a_deactivated_users_keys_fail_until_they_are_reactivated(client, org, owner):
    _, raw = create_api_key(organization=org, name="k", scopes=["inference"], created_by=owner)
    assert client.get("/whoami", **bearer(raw)).status_code == 200
    owner.is_active = False
    owner.save(update_fields=["is_active"])
    response = client.get("/whoami", **bearer(raw))
    assert response.status_code == 401 and response.headers["WWW-Authenticate"].startswith("Bearer")
    assert "deactivated" in response.json()["detail"]
    owner.is_active = True
    owner.save(update_fields=["is_active"])
    assert client.get("/whoami", **bearer(raw)).status_code == 200


@pytest.mark.parametrize("case", ["wrong", "malformed", "revoked", "expired", "not-bearer"])
def test_bad_keys_get_401_invalid_api_key(client, org, case):
    api_key, raw = create_api_key(organization=org, name="k", scopes=["inference"])
    header = {
        "wrong": f"Bearer {raw[:-2]}xx" if not raw.endswith("xx") else f"Bearer {raw[:-2]}yy",
        "malformed": "Bearer sk-nope",
        "revoked": f"Bearer {raw}",
        "expired": f"Bearer {raw}",
        "not-bearer": f"Token {raw}",
    }[case]
    if case == "revoked":
        revoke_api_key(api_key=api_key)
    if case == "expired":
        api_key.expires_at = timezone.now() - timedelta(seconds=1)
        api_key.save(update_fields=["expires_at"])
    response = client.get("/whoami", HTTP_AUTHORIZATION=header)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    detail = response.json()["detail"]
    assert detail
    if case in ("revoked", "expired"):
        assert case in detail


def test_no_credentials_is_401(client):
    assert client.get("/whoami").status_code == 401


def test_a_key_without_the_scope_gets_403_missing_scope(client, org):
    _, raw = create_api_key(organization=org, name="k", scopes=["inference", "read_usage"])
    assert client.get("/whoami", **bearer(raw)).status_code == 200
    response = client.get("/manage", **bearer(raw))
    assert response.status_code == 403
    assert "missing the 'manage' scope" in response.json()["detail"]
    _, manager = create_api_key(organization=org, name="m", scopes=["manage"])
    assert client.get("/manage", **bearer(manager)).status_code == 200
    assert client.get("/whoami", **bearer(manager)).status_code == 403


def test_a_dashboard_session_user_passes_scope_checks(client, owner):
    client.force_login(owner)
    assert client.get("/manage").status_code == 200
    assert client.get("/whoami").json()["user"] == "ada@example.com"


def test_require_scope_refuses_unknown_scopes_and_reuses_classes():
    with pytest.raises(ValueError):
        require_scope("everything")
    assert require_scope("inference") is require_scope("inference")
