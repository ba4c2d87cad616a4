"""Deploying, the list with live status, a deployment's page and metrics, and their isolation."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from models_catalog.models import Deployment
from models_catalog.services import create_deployment, set_deployment_status
from tests.dashboard.conftest import record

FORM = {"model": "smollm2-135m-instruct", "name": "acme-chat", "kind": "serverless", "batch_window_ms": "15",
        "max_batch_size": "16", "min_replicas": "0", "max_replicas": "2", "scale_to_zero": "on",
        "scale_to_zero_seconds": "120", "queue_limit": "100", "dtype": "auto"}


def test_deploy_creates_a_deployment_of_the_current_organization(ada, acme, catalog):
    user, org = acme
    response = ada.post("/deploy/", FORM)
    assert response.status_code == 302 and response["Location"] == "/deployments/acme-chat/"
    deployment = Deployment.objects.get(name="acme-chat")
    assert deployment.organization == org and deployment.created_by == user
    assert (deployment.kind, deployment.batch_window_ms, deployment.max_batch_size, deployment.min_replicas,
            deployment.max_replicas, deployment.scale_to_zero_seconds, deployment.queue_limit) == \
           ("serverless", 15, 16, 0, 2, 120, 100)
    assert deployment.status == "pending" and deployment.quantization == "none"


def test_deploy_with_fp8_weights(ada, catalog):
    ada.post("/deploy/", {**FORM, "name": "eight-bit", "quantization": "fp8"})
    assert Deployment.objects.get(name="eight-bit").quantization == "fp8"


def test_scale_to_zero_off_and_dedicated(ada, catalog):
    ada.post("/deploy/", {**FORM, "name": "always-on", "scale_to_zero": ""})
    assert Deployment.objects.get(name="always-on").scale_to_zero_seconds == 0
    ada.post("/deploy/", {**FORM, "name": "reserved", "kind": "dedicated", "min_replicas": "2", "max_replicas": "3"})
    reserved = Deployment.objects.get(name="reserved")
    # Never to zero, but a burst's third replica goes back after the idle time (the form's 120 s):
    # it reserves, and is billed for, its two.
    assert (reserved.kind, reserved.min_replicas, reserved.scale_to_zero_seconds) == ("dedicated", 2, 120)
    assert reserved.reserved_replicas == 2
    ada.post("/deploy/", {**FORM, "name": "reserved-too", "kind": "dedicated", "min_replicas": "1",
                          "max_replicas": "2", "scale_to_zero": "on", "scale_to_zero_seconds": "0"})
    assert Deployment.objects.get(name="reserved-too").scale_to_zero_seconds == 300  # an idle time of none
    ada.post("/deploy/", {**FORM, "name": "keeps-all", "kind": "dedicated", "min_replicas": "1",
                          "max_replicas": "2", "scale_to_zero": ""})
    assert Deployment.objects.get(name="keeps-all").scale_to_zero_seconds == 0  # as asked (the API's way too)


@pytest.mark.parametrize("changes, field, message", [
    ({"max_replicas": "0"}, "max_replicas", "greater than or equal to 1"),
    ({"min_replicas": "3", "max_replicas": "1"}, "max_replicas", "at least min replicas"),
    ({"kind": "dedicated", "min_replicas": "0"}, "min_replicas", "at least one replica"),
    ({"batch_window_ms": "-5"}, "batch_window_ms", "greater than or equal to 0"),
    ({"name": "Not Valid!"}, "name", "lowercase letters"),
    ({"name": "smollm2-135m-instruct"}, "name", "is taken"),
    ({"model": "no-such-model"}, "model", "Select a valid choice"),
])
def test_bad_settings_are_refused_with_the_field_named(ada, catalog, changes, field, message):
    response = ada.post("/deploy/", {**FORM, **changes})
    assert response.status_code == 200
    form = response.context["form"]
    assert message in " ".join(form.errors.get(field, form.non_field_errors()))
    assert not Deployment.objects.filter(organization__isnull=False).exists()


def test_every_bad_field_is_reported_on_the_first_submit(ada, catalog):
    """A bad name does not hide the replicas' error until the next submit: both show at once, by
    their fields and in the form's summary."""
    response = ada.post("/deploy/", {**FORM, "name": "Bad Name", "min_replicas": "3", "max_replicas": "1"})
    errors = response.context["form"].errors
    assert "lowercase letters" in " ".join(errors["name"])
    assert "at least min replicas" in " ".join(errors["max_replicas"])
    summary = response.content.decode().split('id="error-summary"')[1].split("</div>")[0]
    assert 'href="#id_name"' in summary and 'href="#id_max_replicas"' in summary
    response = ada.post("/deploy/", {**FORM, "kind": "dedicated", "min_replicas": "0", "queue_limit": "0",
                                     "scale_to_zero_seconds": "x"})
    errors = response.context["form"].errors
    assert set(errors) == {"min_replicas", "queue_limit", "scale_to_zero_seconds"}, errors
    assert "at least one replica" in " ".join(errors["min_replicas"])
    assert ada.post("/deploy/", {**FORM, "name": "mine"}).status_code == 302
    response = ada.post("/deploy/", {**FORM, "name": "mine", "min_replicas": "3", "max_replicas": "1"})
    errors = response.context["form"].errors  # a taken name, beside the others
    assert errors["name"] == ["The name 'mine' is taken: choose another."] and "max_replicas" in errors


