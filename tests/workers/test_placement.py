"""The placement policy, one pass at a time, in this process: workers registered and beating
through the services (as a worker process would), real Redis for queue depths and remote control
(sent to workers nobody runs, so nothing loads). The live fleet is tested in test_fleet.py."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.utils import timezone

from models_catalog.models import CatalogModel, Deployment
from models_catalog.services import (
    BUNDLED_SLUG,
    create_deployment,
    seed_catalog,
    set_deployment_status,
    update_deployment,
)
from workers import dispatch, fleet, placement, selectors, services
from workers.models import FleetEvent, Replica, Worker
from workers.selectors import status_history

pytestmark = pytest.mark.django_db


@pytest.fixture
def model():
    """The bundled model, and no deployment or worker but the test's own (in this transaction)."""
    seed_catalog()
    Deployment.objects.all().delete()
    Worker.objects.all().delete()
    return CatalogModel.objects.get(slug=BUNDLED_SLUG)


def register(label: str, slots: int = 1) -> Worker:
    return services.register_worker(
        hostname=f"test-{label}-{uuid.uuid4().hex[:6]}@nowhere", instance=uuid.uuid4().hex[:16], pid=1,
        device_kind="cpu", device_name="cpu", device_memory_bytes=8 << 30, slots=slots, queues=["default"])


def beat(worker: Worker, deployments: dict | None = None, *, at=None) -> None:
    services.record_heartbeat(hostname=worker.hostname, instance=worker.instance, queues=["default"],
                              queue_depths={}, deployments=deployments or {}, now=at)


def loaded(worker: Worker, deployment: Deployment, seconds: float = 1.5) -> bool:
    return services.replica_loaded(hostname=worker.hostname, instance=worker.instance, deployment_id=deployment.pk,
                                   name=deployment.name, seconds=seconds)


def replicas(deployment: Deployment) -> list[tuple[str, str, str]]:
    return list(Replica.objects.filter(deployment=deployment).order_by("worker__hostname")
                .values_list("worker__hostname", "status", "trigger"))


def status(deployment: Deployment) -> tuple[str, str]:
    deployment.refresh_from_db()
    return deployment.status, deployment.status_reason


def deploy(model, **settings) -> Deployment:
    return create_deployment(organization=None, model=model, name=f"t-{uuid.uuid4().hex[:8]}", **settings)


@pytest.fixture
def queued():
    """Put requests on a deployment's queue (real Celery messages) and among its waiting requests,
    as admission does (``awaited=False``: requests given up on, whose messages are still queued);
    emptied afterwards."""
    names = []

    def put(deployment: Deployment, count: int = 1, reply: str = "", awaited: bool = True) -> None:
        names.append(deployment.name)
        for _ in range(count):
            request_id = f"req-{uuid.uuid4().hex}"
            dispatch.enqueue({"request_id": request_id, "reply_channel": reply, "deployment": {"name": deployment.name}})
            if awaited:
                fleet.client().zadd(dispatch.waiting_key(deployment.name), {request_id: int(time.time() * 1000)})

    yield put
    for name in names:
        fleet.client().delete(*fleet.queue_lists(f"deployment.{name}"), dispatch.waiting_key(name))


def test_a_new_deployment_is_placed_once_and_goes_loading_then_ready(model):
    alpha, beta = register("alpha"), register("beta")
    deployment = deploy(model)
    report = placement._tick_once(now=None)
    [(hostname, state, trigger)] = replicas(deployment)
    assert (state, trigger) == ("loading", "initial") and hostname in (alpha.hostname, beta.hostname)
    assert report.placed == [(deployment.name, hostname)]
    assert status(deployment)[0] == "loading"

    worker = alpha if hostname == alpha.hostname else beta
    assert loaded(worker, deployment) is True
    assert status(deployment) == ("ready", "")
    assert status_history(deployment=deployment) == ["loading", "ready"]
    placement._tick_once(now=None)
    assert len(replicas(deployment)) == 1  # stays one: no demand, min_replicas 0


