"""``workers.capacity.wake``: how long the gateway waits for a worker to take a request to a
deployment without a ready replica. The cold-start bound (FLEET_COLD_START_TIMEOUT) only when the
fleet can host the deployment, the usual queue timeout otherwise. Real database rows (workers and
replicas registered through the services, as a worker process would) and real Redis (the wake-up
of the placement loop is a Celery message on the `default` queue; nobody consumes it here)."""

from __future__ import annotations

import json
import uuid

import pytest
from django.utils import timezone

from models_catalog.models import CatalogModel, Deployment
from models_catalog.services import BUNDLED_SLUG, create_deployment, seed_catalog
from workers import capacity, dispatch, fleet, services
from workers.models import Replica, Worker

pytestmark = pytest.mark.django_db

QUEUE_TIMEOUT, COLD_START_TIMEOUT = 7.0, 42.0


@pytest.fixture(autouse=True)
def timeouts(settings):
    settings.GATEWAY_QUEUE_TIMEOUT = QUEUE_TIMEOUT
    settings.FLEET_COLD_START_TIMEOUT = COLD_START_TIMEOUT


@pytest.fixture
def model():
    """The bundled model, and no worker but the test's own (in this transaction)."""
    seed_catalog()
    Worker.objects.all().delete()
    return CatalogModel.objects.get(slug=BUNDLED_SLUG)


def deploy(model, status: str) -> Deployment:
    deployment = create_deployment(organization=None, model=model, name=f"cold-{uuid.uuid4().hex[:8]}")
    Deployment.objects.filter(pk=deployment.pk).update(status=status)
    return deployment


def spec(deployment: Deployment) -> dict:
    return dispatch.engine_spec(Deployment.objects.get(pk=deployment.pk))


def register(slots: int = 1) -> Worker:
    return services.register_worker(
        hostname=f"test-cold-{uuid.uuid4().hex[:6]}@nowhere", instance=uuid.uuid4().hex[:16], pid=1,
        device_kind="cpu", device_name="cpu", device_memory_bytes=8 << 30, slots=slots, queues=["default"])


def host(worker: Worker, deployment: Deployment) -> Replica:
    return Replica.objects.create(worker=worker, deployment=deployment, deployment_name=deployment.name,
                                  assigned_at=timezone.now())


def queued_ticks() -> list[str]:
    """Placement-loop runs requested on the `default` queue (Celery messages in Redis)."""
    def task(raw: str) -> str:
        return json.loads(raw).get("headers", {}).get("task", "")

    return [raw for raw in fleet.client().lrange("default", 0, -1) if task(raw) == fleet.TICK_TASK]


@pytest.fixture(autouse=True)
def ticks():
    """Counts the placement-loop runs ``wake`` asks for (the throttle key cleared first); the
    requests it made are taken off the queue again afterwards."""
    fleet.client().delete("fleet:wake")
    before = set(queued_ticks())
    yield lambda: len(set(queued_ticks()) - before)
    for raw in set(queued_ticks()) - before:
        fleet.client().lrem("default", 0, raw)
    fleet.client().delete("fleet:wake")


@pytest.mark.parametrize("status", ["scaled_to_zero", "pending", "loading"])
def test_a_deployment_a_free_worker_can_load_gets_the_cold_start_bound(model, ticks, status):
    register(slots=1)
    deployment = deploy(model, status)
    assert capacity.wake(spec(deployment)) == COLD_START_TIMEOUT
    assert ticks() == 1  # and the placement loop runs now, not at its next beat


def test_a_replica_already_loading_gets_the_cold_start_bound_even_on_a_full_worker(model):
    worker = register(slots=1)
    deployment = deploy(model, "loading")
    host(worker, deployment)  # its one slot: this deployment's own replica
    assert capacity.wake(spec(deployment)) == COLD_START_TIMEOUT


def test_without_any_alive_worker_the_wait_is_the_usual_queue_timeout(model, ticks):
    gone = register(slots=4)
    Worker.objects.filter(pk=gone.pk).update(status=Worker.Status.GONE)
    deployment = deploy(model, "scaled_to_zero")
    assert capacity.wake(spec(deployment)) == QUEUE_TIMEOUT
    assert ticks() == 1  # still asked: a worker may register before the next beat


def test_when_every_worker_is_full_the_wait_is_the_usual_queue_timeout(model):
    worker = register(slots=1)
    host(worker, deploy(model, "ready"))  # its one slot is taken by another deployment
    assert capacity.wake(spec(deploy(model, "scaled_to_zero"))) == QUEUE_TIMEOUT
    Worker.objects.filter(pk=worker.pk).update(slots=2)  # one free slot: it can be loaded there
    assert capacity.wake(spec(deploy(model, "scaled_to_zero"))) == COLD_START_TIMEOUT


@pytest.mark.parametrize("status", ["stopped", "failed"])
def test_a_stopped_or_failed_deployment_is_not_waited_for(model, ticks, status):
    register(slots=1)
    deployment = deploy(model, status)
    assert capacity.wake(spec(deployment)) == QUEUE_TIMEOUT
    assert ticks() == 1  # the placement loop answers the waiting request with the reason


def test_a_ready_or_deleted_deployment_needs_no_wake_up(model, ticks):
    register(slots=1)
    ready = deploy(model, "ready")
    assert capacity.wake(spec(ready)) == QUEUE_TIMEOUT
    deleted = spec(deploy(model, "scaled_to_zero"))
    Deployment.objects.filter(pk=deleted["id"]).delete()
    assert capacity.wake(deleted) == QUEUE_TIMEOUT
    assert ticks() == 0


def test_the_cold_start_bound_never_shortens_the_usual_wait(model, settings):
    settings.FLEET_COLD_START_TIMEOUT = 1
    register(slots=1)
    assert capacity.wake(spec(deploy(model, "scaled_to_zero"))) == QUEUE_TIMEOUT
