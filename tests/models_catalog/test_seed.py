"""seed_catalog: the bundled model and its public deployment, idempotently."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.core.management import call_command

from accounts.services import create_organization, create_user
from models_catalog.models import CatalogModel, Deployment
from models_catalog.selectors import resolve_deployment
from models_catalog.weights import resolve_weights_path

from .conftest import bundled_gguf

pytestmark = pytest.mark.django_db


def test_seed_catalog_is_idempotent_and_callable_by_any_organization(capsys):
    call_command("seed_catalog")
    assert "added the catalog model" in capsys.readouterr().out
    model = CatalogModel.objects.get(slug="smollm2-135m-instruct")
    model.price_input_per_mtok = Decimal("0.07")  # an operator's change survives re-seeding
    model.save()

    call_command("seed_catalog")
    assert capsys.readouterr().out == ""
    assert CatalogModel.objects.count() == 1 and Deployment.objects.count() == 1

    model.refresh_from_db()
    assert (model.architecture, model.quantization, model.context_length) == ("llama", "Q4_1", 8192)
    assert 130_000_000 < model.parameter_count < 140_000_000
    assert model.price_input_per_mtok == Decimal("0.07")
    assert model.price_cached_input_per_mtok == Decimal("0.025")
    assert model.price_output_per_mtok == Decimal("0.10") and model.price_per_request == 0
    assert model.weights_path == "bundled:smollm2-135m-instruct"
    assert resolve_weights_path(model) == bundled_gguf()

    org = create_organization(name="Acme", owner=create_user(email="ada@acme.test", password=None))
    deployment = resolve_deployment(organization=org, name="smollm2-135m-instruct")
    assert deployment.model == model and deployment.organization is None and deployment.is_public
    # Pending until a worker has loaded it: the fleet, not the seed, says when it is ready.
    assert (deployment.kind, deployment.status) == ("serverless", "pending")
    assert (deployment.batch_window_ms, deployment.max_batch_size) == (20, 32)
    assert deployment.queue_name == "deployment.smollm2-135m-instruct"