def test_an_idle_replica_scales_to_zero_and_a_waiting_request_cold_starts_it(model, queued):
    worker = register("alpha")
    deployment = deploy(model, scale_to_zero_seconds=30)
    placement._tick_once(now=None)
    loaded(worker, deployment)
    Replica.objects.filter(deployment=deployment).update(last_active_at=timezone.now() - timedelta(seconds=10))
    placement._tick_once(now=None)
    assert replicas(deployment) != []  # idle 10 s < 30 s

    Replica.objects.filter(deployment=deployment).update(last_active_at=timezone.now() - timedelta(seconds=31))
    report = placement._tick_once(now=None)
    assert report.released == [(deployment.name, worker.hostname)] and replicas(deployment) == []
    assert status(deployment) == ("scaled_to_zero", "idle for 30s")
    placement._tick_once(now=None)
    assert replicas(deployment) == []  # nobody asks: it stays at zero

    queued(deployment, 2, awaited=False)  # their clients gave up: nobody to load the model for
    placement._tick_once(now=None)
    assert replicas(deployment) == []
    queued(deployment)
    placement._tick_once(now=None)
    assert replicas(deployment) == [(worker.hostname, "loading", "demand")]
    assert FleetEvent.objects.filter(deployment=deployment, kind="placed", cold_start=True).count() == 1
    loaded(worker, deployment, seconds=2.5)
    cold = FleetEvent.objects.get(deployment=deployment, kind="ready", cold_start=True)
    assert cold.seconds == 2.5


def test_a_busy_or_never_idle_replica_is_kept(model, queued):
    worker = register("alpha")
    keep_forever = deploy(model, scale_to_zero_seconds=0)
    busy = deploy(model, scale_to_zero_seconds=5)
    worker.slots = 2
    worker.save()
    placement._tick_once(now=None)
    for deployment in (keep_forever, busy):
        loaded(worker, deployment)
    Replica.objects.update(last_active_at=timezone.now() - timedelta(hours=1))
    Replica.objects.filter(deployment=busy).update(in_flight=1)
    placement._tick_once(now=None)
    assert len(replicas(keep_forever)) == 1 and len(replicas(busy)) == 1
    Replica.objects.filter(deployment=busy).update(in_flight=0)
    queued(busy)  # a request waits for it: not the moment to unload
    placement._tick_once(now=None)
    assert len(replicas(busy)) == 1


def test_a_minimum_of_replicas_more_than_the_workers_is_said_not_met(model):
    worker = register("only")
    deployment = create_deployment(organization=None, model=model, name=f"d-{uuid.uuid4().hex[:6]}",
                                   kind="dedicated", min_replicas=2, max_replicas=2)
    placement._tick_once(now=None)
    loaded(worker, deployment)
    placement._tick_once(now=None)
    assert status(deployment) == ("ready", "1 of its 2 replicas: each needs a worker of its own, and no other "
                                           "worker has a free slot")
    second = register("second")
    placement._tick_once(now=None)
    loaded(second, deployment)
    assert status(deployment) == ("ready", "")


def test_a_minimum_raised_on_a_ready_deployment_beyond_the_workers_is_said_not_met(model):
    worker = register("only")
    deployment = create_deployment(organization=None, model=model, name=f"d-{uuid.uuid4().hex[:6]}",
                                   kind="dedicated", min_replicas=1, max_replicas=1)
    placement._tick_once(now=None)
    loaded(worker, deployment)
    assert status(deployment) == ("ready", "")
    update_deployment(deployment=deployment, min_replicas=3, max_replicas=3)
    placement._tick_once(now=None)
    assert status(deployment)[0] == "ready" and status(deployment)[1].startswith("1 of its 3 replicas")
    update_deployment(deployment=deployment, min_replicas=1, max_replicas=1)
    placement._tick_once(now=None)
    assert status(deployment) == ("ready", "")


def test_dedicated_deployments_keep_min_replicas_spread_over_workers(model):
    workers = [register(label) for label in ("a", "b", "c")]
    deployment = create_deployment(organization=None, model=model, name=f"d-{uuid.uuid4().hex[:6]}",
                                   kind="dedicated", min_replicas=2, max_replicas=2, scale_to_zero_seconds=1)
    placement._tick_once(now=None)
    hosts = {h for h, _, _ in replicas(deployment)}
    assert len(hosts) == 2
    for worker in workers:
        if worker.hostname in hosts:
            loaded(worker, deployment)
    Replica.objects.update(last_active_at=timezone.now() - timedelta(hours=1))
    placement._tick_once(now=None)
    assert [s for _, s, _ in replicas(deployment)] == ["ready", "ready"]


