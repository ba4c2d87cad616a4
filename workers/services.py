"""Every write of the fleet: workers registering and beating, replicas placed, loaded, failed and
released, workers marked gone, deployment statuses that follow from all that. Keyword-only."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone as dt_timezone

from django.db import IntegrityError, transaction
from django.utils import timezone

from models_catalog.models import Deployment
from models_catalog.services import set_deployment_status

from .models import FleetEvent, Replica, Worker

log = logging.getLogger(__name__)
Status = Deployment.Status
# Report states a worker sends per deployment (see workers.agent).
HOSTED_STATES = {"loading", "ready"}


def record_event(*, kind: str, deployment: Deployment | None = None, deployment_name: str = "", worker: str = "",
                 status: str = "", cold_start: bool = False, seconds: float | None = None,
                 message: str = "") -> FleetEvent:
    return FleetEvent.objects.create(
        kind=kind, deployment=deployment, deployment_name=deployment_name or (deployment.name if deployment else ""),
        worker=worker, status=status, cold_start=cold_start, seconds=seconds, message=message[:2000],
    )


def set_status(*, deployment: Deployment, status: str, reason: str = "") -> Deployment:
    """The deployment's status, with an event when it changes. A stopped deployment stays stopped
    (only the API starts it again)."""
    current = Deployment.objects.filter(pk=deployment.pk).values_list("status", "status_reason").first()
    if current is None:
        return deployment
    if current[0] == Status.STOPPED and status != Status.STOPPED:
        deployment.status, deployment.status_reason = current
        return deployment
    if current == (status, reason):
        deployment.status, deployment.status_reason = current
        return deployment
    if not set_deployment_status(deployment=deployment, status=status, reason=reason,
                                 unless_stopped=status != Status.STOPPED):
        now = Deployment.objects.filter(pk=deployment.pk).values_list("status", "status_reason").first()
        if now is not None:  # stopped meanwhile: it stays so (None: deleted meanwhile)
            deployment.status, deployment.status_reason = now
        return deployment
    if current[0] != status:
        record_event(kind=FleetEvent.Kind.STATUS, deployment=deployment, status=status, message=reason)
    return deployment


def settle_status(*, deployment: Deployment, idle_status: str | None = None, reason: str = "") -> Deployment:
    """The status that follows from the deployment's replicas: ready if one is ready, loading if one
    loads; with none, ``idle_status`` (pending, scaled_to_zero, failed) when given, else pending for
    a deployment that claims to be ready or loading."""
    replicas = list(Replica.objects.filter(deployment=deployment).select_related("worker"))
    ready = [r for r in replicas if r.status == Replica.Status.READY]
    loading = [r for r in replicas if r.status == Replica.Status.LOADING]
    if ready:
        # One replica per worker: fewer than the minimum placed means no other worker had a slot.
        short = (f"{len(replicas)} of its {deployment.min_replicas} replicas: each needs a worker of its own, and "
                 "no other worker has a free slot")
        return set_status(deployment=deployment, status=Status.READY,
                          reason=short if len(replicas) < deployment.min_replicas else "")
    if loading:
        return set_status(deployment=deployment, status=Status.LOADING,
                          reason=f"loading on {', '.join(r.worker.hostname for r in loading)}")
    if idle_status is not None:
        return set_status(deployment=deployment, status=idle_status, reason=reason)
    if deployment.status in (Status.READY, Status.LOADING):
        return set_status(deployment=deployment, status=Status.PENDING, reason=reason or "waiting for a worker")
    return deployment


# ------------------------------------------------------------------------------------- workers


def register_worker(*, hostname: str, instance: str, pid: int, device_kind: str, device_name: str,
                    device_memory_bytes: int, slots: int, queues: list[str]) -> Worker:
    """A worker process starting. A previous process under the same name is over: what it hosted is
    placed again and its requests recovered (see ``mark_worker_gone``)."""
    now = timezone.now()
    previous = Worker.objects.filter(hostname=hostname).first()
    if previous is not None and previous.instance != instance and previous.status == Worker.Status.ALIVE:
        mark_worker_gone(worker=previous, reason="it restarted")
    worker, _ = Worker.objects.update_or_create(
        hostname=hostname,
        defaults={
            "instance": instance, "pid": pid, "device_kind": device_kind, "device_name": device_name[:200],
            "device_memory_bytes": max(0, int(device_memory_bytes)), "slots": slots, "status": Worker.Status.ALIVE,
            "status_reason": "", "started_at": now, "last_heartbeat": now, "queues": list(queues),
            "queue_depths": {}, "engine_stats": {},
        },
    )
    return worker


def record_heartbeat(*, hostname: str, instance: str, queues: list[str], queue_depths: dict[str, int],
                     deployments: dict[str, dict], now: datetime | None = None) -> Worker | None:
    """A worker's heartbeat: what it consumes and hosts, its engines' figures. Keeps the replicas in
    step with the worker's own report. None when the worker is not registered (it registers again)."""
    now = now or timezone.now()
    with transaction.atomic():
        worker = Worker.objects.select_for_update().filter(hostname=hostname, instance=instance).first()
        if worker is None:
            return None
        revived = worker.status == Worker.Status.GONE
        worker.status, worker.status_reason = Worker.Status.ALIVE, ""
        worker.last_heartbeat = now
        worker.queues = list(queues)
        worker.queue_depths = dict(queue_depths)
        worker.engine_stats = dict(deployments)
        worker.save(update_fields=["status", "status_reason", "last_heartbeat", "queues", "queue_depths",
                                   "engine_stats"])
    if revived:
        log.warning("worker %s answered again after it was marked gone", hostname)
    _reconcile_replicas(worker=worker, deployments=deployments, now=now)
    return worker


