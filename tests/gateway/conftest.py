"""In-process gateway fixtures: organizations and keys inside the test transaction."""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from decimal import Decimal

import pytest


@pytest.fixture
def org_key(db):
    """A new organization with a full-scope key; returns (organization, plaintext key)."""
    from accounts import services

    def make(scopes=("inference", "read_usage", "manage"), **key_options):
        tag = uuid.uuid4().hex[:8]
        user = services.create_user(email=f"{tag}@example.com", password=None)
        org = services.create_organization(name=f"org-{tag}", owner=user)
        key, plaintext = services.create_api_key(organization=org, name="t", scopes=list(scopes), created_by=user,
                                                 **key_options)
        return org, key, plaintext

    return make


@pytest.fixture
def broke_org_key(org_key):
    """An organization with a zero balance: valid requests stop at the quota check, before dispatch."""
    from billing.selectors import balance
    from billing.services import add_adjustment

    org, key, plaintext = org_key()
    add_adjustment(organization=org, amount=-balance(organization=org), description="test: empty the balance")
    assert balance(organization=org) == Decimal("0")
    return org, key, plaintext


@pytest.fixture
def seeded(db):
    from django.core.management import call_command

    call_command("seed_catalog", verbosity=0)
    return "smollm2-135m-instruct"


@contextmanager
def own_deployment(org_key, model_slug: str, *, prefix: str, status: str):
    """An organization's serverless deployment of ``model_slug`` in ``status`` (nobody consumes its
    queue here): (organization, plaintext key, name). Its queue and the placement-loop runs its
    creation and requests asked for are emptied after."""
    from inference_platform.celery import deployment_queue
    from models_catalog.models import CatalogModel, Deployment
    from models_catalog.services import create_deployment
    from tests.workers.test_capacity import queued_ticks
    from workers import fleet

    ticks_before = set(queued_ticks())
    org, _, plaintext = org_key()
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    deployment = create_deployment(organization=org, model=CatalogModel.objects.get(slug=model_slug), name=name,
                                   kind="serverless")
    Deployment.objects.filter(pk=deployment.pk).update(status=status)
    try:
        yield org, plaintext, name
    finally:
        fleet.client().delete(*fleet.queue_lists(deployment_queue(name)))
        for raw in set(queued_ticks()) - ticks_before:
            fleet.client().lrem("default", 0, raw)
