"""Who may revoke which API key: owners and admins any key of their organization, a member only
the keys they created; the page offers Revoke exactly where the revoke would be allowed."""

from __future__ import annotations

import pytest
from django.test import Client

from accounts.models import ApiKey, Membership
from accounts.selectors import can_revoke_api_key
from accounts.services import add_member, create_api_key
from tests.dashboard.conftest import sign_up


def _client_in(user, organization) -> Client:
    client = Client()
    client.force_login(user)
    client.post("/organizations/switch/", {"organization": organization.pk})
    return client


def _revoke_button_on(page: str, key: ApiKey) -> bool:
    return f'action="/api-keys/{key.pk}/revoke/"' in page


@pytest.fixture
def team(acme):
    """Acme with its owner, an admin and a plain member, each holding a key they created."""
    owner, org = acme
    admin, _ = sign_up("Al", "Al's own")
    member, _ = sign_up("Mel", "Mel's own")
    add_member(organization=org, user=admin, role="admin")
    add_member(organization=org, user=member, role="member")
    keys = {who: create_api_key(organization=org, name=f"{who}-key", scopes=["inference"], created_by=user)[0]
            for who, user in (("owner", owner), ("admin", admin), ("member", member))}
    return {"org": org, "owner": owner, "admin": admin, "member": member, "keys": keys}


def test_a_member_cannot_revoke_the_owners_key(team):
    client = _client_in(team["member"], team["org"])
    owners_key = team["keys"]["owner"]
    assert not _revoke_button_on(client.get("/api-keys/").content.decode(), owners_key)

    response = client.post(f"/api-keys/{owners_key.pk}/revoke/", follow=True)
    page = response.content.decode()
    assert "was not revoked" in page and "is revoked" not in page
    owners_key.refresh_from_db()
    assert owners_key.revoked_at is None


def test_a_member_revokes_their_own_key(team):
    client = _client_in(team["member"], team["org"])
    own = team["keys"]["member"]
    assert _revoke_button_on(client.get("/api-keys/").content.decode(), own)

    response = client.post(f"/api-keys/{own.pk}/revoke/", follow=True)
    assert "is revoked" in response.content.decode()
    own.refresh_from_db()
    assert own.revoked_at is not None


def test_an_admin_revokes_a_members_key(team):
    client = _client_in(team["admin"], team["org"])
    page = client.get("/api-keys/").content.decode()
    assert all(_revoke_button_on(page, key) for key in team["keys"].values())

    client.post(f"/api-keys/{team['keys']['member'].pk}/revoke/")
    assert ApiKey.objects.get(pk=team["keys"]["member"].pk).revoked_at is not None


def test_a_member_cannot_revoke_a_key_nobody_holds_any_more(team):
    # A key whose creator's account was deleted (created_by is then NULL): owners' and admins' to revoke.
    orphan, _ = create_api_key(organization=team["org"], name="orphan", scopes=["inference"], created_by=None)
    membership = Membership.objects.get(user=team["member"], organization=team["org"])
    assert not can_revoke_api_key(membership=membership, api_key=orphan)
    owner = Membership.objects.get(user=team["owner"], organization=team["org"])
    assert can_revoke_api_key(membership=owner, api_key=orphan)


def test_a_role_in_another_organization_grants_nothing(team, globex):
    grace, globex_org = globex
    globex_owner = Membership.objects.get(user=grace, organization=globex_org)
    assert not can_revoke_api_key(membership=globex_owner, api_key=team["keys"]["member"])
    assert not can_revoke_api_key(membership=None, api_key=team["keys"]["member"])


def test_staff_gets_no_more_than_their_role(team):
    """Operators act through the admin site; in an organization they are what their role says."""
    member = team["member"]
    member.is_staff = True
    member.save(update_fields=["is_staff"])
    client = _client_in(member, team["org"])
    client.post(f"/api-keys/{team['keys']['owner'].pk}/revoke/")
    assert ApiKey.objects.get(pk=team["keys"]["owner"].pk).revoked_at is None