def _when(timestamp) -> datetime | None:
    try:
        return datetime.fromtimestamp(float(timestamp), tz=dt_timezone.utc) if timestamp else None
    except (TypeError, ValueError, OverflowError):
        return None


def _reconcile_replicas(*, worker: Worker, deployments: dict[str, dict], now: datetime) -> None:
    from .dispatch import engine_spec
    from .fleet import spec_hash

    replicas = {r.deployment_name: r for r in Replica.objects.filter(worker=worker).select_related("deployment")}
    touched: set[int] = set()
    for name, replica in replicas.items():
        report = deployments.get(name)
        state = (report or {}).get("state")
        if state in HOSTED_STATES:
            changes = {"in_flight": int(report.get("in_flight") or 0)}
            if _when(report.get("last_active")):
                changes["last_active_at"] = _when(report["last_active"])
            if state == "ready" and replica.status == Replica.Status.LOADING:
                changes.update(status=Replica.Status.READY, ready_at=now,
                               load_seconds=report.get("load_seconds"))
                if replica.deployment_id:
                    touched.add(replica.deployment_id)
            Replica.objects.filter(pk=replica.pk).update(**changes)
        elif replica.status == Replica.Status.READY or state in ("failed", "unloading"):
            # The worker no longer hosts it (it unloaded, or failed): the replica is over.
            replica.delete()
            if replica.deployment_id:
                touched.add(replica.deployment_id)
        # A loading replica the worker does not mention yet: the placement loop re-sends the load.
    free = worker.slots - Replica.objects.filter(worker=worker).count()
    for name, report in deployments.items():
        # Only a preload is adopted: any other load was placed, and its replica, now gone, released.
        if name in replicas or report.get("state") not in HOSTED_STATES or report.get("origin") != "preload" \
                or free <= 0:
            continue
        deployment = Deployment.objects.filter(pk=report.get("deployment_id"), name=name).select_related("model").first()
        if deployment is None or deployment.status in (Status.STOPPED, Status.FAILED):
            continue
        if report.get("spec_hash") != spec_hash(engine_spec(deployment)):
            continue
        ready = report.get("state") == "ready"
        Replica.objects.create(
            worker=worker, deployment=deployment, deployment_name=name,
            status=Replica.Status.READY if ready else Replica.Status.LOADING, trigger=Replica.Trigger.PRELOAD,
            spec_hash=report["spec_hash"], assigned_at=now, ready_at=now if ready else None,
            load_seconds=report.get("load_seconds"), last_active_at=_when(report.get("last_active")) or now,
            in_flight=int(report.get("in_flight") or 0),
        )
        free -= 1
        touched.add(deployment.pk)
    for deployment in Deployment.objects.filter(pk__in=touched):
        settle_status(deployment=deployment)


