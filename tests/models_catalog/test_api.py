"""The catalog and deployments REST API: CRUD, invalid settings naming the field, operator-only
changes of shared deployments, and organizations isolated from each other for every verb."""

from __future__ import annotations

import uuid

import pytest

from accounts.services import create_api_key, create_organization, create_user
from models_catalog.models import CatalogModel, Deployment
from models_catalog.services import create_deployment, set_deployment_status

pytestmark = pytest.mark.django_db


def bearer(raw: str) -> dict:
    return {"Authorization": f"Bearer {raw}"}


class Org:
    def __init__(self, name: str, scopes=("inference", "manage")):
        self.owner = create_user(email=f"{uuid.uuid4().hex[:8]}@{name.lower()}.test", password=None)
        self.organization = create_organization(name=name, owner=self.owner)
        _, self.key = create_api_key(organization=self.organization, name="k", scopes=list(scopes), created_by=self.owner)
        self.headers = bearer(self.key)


@pytest.fixture
def model():
    return CatalogModel.objects.create(
        slug="tiny", display_name="Tiny", architecture="llama", parameter_count=1000, context_length=2048,
        quantization="F16", weights_path="tiny.gguf", price_input_per_mtok="0.150000", price_output_per_mtok="0.6",
    )


@pytest.fixture
def acme():
    return Org("Acme")


@pytest.fixture
def globex():
    return Org("Globex")