def test_the_list_shows_own_and_public_deployments_only(ada, acme, globex, catalog):
    model, public = catalog
    _, acme_org = acme
    _, globex_org = globex
    create_deployment(organization=acme_org, model=model, name="acme-one")
    create_deployment(organization=globex_org, model=model, name="globex-secret")
    for path in ("/deployments/", "/deployments/_rows/"):
        body = ada.get(path).content.decode()
        assert "acme-one" in body and public.name in body and "globex-secret" not in body


def test_the_rows_carry_the_current_status(ada, acme, catalog):
    model, _ = catalog
    deployment = create_deployment(organization=acme[1], model=model, name="acme-live")
    assert 'data-status="pending"' in ada.get("/deployments/_rows/", headers={"HX-Request": "true"}).content.decode()
    set_deployment_status(deployment=deployment, status="ready")
    rows = ada.get("/deployments/_rows/").content.decode()
    assert 'data-status="ready"' in rows.split('data-deployment="acme-live"')[1].split("</tr>")[0]
    assert 'data-status="ready"' in ada.get("/deployments/acme-live/status/").content.decode()


@pytest.mark.parametrize("method, path", [
    ("get", "/deployments/globex-secret/"), ("get", "/deployments/globex-secret/metrics.json"),
    ("get", "/deployments/globex-secret/status/"), ("post", "/deployments/globex-secret/settings/"),
    ("post", "/deployments/globex-secret/start/"), ("post", "/deployments/globex-secret/delete/"),
])
def test_another_organizations_deployment_is_not_found(ada, globex, catalog, method, path):
    model, _ = catalog
    create_deployment(organization=globex[1], model=model, name="globex-secret")
    response = getattr(ada, method)(path, {"confirm": "globex-secret", **FORM} if method == "post" else None)
    assert response.status_code == 404
    assert Deployment.objects.filter(name="globex-secret", max_batch_size=32).exists()


def test_public_deployments_are_read_only(ada, catalog):
    _, public = catalog
    page = ada.get(f"/deployments/{public.name}/").content.decode()
    assert "Shared" in page and "Save settings" not in page
    assert ada.post(f"/deployments/{public.name}/settings/", FORM).status_code == 404
    assert ada.post(f"/deployments/{public.name}/delete/", {"confirm": public.name}).status_code == 404
    set_deployment_status(deployment=public, status="failed", reason="out of memory")
    page = ada.get(f"/deployments/{public.name}/").content.decode()
    assert "/start/" not in page and ada.post(f"/deployments/{public.name}/start/").status_code == 404
    assert Deployment.objects.get(name=public.name).status == "failed"
    assert Deployment.objects.filter(name=public.name).exists()


def test_settings_change_and_bad_settings_are_refused(ada, acme, catalog):
    model, _ = catalog
    create_deployment(organization=acme[1], model=model, name="tune-me")
    response = ada.post("/deployments/tune-me/settings/", {**FORM, "batch_window_ms": "50", "max_batch_size": "8"})
    assert response.status_code == 302
    deployment = Deployment.objects.get(name="tune-me")
    assert (deployment.batch_window_ms, deployment.max_batch_size) == (50, 8)
    response = ada.post("/deployments/tune-me/settings/", {**FORM, "min_replicas": "4", "max_replicas": "2"})
    assert response.status_code == 400
    assert Deployment.objects.get(name="tune-me").max_replicas == 2


def test_delete_needs_the_name_typed(ada, acme, catalog):
    model, _ = catalog
    create_deployment(organization=acme[1], model=model, name="to-delete")
    ada.post("/deployments/to-delete/delete/", {"confirm": "wrong"})
    assert Deployment.objects.filter(name="to-delete").exists()
    response = ada.post("/deployments/to-delete/delete/", {"confirm": "to-delete"})
    assert response.status_code == 302 and response["Location"] == "/deployments/"
    assert not Deployment.objects.filter(name="to-delete").exists()


def test_metrics_come_from_the_organizations_usage_records(ada, acme, globex, catalog):
    model, public = catalog
    _, acme_org = acme
    now = datetime.now(timezone.utc).replace(second=30, microsecond=0)
    minute = now - timedelta(minutes=2)
    for latency, tokens, batch in ((100, 60, 2.0), (200, 60, 4.0), (300, 120, 8.0), (400, 0, None)):
        record(acme_org, public, completion_tokens=tokens, latency_ms=latency, finished_at=minute, batch_size=batch)
    record(acme_org, public, completion_tokens=30, latency_ms=1000, finished_at=now - timedelta(hours=3))  # outside 1h
    record(globex[1], public, completion_tokens=999, latency_ms=5000, finished_at=minute)  # another organization
    data = ada.get(f"/deployments/{public.name}/metrics.json?window=1h").json()
    series = data["series"]
    assert data["bucket_s"] == 60 and len(series["labels"]) == 60
    at = series["labels"].index(minute.replace(second=0).isoformat())
    assert series["requests_per_min"][at] == 4
    assert series["tokens_per_s"][at] == 240 / 60
    assert (series["p50_ms"][at], series["p99_ms"][at]) == (200, 400)
    # The engine's batch size, weighted by output tokens; a request without one does not count.
    assert series["batch"][at] == pytest.approx((60 * 2 + 60 * 4 + 120 * 8) / 240)
    assert series["batch"][at - 1] is None
    assert sum(series["requests_per_min"]) == 4
    assert data["totals"]["requests"] == 4 and data["totals"]["completion_tokens"] == 240
    day = ada.get(f"/deployments/{public.name}/metrics.json?window=24h").json()
    assert day["totals"]["requests"] == 5 and len(day["series"]["labels"]) == 24
    page = ada.get(f"/deployments/{public.name}/").content.decode()
    assert "Requests / min" in page and "Average batch size" in page