def mark_worker_gone(*, worker: Worker, reason: str,
                     silent_before: datetime | None = None) -> dict[str, list[tuple[str, str]]] | None:
    """The worker stopped (no heartbeats, a restart, or a clean shutdown): its replicas end, the
    deployments they served are placed again, and the requests it held are recovered: redelivered
    when the client saw nothing of them yet, failed with a clear error when it did. With
    ``silent_before``, only if its last heartbeat is still older than that (one may have committed
    since it was read). None when it was not marked (already gone, or it beat meanwhile)."""
    from .fleet import clear_alive, recover_requests

    with transaction.atomic():
        rows = Worker.objects.filter(pk=worker.pk, instance=worker.instance, status=Worker.Status.ALIVE)
        if silent_before is not None:
            rows = rows.filter(last_heartbeat__lt=silent_before)
        updated = rows.update(status=Worker.Status.GONE, status_reason=reason)
        if not updated:
            return None
        replicas = list(Replica.objects.filter(worker=worker).select_related("deployment"))
        Replica.objects.filter(worker=worker).delete()
        record_event(kind=FleetEvent.Kind.WORKER_GONE, worker=worker.hostname, message=reason)
    clear_alive(worker.instance)
    try:
        recovered = recover_requests(instance=worker.instance, reason=f"{worker.hostname}: {reason}")
    except Exception:
        log.exception("could not recover the requests of %s", worker.hostname)
        recovered = {"redelivered": [], "interrupted": []}
    names = {name for pairs in recovered.values() for _, name in pairs}
    by_name = {d.name: d for d in Deployment.objects.filter(name__in=names)}
    for kind, key in ((FleetEvent.Kind.REDELIVERED, "redelivered"), (FleetEvent.Kind.INTERRUPTED, "interrupted")):
        for request_id, name in recovered[key]:
            record_event(kind=kind, deployment=by_name.get(name), deployment_name=name, worker=worker.hostname,
                         message=request_id)
    for replica in replicas:
        if replica.deployment is not None:
            settle_status(deployment=replica.deployment, idle_status=Status.PENDING,
                          reason=f"its worker {worker.hostname} is gone ({reason}); placing it again")
    return recovered


def mark_silent_workers_gone(*, now: datetime | None = None) -> list[Worker]:
    """Workers whose last heartbeat is older than FLEET_MISSED_HEARTBEATS intervals."""
    from django.conf import settings

    from .fleet import instance_alive

    now = now or timezone.now()
    limit = timedelta(seconds=settings.FLEET_HEARTBEAT_SECONDS * settings.FLEET_MISSED_HEARTBEATS)
    silent = list(Worker.objects.filter(status=Worker.Status.ALIVE, last_heartbeat__lt=now - limit))
    gone = []
    for worker in silent:
        quiet_s = (now - worker.last_heartbeat).total_seconds()
        if instance_alive(worker.instance):
            # Its liveness key in Redis is fresh: it runs, but its heartbeats do not reach the
            # database. Marking it gone would run its requests a second time elsewhere.
            log.warning("%s has written no heartbeat for %.0fs but is alive in Redis: kept", worker.hostname, quiet_s)
            continue
        if mark_worker_gone(worker=worker, silent_before=now - limit, reason=f"no heartbeat for {quiet_s:.0f}s") is not None:
            gone.append(worker)
    return gone


# ------------------------------------------------------------------------------------ replicas


