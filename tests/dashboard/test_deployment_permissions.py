"""Who may change a deployment in the dashboard: owners and admins every deployment of the
organization, a member only the ones they created; refused changes are a 403 that changes nothing,
and the page shows no control the user cannot use."""

from __future__ import annotations

import uuid

import pytest

from accounts.services import add_member, create_user
from models_catalog.models import Deployment
from models_catalog.services import create_deployment, set_deployment_status
from tests.dashboard.conftest import PASSWORD
from tests.dashboard.test_deployments import FORM


def _joined(organization, role: str):
    user = create_user(email=f"{role}-{uuid.uuid4().hex[:8]}@example.com", password=PASSWORD)
    add_member(organization=organization, user=user, role=role)
    return user


@pytest.fixture
def team(acme, catalog):
    """Acme's owner, an admin and a member, with one deployment created by the owner and one by
    the member."""
    owner, org = acme
    model, _ = catalog
    member, admin = _joined(org, "member"), _joined(org, "admin")
    create_deployment(organization=org, model=model, name="owner-dep", created_by=owner)
    create_deployment(organization=org, model=model, name="member-dep", created_by=member)
    return {"owner": owner, "admin": admin, "member": member}


def _as(client, user):
    client.force_login(user)
    return client


def _settings(name: str) -> tuple[int, int]:
    deployment = Deployment.objects.get(name=name)
    return deployment.batch_window_ms, deployment.max_batch_size


def test_a_member_cannot_delete_the_owners_deployment(client, team):
    response = _as(client, team["member"]).post("/deployments/owner-dep/delete/", {"confirm": "owner-dep"})
    assert response.status_code == 403
    assert "owners and admins" in response.content.decode()
    assert Deployment.objects.filter(name="owner-dep").exists()


def test_a_member_cannot_change_the_owners_deployment(client, team):
    response = _as(client, team["member"]).post("/deployments/owner-dep/settings/",
                                                 {**FORM, "batch_window_ms": "99", "max_batch_size": "4"})
    assert response.status_code == 403
    assert _settings("owner-dep") == (20, 32)


def test_a_member_manages_the_deployment_they_created(client, team):
    member = _as(client, team["member"])
    response = member.post("/deployments/member-dep/settings/", {**FORM, "batch_window_ms": "99", "max_batch_size": "4"})
    assert response.status_code == 302
    assert _settings("member-dep") == (99, 4)
    response = member.post("/deployments/member-dep/delete/", {"confirm": "member-dep"})
    assert response.status_code == 302 and not Deployment.objects.filter(name="member-dep").exists()


@pytest.mark.parametrize("role", ["owner", "admin"])
def test_owners_and_admins_manage_a_members_deployment(client, team, role):
    manager = _as(client, team[role])
    response = manager.post("/deployments/member-dep/settings/", {**FORM, "batch_window_ms": "7", "max_batch_size": "2"})
    assert response.status_code == 302
    assert _settings("member-dep") == (7, 2)
    response = manager.post("/deployments/member-dep/delete/", {"confirm": "member-dep"})
    assert response.status_code == 302 and not Deployment.objects.filter(name="member-dep").exists()


def test_the_member_sees_no_controls_on_the_owners_deployment(client, team):
    member = _as(client, team["member"])
    page = member.get("/deployments/owner-dep/").content.decode()
    assert "Save settings" not in page and 'id="delete-dialog"' not in page and "/deployments/owner-dep/delete/" not in page
    assert "/deployments/owner-dep/settings/" not in page
    assert 'id="read-only-note"' in page
    own = member.get("/deployments/member-dep/").content.decode()
    assert "Save settings" in own and 'id="delete-dialog"' in own and 'id="read-only-note"' not in own


def test_the_admin_sees_the_controls_on_a_members_deployment(client, team):
    page = _as(client, team["admin"]).get("/deployments/member-dep/").content.decode()
    assert "Save settings" in page and 'id="delete-dialog"' in page


def _failed(name: str) -> None:
    set_deployment_status(deployment=Deployment.objects.get(name=name), status="failed", reason="out of memory")


def test_a_member_cannot_retry_the_owners_failed_deployment_nor_sees_retry(client, team):
    _failed("owner-dep")
    member = _as(client, team["member"])
    assert "/deployments/owner-dep/start/" not in member.get("/deployments/owner-dep/").content.decode()
    response = member.post("/deployments/owner-dep/start/")
    assert response.status_code == 403 and "Nothing was changed" in response.content.decode()
    assert Deployment.objects.get(name="owner-dep").status == "failed"


def test_a_member_retries_the_deployment_they_created(client, team):
    _failed("member-dep")
    member = _as(client, team["member"])
    assert "/deployments/member-dep/start/" in member.get("/deployments/member-dep/").content.decode()
    assert member.post("/deployments/member-dep/start/").status_code == 302
    assert Deployment.objects.get(name="member-dep").status == "pending"


@pytest.mark.parametrize("role", ["owner", "admin"])
def test_owners_and_admins_retry_a_members_deployment(client, team, role):
    _failed("member-dep")
    manager = _as(client, team[role])
    assert "/deployments/member-dep/start/" in manager.get("/deployments/member-dep/").content.decode()
    assert manager.post("/deployments/member-dep/start/").status_code == 302
    assert Deployment.objects.get(name="member-dep").status == "pending"


def test_a_member_cannot_stop_the_owners_deployment_nor_sees_stop(client, team):
    member = _as(client, team["member"])
    page = member.get("/deployments/owner-dep/").content.decode()
    assert "/deployments/owner-dep/stop/" not in page and 'id="stop-button"' not in page
    response = member.post("/deployments/owner-dep/stop/")
    assert response.status_code == 403 and "Nothing was changed" in response.content.decode()
    assert Deployment.objects.get(name="owner-dep").status == "pending"
    # Nor does the status poll bring the button in.
    poll = member.get("/deployments/owner-dep/status/", headers={"HX-Request": "true"}).content.decode()
    assert 'id="stop-button"' not in poll