def test_queue_depth_above_the_threshold_adds_replicas_up_to_the_maximum(model, queued, settings):
    settings.FLEET_SCALE_UP_QUEUE_DEPTH = 2
    workers = [register(label) for label in ("a", "b", "c")]
    deployment = deploy(model, min_replicas=1, max_replicas=2)
    placement._tick_once(now=None)
    [(first, _, _)] = replicas(deployment)
    loaded(next(w for w in workers if w.hostname == first), deployment)
    queued(deployment, 3)
    placement._tick_once(now=None)
    assert [t for _, _, t in replicas(deployment)].count("scale_up") == 1
    for worker in workers:
        if worker.hostname != first and worker.hostname in {h for h, _, _ in replicas(deployment)}:
            loaded(worker, deployment)
    queued(deployment, 5)
    placement._tick_once(now=None)
    assert len(replicas(deployment)) == 2  # max_replicas


def test_a_silent_worker_is_marked_gone_and_its_deployment_placed_again(model, settings):
    settings.FLEET_HEARTBEAT_SECONDS = 1
    settings.FLEET_MISSED_HEARTBEATS = 3
    alpha, beta = register("alpha"), register("beta")
    deployment = deploy(model, min_replicas=1)
    placement._tick_once(now=None)
    [(first, _, _)] = replicas(deployment)
    victim, survivor = (alpha, beta) if first == alpha.hostname else (beta, alpha)
    loaded(victim, deployment)
    now = timezone.now()
    beat(survivor, at=now)
    Worker.objects.filter(pk=victim.pk).update(last_heartbeat=now - timedelta(seconds=4))
    report = placement._tick_once(now=now)
    assert report.gone == [victim.hostname]
    victim.refresh_from_db()
    assert victim.status == "gone" and "no heartbeat" in victim.status_reason
    assert replicas(deployment) == [(survivor.hostname, "loading", "replace")]
    assert status_history(deployment=deployment)[-2:] == ["pending", "loading"]


def test_without_a_free_worker_the_deployment_waits_and_says_why(model):
    worker = register("alpha", slots=1)
    first, second = deploy(model), deploy(model)
    report = placement._tick_once(now=None)
    assert report.waiting_for_capacity == [second.name]
    assert status(second) == ("pending", "waiting for a worker with a free slot")
    assert replicas(first)[0][0] == worker.hostname


def test_changed_engine_settings_replace_the_replica(model):
    worker = register("alpha")
    deployment = deploy(model)
    placement._tick_once(now=None)
    loaded(worker, deployment)
    update_deployment(deployment=deployment, batch_window_ms=75)
    report = placement._tick_once(now=None)
    assert report.released == [(deployment.name, worker.hostname)]
    assert replicas(deployment) == [(worker.hostname, "loading", "replace")]


def test_stopped_and_failed_deployments_hold_no_replica_and_answer_waiting_requests(model, queued):
    worker = register("alpha", slots=2)
    stopped, failed = deploy(model), deploy(model)
    placement._tick_once(now=None)
    loaded(worker, stopped)
    set_deployment_status(deployment=stopped, status="stopped", reason="by test")
    services.replica_failed(hostname=worker.hostname, instance=worker.instance, deployment_id=failed.pk,
                            name=failed.name, error="CUDA out of memory")
    assert status(failed) == ("failed", f"the model failed to load on {worker.hostname}: CUDA out of memory")

    layer = get_channel_layer()
    reply = async_to_sync(layer.new_channel)()
    queued(stopped, reply=reply)
    placement._tick_once(now=None)
    assert replicas(stopped) == [] and replicas(failed) == []
    assert status(stopped)[0] == "stopped"
    answer = async_to_sync(layer.receive)(reply)
    assert answer["type"] == "inference.error" and answer["status"] == 503 and "stopped" in answer["message"]
    assert fleet.queue_depths([stopped.name]) == {stopped.name: 0}