def _error(response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_the_catalog_lists_active_models_with_prices_as_decimal_strings(client, acme, model):
    CatalogModel.objects.create(slug="hidden", display_name="Hidden", architecture="llama", weights_path="h.gguf",
                                is_active=False)
    body = client.get("/v1/catalog", headers=acme.headers).json()
    assert [m["id"] for m in body["data"]] == ["tiny"]
    tiny = body["data"][0]
    assert tiny["prices"] == {"currency": "usd", "input_per_mtok": "0.150000", "cached_input_per_mtok": "0.000000",
                              "output_per_mtok": "0.600000", "per_request": "0.000000",
                              "per_replica_hour": "0.000000"}
    assert tiny["architecture"] == "llama" and tiny["context_length"] == 2048
    assert client.get("/v1/catalog/tiny", headers=acme.headers).json()["display_name"] == "Tiny"
    _error(client.get("/v1/catalog/hidden", headers=acme.headers), 404, code="model_not_found")


def test_without_a_key_401_and_without_the_manage_scope_403(client, model):
    reader = Org("Reader", scopes=("inference",))
    _error(client.get("/v1/deployments"), 401, code="invalid_api_key")
    _error(client.get("/v1/deployments", headers=bearer("sk-wrong")), 401)
    _error(client.post("/v1/deployments", {"name": "x", "model": "tiny"}, content_type="application/json",
                       headers=reader.headers), 403, code="missing_scope")


def test_create_read_update_scale_stop_start_delete(client, acme, model):
    created = client.post("/v1/deployments", {"name": "acme-tiny", "model": "tiny", "kind": "dedicated",
                                              "batch_window_ms": 5, "min_replicas": 1, "max_replicas": 2},
                          content_type="application/json", headers=acme.headers)
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["object"] == "deployment" and body["status"] == "pending" and body["owned_by"] == acme.organization.slug
    assert (body["kind"], body["batch_window_ms"], body["min_replicas"], body["public"]) == ("dedicated", 5, 1, False)

    listed = client.get("/v1/deployments", headers=acme.headers).json()["data"]
    assert [d["name"] for d in listed] == ["acme-tiny"]
    assert client.get("/v1/deployments/acme-tiny", headers=acme.headers).json()["batch_window_ms"] == 5

    patched = client.patch("/v1/deployments/acme-tiny", {"batch_window_ms": 40, "scale_to_zero_seconds": 60},
                           content_type="application/json", headers=acme.headers)
    assert patched.status_code == 200 and patched.json()["batch_window_ms"] == 40

    scaled = client.post("/v1/deployments/acme-tiny/scale", {"min_replicas": 2, "max_replicas": 3},
                         content_type="application/json", headers=acme.headers)
    assert (scaled.json()["min_replicas"], scaled.json()["max_replicas"]) == (2, 3)

    stopped = client.post("/v1/deployments/acme-tiny/stop", headers=acme.headers).json()
    assert stopped["status"] == "stopped"
    assert client.post("/v1/deployments/acme-tiny/start", headers=acme.headers).json()["status"] == "pending"

    deleted = client.delete("/v1/deployments/acme-tiny", headers=acme.headers)
    assert deleted.json() == {"object": "deployment.deleted", "id": "acme-tiny", "deleted": True}
    assert not Deployment.objects.filter(name="acme-tiny").exists()


@pytest.mark.parametrize(("body", "param"), [
    ({"name": "ok", "model": "tiny", "batch_window_ms": -1}, "batch_window_ms"),
    ({"name": "ok", "model": "tiny", "batch_window_ms": "fast"}, "batch_window_ms"),
    ({"name": "ok", "model": "tiny", "min_replicas": 3, "max_replicas": 2}, "max_replicas"),
    ({"name": "ok", "model": "tiny", "max_batch_size": 0}, "max_batch_size"),
    ({"name": "ok", "model": "tiny", "kind": "spot"}, "kind"),
    ({"name": "ok", "model": "tiny", "dtype": "int3"}, "dtype"),
    ({"name": "ok", "model": "tiny", "kind": "dedicated", "min_replicas": 0}, "min_replicas"),
    ({"name": "ok", "model": "nope"}, "model"),
    ({"name": "ok"}, "model"),
    ({"model": "tiny"}, "name"),
    ({"name": "Not OK", "model": "tiny"}, "name"),
    ({"name": "ok", "model": "tiny", "gpus": 8}, "gpus"),
    ({"name": "ok", "model": "tiny", "status": "ready"}, "status"),
    ({"name": "ok", "model": "tiny", "created_by": 1}, "created_by"),
    ({"name": "ok", "model": "tiny", "organization": 1}, "organization"),
    ({"name": "ok", "model": "tiny", "is_public": True}, "is_public"),
])
def test_invalid_settings_are_400_naming_the_field(client, acme, model, body, param):
    _error(client.post("/v1/deployments", body, content_type="application/json", headers=acme.headers), 400,
           param=param)
    assert not Deployment.objects.exists()


def test_a_taken_name_and_bad_bodies_are_refused(client, acme, globex, model):
    create_deployment(organization=globex.organization, model=model, name="taken")
    _error(client.post("/v1/deployments", {"name": "taken", "model": "tiny"}, content_type="application/json",
                       headers=acme.headers), 400, param="name")
    _error(client.post("/v1/deployments", [1, 2], content_type="application/json", headers=acme.headers), 400)
    _error(client.post("/v1/deployments", "{not json", content_type="application/json", headers=acme.headers), 400)
    create_deployment(organization=acme.organization, model=model, name="mine", min_replicas=1, max_replicas=2)
    _error(client.patch("/v1/deployments/mine", {"max_replicas": 0}, content_type="application/json",
                        headers=acme.headers), 400, param="max_replicas")
    for field in ("model", "name", "deployment", "organization"):
        _error(client.patch("/v1/deployments/mine", {field: "x"}, content_type="application/json",
                            headers=acme.headers), 400, param=field)
    _error(client.post("/v1/deployments/mine/scale", {"batch_window_ms": 3}, content_type="application/json",
                       headers=acme.headers), 400, param="batch_window_ms")
    _error(client.put("/v1/deployments/mine", {}, content_type="application/json", headers=acme.headers), 405)
    assert Deployment.objects.get(name="mine").max_replicas == 2


def test_another_organizations_deployment_does_not_exist_for_any_verb(client, acme, globex, model):
    create_deployment(organization=globex.organization, model=model, name="globex-secret", kind="dedicated")
    json = {"content_type": "application/json", "headers": acme.headers}
    assert "globex-secret" not in [d["name"] for d in client.get("/v1/deployments", **json).json()["data"]]
    for response in [
        client.get("/v1/deployments/globex-secret", headers=acme.headers),
        client.patch("/v1/deployments/globex-secret", {"batch_window_ms": 1}, **json),
        client.delete("/v1/deployments/globex-secret", headers=acme.headers),
        client.post("/v1/deployments/globex-secret/scale", {"max_replicas": 5}, **json),
        client.post("/v1/deployments/globex-secret/stop", headers=acme.headers),
        client.post("/v1/deployments/globex-secret/start", headers=acme.headers),
        client.get("/v1/deployments/globex-secret/metrics", headers=acme.headers),
    ]:
        _error(response, 404, param="name", code="deployment_not_found")
    # ...nor can it be called.
    call = client.post("/v1/chat/completions", {"model": "globex-secret", "messages": [{"role": "user", "content": "hi"}]},
                       **json)
    _error(call, 404, param="model", code="model_not_found")
    unchanged = Deployment.objects.get(name="globex-secret")
    assert (unchanged.batch_window_ms, unchanged.max_replicas, unchanged.status) == (20, 1, "pending")


def test_shared_deployments_are_readable_by_all_and_changed_by_operators_only(client, acme, model):
    shared = create_deployment(organization=None, model=model, name="shared", is_public=True)
    assert client.get("/v1/deployments/shared", headers=acme.headers).json()["owned_by"] == "system"
    for response in [
        client.patch("/v1/deployments/shared", {"batch_window_ms": 1}, content_type="application/json",
                     headers=acme.headers),
        client.post("/v1/deployments/shared/stop", headers=acme.headers),
        client.delete("/v1/deployments/shared", headers=acme.headers),
    ]:
        _error(response, 403, code="permission_denied")
    shared.refresh_from_db()
    assert shared.status == "pending" and shared.batch_window_ms == 20

    operator = create_user(email="root@platform.test", password=None)
    operator.is_staff = True
    operator.save(update_fields=["is_staff"])
    client.force_login(operator)
    assert client.patch("/v1/deployments/shared", {"batch_window_ms": 7},
                        content_type="application/json").json()["batch_window_ms"] == 7
    published = client.post("/v1/deployments", {"name": "for-everyone", "model": "tiny", "is_public": True},
                            content_type="application/json")
    assert published.status_code == 201 and published.json()["owned_by"] == "system" and published.json()["public"]
    assert Deployment.objects.get(name="for-everyone").organization is None
    # Nobody can make an organization's deployment public, and the refusal says so (not "only the
    # operator can", which the operator was told for their own organization's).
    own = create_deployment(organization=acme.organization, model=model, name="acme-own")
    refused = client.patch(f"/v1/deployments/{own.name}", {"is_public": True}, content_type="application/json",
                           headers=acme.headers)
    assert refused.status_code == 400 and "organization's deployment cannot be made public" in \
        refused.json()["error"]["message"]


def test_the_dashboard_session_uses_its_organization(client, acme, globex, model):
    create_deployment(organization=globex.organization, model=model, name="globex-only")
    client.force_login(acme.owner)
    created = client.post("/v1/deployments", {"name": "from-dashboard", "model": "tiny"},
                          content_type="application/json")
    assert created.status_code == 201 and created.json()["owned_by"] == acme.organization.slug
    _error(client.get("/v1/deployments/globex-only"), 404)


def test_changing_a_failed_deployment_tries_it_again(client, acme, model):
    deployment = create_deployment(organization=acme.organization, model=model, name="flaky")
    set_deployment_status(deployment=deployment, status="failed", reason="out of memory")
    body = client.patch("/v1/deployments/flaky", {"max_batch_size": 4}, content_type="application/json",
                        headers=acme.headers).json()
    assert body["status"] == "pending" and "trying again" in body["status_reason"]
