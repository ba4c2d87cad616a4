"""Who may change a deployment: ``can_manage_deployment``, and the deployments API refusing, with
403 insufficient_role and nothing changed, what the caller's role does not allow. A key acts with
the role of the member who created it."""

from __future__ import annotations

import uuid

import pytest

from accounts.models import ApiKey
from accounts.services import add_member, create_api_key, create_organization, create_user
from models_catalog.models import CatalogModel, Deployment
from models_catalog.selectors import can_manage_deployment
from models_catalog.services import create_deployment
from tests.models_catalog.test_api import _error, bearer

pytestmark = pytest.mark.django_db

JSON = "application/json"


def _user(label: str, *, staff: bool = False):
    user = create_user(email=f"{label}-{uuid.uuid4().hex[:8]}@acme.test", password=None)
    if staff:
        user.is_staff = True
        user.save(update_fields=["is_staff"])
    return user


@pytest.fixture
def model():
    return CatalogModel.objects.create(slug="tiny", display_name="Tiny", architecture="llama", weights_path="tiny.gguf")


@pytest.fixture
def acme(model):
    """An organization with an owner, an admin and a member, a deployment created by each of the
    owner and the member, a manage key per person, one the command line made for no user and one
    with no creator that the command line did not make."""
    owner, admin, member = _user("owner"), _user("admin"), _user("member")
    org = create_organization(name="Acme", owner=owner)
    add_member(organization=org, user=admin, role="admin")
    add_member(organization=org, user=member, role="member")
    create_deployment(organization=org, model=model, name="owner-dep", created_by=owner)
    create_deployment(organization=org, model=model, name="member-dep", created_by=member)
    keys = {}
    for role, user in (("owner", owner), ("admin", admin), ("member", member), ("cli", None), ("orphan", None)):
        origin = ApiKey.Origin.COMMAND_LINE if role == "cli" else ApiKey.Origin.MEMBER
        _, raw = create_api_key(organization=org, name=role, scopes=["manage"], created_by=user, origin=origin)
        keys[role] = bearer(raw)
    return {"organization": org, "owner": owner, "admin": admin, "member": member, "keys": keys}


def _deployment(name: str) -> Deployment:
    return Deployment.objects.get(name=name)


# --- the rule -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("who, name, allowed", [
    ("owner", "owner-dep", True), ("owner", "member-dep", True),
    ("admin", "owner-dep", True), ("admin", "member-dep", True),
    ("member", "member-dep", True), ("member", "owner-dep", False),
])
def test_owners_and_admins_manage_every_deployment_a_member_their_own(acme, who, name, allowed):
    assert can_manage_deployment(user=acme[who], deployment=_deployment(name)) is allowed


def test_nobody_outside_the_organization_manages_its_deployments(acme):
    deployment = _deployment("member-dep")
    outsider = _user("outsider")
    assert not can_manage_deployment(user=outsider, deployment=deployment)
    assert not can_manage_deployment(user=None, deployment=deployment)
    # The creator who left the organization no longer manages it either.
    acme["organization"].memberships.filter(user=acme["member"]).delete()
    assert not can_manage_deployment(user=acme["member"], deployment=deployment)


def test_a_deactivated_member_manages_nothing(acme):
    acme["owner"].is_active = False
    acme["owner"].save(update_fields=["is_active"])
    assert not can_manage_deployment(user=acme["owner"], deployment=_deployment("owner-dep"))


def test_operators_manage_the_platforms_deployments_and_an_organizations_as_their_role_allows(acme, model):
    shared = create_deployment(organization=None, model=model, name="shared", is_public=True)
    operator = _user("root", staff=True)
    assert can_manage_deployment(user=operator, deployment=shared)
    assert not can_manage_deployment(user=acme["owner"], deployment=shared)
    add_member(organization=acme["organization"], user=operator, role="member")
    assert not can_manage_deployment(user=operator, deployment=_deployment("owner-dep"))


# --- the REST API ---------------------------------------------------------------------------------------


def _calls(client, headers: dict, name: str) -> list:
    return [
        client.patch(f"/v1/deployments/{name}", {"batch_window_ms": 1}, content_type=JSON, headers=headers),
        client.post(f"/v1/deployments/{name}/scale", {"max_replicas": 5}, content_type=JSON, headers=headers),
        client.post(f"/v1/deployments/{name}/stop", headers=headers),
        client.post(f"/v1/deployments/{name}/start", headers=headers),
        client.delete(f"/v1/deployments/{name}", headers=headers),
    ]


def test_a_members_key_cannot_change_the_owners_deployment(client, acme):
    for response in _calls(client, acme["keys"]["member"], "owner-dep"):
        error = _error(response, 403, param="name", code="insufficient_role")
        assert error["type"] == "invalid_request_error"
    deployment = _deployment("owner-dep")
    assert (deployment.batch_window_ms, deployment.max_replicas, deployment.status) == (20, 1, "pending")
    # Reading it stays allowed.
    assert client.get("/v1/deployments/owner-dep", headers=acme["keys"]["member"]).status_code == 200


def test_a_member_in_the_dashboard_session_is_refused_alike(client, acme):
    client.force_login(acme["member"])
    _error(client.delete("/v1/deployments/owner-dep"), 403, code="insufficient_role")
    assert Deployment.objects.filter(name="owner-dep").exists()


def test_a_members_key_changes_the_deployment_they_created(client, acme):
    headers = acme["keys"]["member"]
    body = client.patch("/v1/deployments/member-dep", {"batch_window_ms": 9}, content_type=JSON, headers=headers)
    assert body.status_code == 200 and body.json()["batch_window_ms"] == 9
    assert client.post("/v1/deployments/member-dep/stop", headers=headers).json()["status"] == "stopped"
    assert client.delete("/v1/deployments/member-dep", headers=headers).status_code == 200
    assert not Deployment.objects.filter(name="member-dep").exists()


@pytest.mark.parametrize("key", ["owner", "admin", "cli"])
def test_owner_admin_and_command_line_keys_change_a_members_deployment(client, acme, key):
    headers = acme["keys"][key]
    response = client.post("/v1/deployments/member-dep/scale", {"max_replicas": 3}, content_type=JSON,
                           headers=headers)
    assert response.status_code == 200 and response.json()["max_replicas"] == 3
    assert client.delete("/v1/deployments/member-dep", headers=headers).status_code == 200


def test_a_creator_less_key_not_made_by_the_command_line_changes_nothing(client, acme):
    for response in _calls(client, acme["keys"]["orphan"], "member-dep"):
        _error(response, 403, param="name", code="insufficient_role")
    assert _deployment("member-dep").status == "pending"


def test_a_deleted_members_key_stops_working_rather_than_acting_as_the_organization(client, acme):
    """Their creator gone, keys used to act as the command line's: a member's 403 became a 200."""
    headers = acme["keys"]["member"]
    _error(client.post("/v1/deployments/owner-dep/stop", headers=headers), 403, code="insufficient_role")
    acme["member"].delete()
    response = client.post("/v1/deployments/owner-dep/stop", headers=headers)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert _deployment("owner-dep").status == "pending"


def test_a_key_follows_its_creators_role(client, acme):
    """Demoting the member who made a key takes the key's rights with it (and promoting gives them)."""
    headers = acme["keys"]["admin"]
    add_member(organization=acme["organization"], user=acme["admin"], role="member")
    _error(client.post("/v1/deployments/owner-dep/stop", headers=headers), 403, code="insufficient_role")
    add_member(organization=acme["organization"], user=acme["member"], role="admin")
    assert client.post("/v1/deployments/owner-dep/stop", headers=acme["keys"]["member"]).status_code == 200