def test_a_deleted_deployments_replica_is_released(model):
    worker = register("alpha")
    deployment = deploy(model)
    placement._tick_once(now=None)
    loaded(worker, deployment)
    name = deployment.name
    deployment.delete()
    assert Replica.objects.get(deployment_name=name).deployment is None
    report = placement._tick_once(now=None)
    assert report.released == [(name, worker.hostname)] and not Replica.objects.filter(deployment_name=name).exists()


def test_heartbeats_adopt_a_preloaded_deployment_and_drop_what_the_worker_no_longer_hosts(model):
    from workers.dispatch import engine_spec

    worker = register("alpha")
    deployment = deploy(model)
    report = {"state": "ready", "deployment_id": deployment.pk, "origin": "preload", "load_seconds": 3.0,
              "spec_hash": fleet.spec_hash(engine_spec(deployment)), "in_flight": 2, "last_active": 1.7e9}
    beat(worker, {deployment.name: report})
    assert replicas(deployment) == [(worker.hostname, "ready", "preload")]
    assert Replica.objects.get(deployment=deployment).in_flight == 2
    assert status(deployment)[0] == "ready"
    beat(worker, {})
    assert replicas(deployment) == []
    assert status(deployment)[0] == "pending"
    # A load that did not come from a preload is never adopted: its replica was released.
    beat(worker, {deployment.name: {**report, "origin": "initial"}})
    assert replicas(deployment) == []


def test_a_preload_adopted_while_the_pass_places_the_same_deployment_is_kept_without_an_error(model, monkeypatch,
                                                                                                caplog):
    """The race `up` meets: the pass read no replica, then the worker's heartbeat adopted its
    preload of the deployment, then the pass placed it on that worker."""
    from workers.dispatch import engine_spec

    worker = register("alpha")
    deployment = deploy(model, min_replicas=1)
    report = {"state": "ready", "deployment_id": deployment.pk, "origin": "preload", "load_seconds": 3.0,
              "spec_hash": fleet.spec_hash(engine_spec(deployment)), "in_flight": 0, "last_active": 1.7e9}
    place = services.place_replica

    def heartbeat_first(**kwargs):
        beat(worker, {deployment.name: report})
        return place(**kwargs)

    monkeypatch.setattr(placement.services, "place_replica", heartbeat_first)
    monkeypatch.setattr(placement.fleet, "send_load", lambda **kwargs: pytest.fail("nothing to load: it is loaded"))
    with caplog.at_level("ERROR", logger="workers.placement"):
        result = placement._tick_once(now=None)
    assert result.placed == [] and not caplog.records
    assert replicas(deployment) == [(worker.hostname, "ready", "preload")]
    assert status(deployment)[0] == "ready"


def test_a_restarted_worker_replaces_its_previous_process(model):
    worker = register("alpha")
    deployment = deploy(model, min_replicas=1)
    placement._tick_once(now=None)
    loaded(worker, deployment)
    services.register_worker(hostname=worker.hostname, instance="a-new-process", pid=2, device_kind="cpu",
                             device_name="cpu", device_memory_bytes=1, slots=1, queues=["default"])
    assert replicas(deployment) == []
    assert FleetEvent.objects.filter(kind="worker_gone", worker=worker.hostname, message="it restarted").exists()
    assert Worker.objects.get(hostname=worker.hostname).status == "alive"


def test_without_any_fleet_worker_the_loop_leaves_deployments_alone(model, queued):
    """Workers started with fixed queues (no slots) may serve them: nothing to place, nothing to
    mark pending. Stopped deployments still answer their waiting requests."""
    ready = deploy(model)
    set_deployment_status(deployment=ready, status="ready")
    stopped = deploy(model)
    set_deployment_status(deployment=stopped, status="stopped")
    queued(stopped)
    report = placement._tick_once(now=None)
    assert report.placed == [] and status(ready)[0] == "ready"
    assert fleet.queue_depths([stopped.name]) == {stopped.name: 0}


