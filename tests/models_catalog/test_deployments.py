"""Deployments: validation naming the field, database constraints, visibility across organizations."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from accounts.services import create_organization, create_user
from models_catalog.errors import DeploymentNotFound, InvalidDeployment
from models_catalog.models import CatalogModel, Deployment
from models_catalog.selectors import catalog_models, deployments_of, deployments_visible_to, resolve_deployment
from models_catalog.services import (
    create_deployment,
    delete_deployment,
    set_deployment_status,
    update_catalog_model,
    update_deployment,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def model():
    return CatalogModel.objects.create(
        slug="tiny", display_name="Tiny", architecture="llama", parameter_count=1000, context_length=2048,
        quantization="F16", weights_path="tiny.gguf",
    )


@pytest.fixture
def acme():
    return create_organization(name="Acme", owner=create_user(email="ada@acme.test", password=None))


@pytest.fixture
def globex():
    return create_organization(name="Globex", owner=create_user(email="hank@globex.test", password=None))


def test_create_with_defaults_and_queue_name(acme, model):
    deployment = create_deployment(organization=acme, model=model, name="acme-tiny")
    assert deployment.kind == "serverless" and deployment.status == "pending" and not deployment.is_public
    assert deployment.batch_window_ms == 20 and deployment.max_batch_size == 32
    assert deployment.queue_name == "deployment.acme-tiny"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "Has Spaces"}, "name"),
        ({"name": ""}, "name"),
        ({"name": "-leading-dash"}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"name": "demo\n"}, "name"),  # "$" matched before a final newline
        ({"batch_window_ms": -1}, "batch_window_ms"),
        ({"batch_window_ms": 2.5}, "batch_window_ms"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_size": True}, "max_batch_size"),
        ({"queue_limit": 0}, "queue_limit"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"kind": "dedicated", "min_replicas": 0}, "min_replicas"),
        ({"kind": "spot"}, "kind"),
        ({"dtype": "int3"}, "dtype"),
        ({"quantization": "int4"}, "quantization"),
        ({"scale_to_zero_seconds": -5}, "scale_to_zero_seconds"),
        ({"is_public": True}, "is_public"),
        ({"gpu_count": 8}, "gpu_count"),
    ],
)
def test_invalid_settings_name_the_field_and_write_nothing(acme, model, kwargs, field):
    args = {"organization": acme, "model": model, "name": "ok-name", **kwargs}
    with pytest.raises(InvalidDeployment) as info:
        create_deployment(**args)
    assert info.value.field == field and info.value.message
    assert not Deployment.objects.exists()


def test_a_taken_name_and_an_inactive_model_are_refused(acme, globex, model):
    create_deployment(organization=acme, model=model, name="shared-name")
    with pytest.raises(InvalidDeployment) as info:
        create_deployment(organization=globex, model=model, name="shared-name")
    assert info.value.field == "name" and "taken" in info.value.message
    model.is_active = False
    model.save()
    with pytest.raises(InvalidDeployment) as info:
        create_deployment(organization=acme, model=model, name="other")
    assert info.value.field == "model"


def test_fp8_weights_are_a_deployment_setting(acme, model):
    deployment = create_deployment(organization=acme, model=model, name="eight", quantization="fp8")
    assert deployment.quantization == "fp8"
    assert create_deployment(organization=acme, model=model, name="plain").quantization == "none"


def test_dedicated_deployments_default_to_one_replica(acme, model):
    deployment = create_deployment(organization=acme, model=model, name="ded", kind="dedicated")
    assert deployment.min_replicas == 1 and deployment.max_replicas == 1
    # So does a serverless one made dedicated; a minimum given is checked as given.
    turned = update_deployment(deployment=create_deployment(organization=acme, model=model, name="was-serverless"),
                               kind="dedicated")
    assert (turned.kind, turned.min_replicas) == ("dedicated", 1)
    with pytest.raises(InvalidDeployment, match="at least one replica"):
        update_deployment(deployment=create_deployment(organization=acme, model=model, name="zero"),
                          kind="dedicated", min_replicas=0)


@pytest.mark.parametrize(
    "values",
    [
        {"batch_window_ms": -1},
        {"max_batch_size": 0},
        {"queue_limit": 0},
        {"min_replicas": 3, "max_replicas": 2},
        {"kind": "dedicated", "min_replicas": 0},
        {"status": "exploded"},
        {"dtype": "int3"},
        {"quantization": "int4"},
    ],
)
def test_the_database_enforces_the_invariants_too(model, values):
    with pytest.raises(IntegrityError), transaction.atomic():
        Deployment.objects.create(model=model, name="raw", **values)


def test_the_database_refuses_negative_prices(model):
    with pytest.raises(IntegrityError), transaction.atomic():
        CatalogModel.objects.filter(pk=model.pk).update(price_output_per_mtok=-1)


def test_another_organizations_private_deployment_is_not_resolvable(acme, globex, model):
    private = create_deployment(organization=acme, model=model, name="acme-private")
    assert resolve_deployment(organization=acme, name="acme-private") == private
    with pytest.raises(DeploymentNotFound) as hidden:
        resolve_deployment(organization=globex, name="acme-private")
    with pytest.raises(DeploymentNotFound) as missing:
        resolve_deployment(organization=globex, name="no-such-thing")
    # Same wording either way: nothing reveals that the private deployment exists.
    assert hidden.value.message.replace("acme-private", "X") == missing.value.message.replace("no-such-thing", "X")
    with pytest.raises(DeploymentNotFound):
        resolve_deployment(organization=None, name="acme-private")
    with pytest.raises(DeploymentNotFound):
        resolve_deployment(organization=globex, name="")


def test_public_operator_deployments_are_visible_to_everyone(acme, globex, model):
    public = create_deployment(organization=None, model=model, name="tiny-public", is_public=True)
    hidden = create_deployment(organization=None, model=model, name="operator-internal")
    mine = create_deployment(organization=acme, model=model, name="acme-own")
    assert resolve_deployment(organization=globex, name="tiny-public") == public
    assert resolve_deployment(organization=None, name="tiny-public") == public
    with pytest.raises(DeploymentNotFound):
        resolve_deployment(organization=acme, name=hidden.name)
    assert list(deployments_visible_to(organization=acme)) == [mine, public]
    assert list(deployments_visible_to(organization=globex)) == [public]
    assert list(deployments_of(organization=acme)) == [mine]


def test_update_checks_like_create_and_keeps_name_and_model(acme, model):
    deployment = create_deployment(organization=acme, model=model, name="upd")
    update_deployment(deployment=deployment, batch_window_ms=5, max_replicas=4, min_replicas=2)
    deployment.refresh_from_db()
    assert (deployment.batch_window_ms, deployment.min_replicas, deployment.max_replicas) == (5, 2, 4)
    with pytest.raises(InvalidDeployment) as info:
        update_deployment(deployment=deployment, min_replicas=5)
    assert info.value.field == "max_replicas"
    for field, value in (("name", "new"), ("model", model)):
        with pytest.raises(InvalidDeployment) as info:
            update_deployment(deployment=deployment, **{field: value})
        assert info.value.field == field
    deployment.refresh_from_db()
    assert deployment.min_replicas == 2 and deployment.name == "upd"


def test_status_changes_and_delete(acme, model):
    deployment = create_deployment(organization=acme, model=model, name="st")
    set_deployment_status(deployment=deployment, status="failed", reason="out of memory")
    deployment.refresh_from_db()
    assert (deployment.status, deployment.status_reason) == ("failed", "out of memory")
    with pytest.raises(InvalidDeployment):
        set_deployment_status(deployment=deployment, status="sleeping")
    delete_deployment(deployment=deployment)
    assert not Deployment.objects.exists()
    assert create_deployment(organization=acme, model=model, name="st").name == "st"


def test_a_model_with_deployments_cannot_be_deleted(acme, model):
    create_deployment(organization=acme, model=model, name="keep")
    with pytest.raises(IntegrityError), transaction.atomic():
        model.delete()


def test_catalog_listing_and_price_updates(model):
    CatalogModel.objects.create(slug="old", display_name="Old", architecture="qwen2", weights_path="o.gguf", is_active=False)
    assert list(catalog_models()) == [model]
    assert len(catalog_models(include_inactive=True)) == 2
    assert list(catalog_models(search="tin")) == [model]
    update_catalog_model(catalog_model=model, price_output_per_mtok="0.30")
    model.refresh_from_db()
    assert str(model.price_output_per_mtok) == "0.300000"


def test_an_organization_may_not_hold_the_whole_fleet(acme, model, settings):
    settings.ORG_MAX_DEPLOYMENTS, settings.ORG_MAX_RESERVED_REPLICAS = 3, 2
    first = create_deployment(organization=acme, model=model, name="d-1", kind="dedicated", min_replicas=2)
    with pytest.raises(InvalidDeployment) as too_many_replicas:
        create_deployment(organization=acme, model=model, name="d-2", kind="dedicated")
    assert too_many_replicas.value.field == "min_replicas" and "limit of 2" in too_many_replicas.value.message
    create_deployment(organization=acme, model=model, name="d-2")  # serverless, nothing reserved
    with pytest.raises(InvalidDeployment):  # raising a floor counts too
        update_deployment(deployment=Deployment.objects.get(name="d-2"), min_replicas=1, max_replicas=1)
    update_deployment(deployment=first, min_replicas=1)
    update_deployment(deployment=Deployment.objects.get(name="d-2"), min_replicas=1, max_replicas=1)
    with pytest.raises(InvalidDeployment) as forever:  # never scaling to zero reserves what it may grow to
        create_deployment(organization=acme, model=model, name="d-3", scale_to_zero_seconds=0)
    assert forever.value.field == "scale_to_zero_seconds"
    create_deployment(organization=acme, model=model, name="d-3")
    with pytest.raises(InvalidDeployment) as too_many:
        create_deployment(organization=acme, model=model, name="d-4")
    assert too_many.value.field == "name" and "ORG_MAX_DEPLOYMENTS" in too_many.value.message
    settings.ORG_MAX_RESERVED_REPLICAS = 0  # lowered by the operator: coming down still works
    update_deployment(deployment=first, min_replicas=0, kind="serverless")
    create_deployment(organization=None, model=model, name="operators", kind="dedicated", min_replicas=8,
                      max_replicas=8)  # the operator's are not counted
