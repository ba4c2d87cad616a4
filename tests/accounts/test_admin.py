"""The operator's admin pages for users, organizations and keys render, and keys can be revoked there."""

from __future__ import annotations

import pytest

from accounts.models import ApiKey, User
from accounts.selectors import authenticate_api_key
from accounts.errors import RevokedApiKey
from accounts.services import create_api_key, create_organization

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(client):
    admin = User.objects.create_superuser(email="root@example.com", password="a-long-pass-phrase-42")
    client.force_login(admin)
    return admin


def test_admin_pages_render_and_never_show_the_hash(client, operator):
    org = create_organization(name="Acme", owner=operator)
    api_key, _ = create_api_key(organization=org, name="ci", scopes=["inference"], created_by=operator)
    for url in ["/admin/accounts/user/", f"/admin/accounts/user/{operator.pk}/change/", "/admin/accounts/user/add/",
                "/admin/accounts/organization/", f"/admin/accounts/organization/{org.pk}/change/",
                "/admin/accounts/membership/", "/admin/accounts/apikey/", f"/admin/accounts/apikey/{api_key.pk}/change/"]:
        response = client.get(url)
        assert response.status_code == 200, url
        assert api_key.secret_hash not in response.content.decode()
    assert client.get("/admin/accounts/apikey/add/").status_code == 403


def test_the_admin_creates_users_by_email(client, operator):
    response = client.post("/admin/accounts/user/add/", {
        "email": "New@Example.com", "usable_password": "true",
        "password1": "another-long-phrase-77", "password2": "another-long-phrase-77",
    })
    assert response.status_code == 302, response.content.decode()[:2000]
    assert User.objects.get(email="new@example.com").check_password("another-long-phrase-77")


def test_the_admin_revokes_keys(client, operator):
    org = create_organization(name="Acme", owner=operator)
    api_key, raw = create_api_key(organization=org, name="ci", scopes=["inference"])
    response = client.post("/admin/accounts/apikey/", {"action": "revoke_keys", "_selected_action": [api_key.pk]})
    assert response.status_code == 302
    assert ApiKey.objects.get(pk=api_key.pk).revoked_at is not None
    with pytest.raises(RevokedApiKey):
        authenticate_api_key(raw)


@pytest.fixture
def member_key(operator):
    """A member of the operator's organization and a manage key they made."""
    from accounts.services import add_member, create_user

    org = create_organization(name="Acme", owner=operator)
    member = create_user(email="bob@example.com", password=None)
    add_member(organization=org, user=member)
    _, raw = create_api_key(organization=org, name="bob's", scopes=["manage"], created_by=member)
    assert authenticate_api_key(raw)  # in the read cache from now on
    return member, raw


def test_removing_a_membership_in_the_admin_revokes_the_members_keys(client, member_key):
    member, raw = member_key
    membership = member.memberships.get()
    response = client.post(f"/admin/accounts/membership/{membership.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302 and not member.memberships.exists()
    with pytest.raises(RevokedApiKey):
        authenticate_api_key(raw)


def test_deleting_a_user_in_the_admin_revokes_their_keys(client, member_key):
    member, raw = member_key
    response = client.post(f"/admin/accounts/user/{member.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302 and not User.objects.filter(pk=member.pk).exists()
    with pytest.raises(RevokedApiKey):
        authenticate_api_key(raw)
    assert ApiKey.objects.get(prefix=raw[3:15]).created_by is None


def test_the_admin_refuses_a_user_or_organization_name_with_a_line_break(client, operator):
    org = create_organization(name="Acme", owner=operator)
    response = client.post(f"/admin/accounts/organization/{org.pk}/change/", {
        "name": "Acme\r\nBcc: victim@example.com", "slug": org.slug,
        "memberships-TOTAL_FORMS": "0", "memberships-INITIAL_FORMS": "0",
    })
    assert response.status_code == 200 and "control characters" in response.content.decode()
    org.refresh_from_db()
    assert org.name == "Acme"
    response = client.post(f"/admin/accounts/user/{operator.pk}/change/", {
        "email": operator.email, "name": "Root\nAdmin", "is_active": "on", "is_staff": "on", "is_superuser": "on",
        "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00",
    })
    assert response.status_code == 200 and "control characters" in response.content.decode()
    operator.refresh_from_db()
    assert operator.name == ""