def test_a_stop_that_lands_between_the_loops_read_and_write_is_kept(model, monkeypatch):
    """The placement loop reads a status, then writes the one that follows from the replicas; a stop
    through the API in between must survive that write."""
    deployment = deploy(model)
    write = set_deployment_status

    def stopped_first(**kwargs):  # the API's stop commits just before the loop's write
        Deployment.objects.filter(pk=deployment.pk).update(status="stopped", status_reason="stopped through the API")
        return write(**kwargs)

    monkeypatch.setattr(services, "set_deployment_status", stopped_first)
    services.set_status(deployment=deployment, status="ready")
    deployment.refresh_from_db()
    assert (deployment.status, deployment.status_reason) == ("stopped", "stopped through the API")


def test_a_deployment_without_a_slot_takes_the_one_of_the_replica_idle_longest(model, queued, settings):
    """Only what an organization's quota reserves stays: a replica kept up by a long scale-to-zero
    time gives its slot to a deployment that has none, once idle for FLEET_EVICT_IDLE_SECONDS, and
    not while a request waits for it; one eviction per slot needed, however many passes it takes
    its worker to unload the model."""
    settings.FLEET_EVICT_IDLE_SECONDS = 60
    worker = register("alpha", slots=3)
    reserved = deploy(model, kind="dedicated", min_replicas=1, scale_to_zero_seconds=7 * 24 * 3600)
    never_idle = deploy(model, scale_to_zero_seconds=0)  # reserves its max_replicas (1)
    idler = deploy(model, scale_to_zero_seconds=7 * 24 * 3600)
    placement._tick_once(now=None)
    hosted = {}
    for deployment in (reserved, never_idle, idler):
        loaded(worker, deployment)
        hosted[deployment.name] = {"state": "ready", "origin": "initial"}
    beat(worker, hosted)
    newcomer = deploy(model)
    assert selectors.can_host(deployment_id=newcomer.pk) is False  # nothing idle long enough yet

    Replica.objects.update(last_active_at=timezone.now() - timedelta(seconds=30))
    report = placement._tick_once(now=None)
    assert report.waiting_for_capacity == [newcomer.name] and report.evicted == []  # idle 30 s < 60 s

    Replica.objects.update(last_active_at=timezone.now() - timedelta(hours=1))
    assert selectors.can_host(deployment_id=newcomer.pk)  # a request to it waits for a cold start
    queued(idler)  # a request waits for it: it stays
    assert placement._tick_once(now=None).evicted == []
    fleet.client().delete(*dispatch.queue_lists(idler.name))

    report = placement._tick_once(now=None)
    assert report.evicted == [(idler.name, worker.hostname)]  # not those the quota reserves, idle as long
    assert replicas(idler) == [] and len(replicas(reserved)) == 1 and len(replicas(never_idle)) == 1
    deployment_status, reason = status(idler)
    # Its owner reads why, not the name of the deployment that took the slot (another organization's, maybe).
    assert deployment_status == "scaled_to_zero" and reason.endswith("another deployment needed its slot")
    assert newcomer.name not in reason
    assert not FleetEvent.objects.filter(message__contains=newcomer.name).exists()
    # Its worker still holds the model (unloading): the slot is on its way, nothing else goes.
    beat(worker, {**hosted, idler.name: {"state": "unloading", "origin": "initial"}})
    assert placement._tick_once(now=None).evicted == [] and replicas(newcomer) == []
    beat(worker, {name: state for name, state in hosted.items() if name != idler.name})
    placement._tick_once(now=None)
    assert replicas(newcomer) == [(worker.hostname, "loading", "initial")]


def test_a_slot_frees_only_once_its_worker_has_let_go_of_the_model(model):
    """A model scaled to zero holds its GPU memory until its worker has drained and unloaded it:
    placing the next one there at once loaded two models into one model's memory."""
    worker = register("alpha", slots=1)
    leaving = deploy(model, scale_to_zero_seconds=30)
    placement._tick_once(now=None)
    loaded(worker, leaving)
    waiting = deploy(model, kind="dedicated", min_replicas=1)
    Replica.objects.filter(deployment=leaving).update(last_active_at=timezone.now() - timedelta(seconds=31))
    placement._tick_once(now=None)  # releases the idle one; the slot is not free in the same pass
    assert replicas(leaving) == [] and replicas(waiting) == []
    beat(worker, {leaving.name: {"state": "unloading", "origin": "initial"}})
    placement._tick_once(now=None)
    assert replicas(waiting) == []  # still unloading
    beat(worker, {})
    placement._tick_once(now=None)
    assert replicas(waiting) == [(worker.hostname, "loading", "initial")]