def place_replica(*, worker: Worker, deployment: Deployment, trigger: str, spec_hash: str) -> Replica | None:
    """A new replica of ``deployment`` on ``worker``; None when the worker got one meanwhile (its
    heartbeat adopted a preload of it between the placement pass's read and this write)."""
    now = timezone.now()
    try:
        with transaction.atomic():
            replica = Replica.objects.create(
                worker=worker, deployment=deployment, deployment_name=deployment.name, status=Replica.Status.LOADING,
                trigger=trigger, spec_hash=spec_hash, assigned_at=now, last_active_at=now,
            )
    except IntegrityError:
        if Replica.objects.filter(worker=worker, deployment_name=deployment.name).exists():
            return None
        raise
    record_event(kind=FleetEvent.Kind.PLACED, deployment=deployment, worker=worker.hostname,
                 cold_start=trigger == Replica.Trigger.DEMAND, message=trigger)
    settle_status(deployment=deployment)
    return replica


def replica_loaded(*, hostname: str, instance: str, deployment_id: int, name: str, seconds: float,
                   spec_hash: str | None = None) -> bool:
    """A worker loaded a deployment (with the settings ``spec_hash`` names) and consumes its queue.
    False: no replica wants it any more (released meanwhile, the worker was marked gone, or the
    replica is for other settings): the worker should unload it."""
    now = timezone.now()
    replicas = Replica.objects.filter(worker__hostname=hostname, worker__instance=instance,
                                      worker__status=Worker.Status.ALIVE, deployment_id=deployment_id,
                                      deployment_name=name)
    if spec_hash is not None:
        replicas = replicas.filter(spec_hash=spec_hash)
    replica = replicas.select_related("deployment").first()
    if replica is None:
        return False
    if replica.status != Replica.Status.READY:
        Replica.objects.filter(pk=replica.pk).update(status=Replica.Status.READY, ready_at=now, load_seconds=seconds,
                                                     last_active_at=now)
        record_event(kind=FleetEvent.Kind.READY, deployment=replica.deployment, worker=hostname, seconds=seconds,
                     cold_start=replica.trigger == Replica.Trigger.DEMAND, message=replica.trigger)
    settle_status(deployment=replica.deployment)
    return True


def replica_failed(*, hostname: str, instance: str, deployment_id: int, name: str, error: str) -> None:
    """A worker could not load a deployment: the replica ends and, with no other replica up, the
    deployment is failed with the reason (it is placed again once its settings change)."""
    replica = (Replica.objects.filter(worker__hostname=hostname, worker__instance=instance,
                                      deployment_id=deployment_id, deployment_name=name)
               .select_related("deployment").first())
    deployment = Deployment.objects.filter(pk=deployment_id).first()
    if replica is not None:
        replica.delete()
    record_event(kind=FleetEvent.Kind.FAILED, deployment=deployment, deployment_name=name, worker=hostname,
                 message=error)
    if deployment is not None:
        settle_status(deployment=deployment, idle_status=Status.FAILED,
                      reason=f"the model failed to load on {hostname}: {error}"[:2000])


def release_replica(*, replica: Replica, reason: str, idle_status: str | None = None) -> None:
    """End a replica: its worker stops consuming the queue and unloads once its requests are done."""
    from .fleet import send_release

    Replica.objects.filter(pk=replica.pk).delete()
    try:
        send_release(hostname=replica.worker.hostname, name=replica.deployment_name)
    except Exception:
        log.exception("could not tell %s to release %s", replica.worker.hostname, replica.deployment_name)
    record_event(kind=FleetEvent.Kind.RELEASED, deployment=replica.deployment, deployment_name=replica.deployment_name,
                 worker=replica.worker.hostname, message=reason)
    if replica.deployment is not None:
        settle_status(deployment=replica.deployment, idle_status=idle_status, reason=reason if idle_status else "")


def worker_stopped(*, hostname: str, instance: str) -> None:
    """A clean shutdown: Celery finished or handed back the requests it held."""
    worker = Worker.objects.filter(hostname=hostname, instance=instance).first()
    if worker is not None:
        mark_worker_gone(worker=worker, reason="it shut down")