def test_a_worker_is_not_marked_gone_by_a_stale_read_or_while_alive_in_redis(model, settings):
    worker = register("alpha")
    stale = timezone.now() - timedelta(seconds=settings.FLEET_HEARTBEAT_SECONDS * settings.FLEET_MISSED_HEARTBEATS + 5)
    Worker.objects.filter(pk=worker.pk).update(last_heartbeat=stale)
    worker.refresh_from_db()
    beat(worker)  # a heartbeat commits after the loop read the stale one
    limit = timezone.now() - timedelta(seconds=1)
    assert services.mark_worker_gone(worker=worker, reason="no heartbeat", silent_before=limit) is None
    assert Worker.objects.get(pk=worker.pk).status == "alive"

    Worker.objects.filter(pk=worker.pk).update(last_heartbeat=stale)  # its database writes fail...
    fleet.set_alive(worker.instance, worker.hostname)  # ...but it runs
    assert services.mark_silent_workers_gone() == []
    fleet.clear_alive(worker.instance)
    assert [w.pk for w in services.mark_silent_workers_gone()] == [worker.pk]
    assert Worker.objects.get(pk=worker.pk).status == "gone"


def test_scaling_down_releases_a_replica_still_loading_before_the_one_serving(model):
    alpha, beta = register("alpha"), register("beta")
    deployment = deploy(model, kind="dedicated", min_replicas=2, max_replicas=2)
    placement._tick_once(now=None)
    [(first, _, _), (second, _, _)] = replicas(deployment)
    serving = alpha if first == alpha.hostname else beta
    loaded(serving, deployment)  # one serves, the other still loads
    update_deployment(deployment=deployment, min_replicas=1, max_replicas=1)
    placement._tick_once(now=None)
    assert [(host, state) for host, state, _ in replicas(deployment)] == [(serving.hostname, "ready")]
    assert status(deployment)[0] == "ready"


def test_a_cold_start_that_waits_for_a_slot_is_still_a_cold_start(model, queued):
    worker = register("alpha", slots=1)
    deployment = deploy(model, scale_to_zero_seconds=30)
    placement._tick_once(now=None)
    loaded(worker, deployment)
    Replica.objects.filter(deployment=deployment).update(last_active_at=timezone.now() - timedelta(seconds=31))
    placement._tick_once(now=None)
    assert status(deployment)[0] == "scaled_to_zero"
    beat(worker, {deployment.name: {"state": "unloading", "origin": "initial"}})  # still letting go
    queued(deployment)
    placement._tick_once(now=None)
    assert replicas(deployment) == [] and status(deployment) == ("scaled_to_zero", "waiting for a worker with a free slot")
    beat(worker, {})
    placement._tick_once(now=None)
    assert replicas(deployment) == [(worker.hostname, "loading", "demand")]


def test_a_preload_whose_weights_are_gone_fails_its_deployment_with_the_reason(model, tmp_path, settings):
    """`up` preloads its public deployments; one whose weights file went away must be marked failed
    (which `up` reads to stop waiting), not leave only a traceback in the worker's log."""
    from workers.agent import Agent

    settings.MODELS_ROOT = tmp_path
    (tmp_path / "gone.gguf").write_bytes(b"GGUF")
    imported = CatalogModel.objects.create(slug="gone", display_name="Gone", architecture="llama", weights_path="gone.gguf")
    deployment = create_deployment(organization=None, model=imported, name=f"t-{uuid.uuid4().hex[:8]}")
    (tmp_path / "gone.gguf").unlink()
    worker = register("alpha")
    agent = Agent()
    agent.hostname = worker.hostname
    agent._preload(deployment.name)
    state, reason = status(deployment)
    assert state == "failed" and "not found" in reason
    assert FleetEvent.objects.filter(kind="failed", deployment_name=deployment.name, worker=worker.hostname).exists()
