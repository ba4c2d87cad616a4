"""The placement loop: one pass (``tick``) decides, for every deployment, how many replicas it needs
and where, and tells the workers through Celery's remote control.

Run by Celery beat every FLEET_TICK_SECONDS (the ``workers.fleet_tick`` task on the ``default``
queue), and at once when something changes (a deployment saved or deleted, a request to a
deployment that has no replica). A Redis lock keeps it to one pass at a time across the fleet.

Per pass:
1. workers silent for FLEET_MISSED_HEARTBEATS heartbeats are marked gone; what they hosted is
   placed again and the requests they held are recovered (``services.mark_worker_gone``);
2. per deployment, the replicas wanted:
   - none for a stopped or failed one (its waiting requests get a clear error);
   - at least ``min_replicas`` (dedicated deployments have one at least);
   - one for a deployment that was just created or lost its worker (status pending), and one for
     a scaled-to-zero deployment with a request waiting (a cold start);
   - one more, up to ``max_replicas``, while more than FLEET_SCALE_UP_QUEUE_DEPTH requests per
     ready replica wait;
   - fewer when a replica of it has served nothing for ``scale_to_zero_seconds`` (0: never), down
     to ``min_replicas``; at none, the deployment is scaled to zero;
3. new replicas go to the alive workers with a free slot, least busy first; a replica loaded with
   other settings than the deployment's current ones is replaced;
4. a deployment with no replica and no free slot anywhere takes one from the replica idle longest
   (for FLEET_EVICT_IDLE_SECONDS at least) among those above what their deployment reserves (what
   the organization's quota counts) and with no request waiting: no organization keeps the fleet's
   slots from others by idling (its deployment cold-starts again when next called).
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from models_catalog.errors import CatalogError
from models_catalog.models import Deployment

from . import fleet, selectors, services
from .dispatch import engine_spec
from .models import Replica, Worker

log = logging.getLogger(__name__)
Status = Deployment.Status
Trigger = Replica.Trigger


@dataclass
class TickReport:
    gone: list[str] = field(default_factory=list)
    placed: list[tuple[str, str]] = field(default_factory=list)  # (deployment, worker)
    released: list[tuple[str, str]] = field(default_factory=list)
    waiting_for_capacity: list[str] = field(default_factory=list)
    evicted: list[tuple[str, str]] = field(default_factory=list)  # (deployment, worker)


def tick(*, now: datetime | None = None) -> TickReport | None:
    """One placement pass; None when another pass holds the lock (it will run once more)."""
    with fleet.TickLock() as lock:
        if not lock.acquired:
            return None
        report = _tick_once(now=now)
        for _ in range(3):
            if not lock.again():
                break
            report = _tick_once(now=None)
        return report


def _tick_once(*, now: datetime | None) -> TickReport:
    now = now or timezone.now()
    report = TickReport()
    report.gone = [w.hostname for w in services.mark_silent_workers_gone(now=now)]

    workers = {w.pk: w for w in Worker.objects.filter(status=Worker.Status.ALIVE)}
    replicas = [r for r in Replica.objects.select_related("worker", "deployment") if r.worker_id in workers]
    deployments = list(Deployment.objects.select_related("model"))
    live_names = {d.name for d in deployments}
    depths = fleet.queue_depths(live_names | {r.deployment_name for r in replicas})
    engine_waiting: dict[str, int] = defaultdict(int)
    for worker in workers.values():
        for name, hosted in (worker.engine_stats or {}).items():
            engine_waiting[name] += int((hosted.get("engine") or {}).get("waiting") or 0)
    awaited = fleet.waiting_counts(live_names)
    demand = {name: fleet.awaited_depth(queued=depths.get(name, 0), engine_waiting=engine_waiting.get(name, 0),
                                        awaited=awaited.get(name, 0))
              for name in live_names}

    # Replicas whose deployment was deleted: tell waiting clients, stop consuming, unload when done.
    for replica in [r for r in replicas if r.deployment_id is None]:
        if replica.deployment_name not in live_names and depths.get(replica.deployment_name):
            fleet.fail_queued(replica.deployment_name, message=f"The deployment '{replica.deployment_name}' was deleted.",
                              code="model_not_found", status=404)
        services.release_replica(replica=replica, reason="the deployment was deleted")
        report.released.append((replica.deployment_name, replica.worker.hostname))
    replicas = [r for r in replicas if r.deployment_id is not None]

    _release_unowned(workers.values(), replicas)
    used = _slots_used(workers.values(), replicas)
    by_deployment: dict[int, list[Replica]] = defaultdict(list)
    for replica in replicas:
        by_deployment[replica.deployment_id].append(replica)

    # Dedicated deployments first: they are promised their replicas. With no fleet worker at all,
    # the fleet manages nothing (workers started with fixed queues may serve): only stopped and
    # failed deployments are looked after.
    order = sorted(deployments, key=lambda d: (d.kind != Deployment.Kind.DEDICATED, d.created_at))
    if not workers:
        order = [d for d in order if d.status in (Status.STOPPED, Status.FAILED)]
    for deployment in order:
        mine = by_deployment.get(deployment.pk, [])
        try:
            _place_deployment(deployment, mine, demand[deployment.name], queued=depths.get(deployment.name, 0), workers=workers,
                              used=used, now=now, report=report)
        except Exception:  # one deployment's trouble must not stop the fleet's pass
            log.exception("placing %s failed; the next pass tries again", deployment.name)
    if report.waiting_for_capacity:
        _evict_idle(report, busy={name for name, count in demand.items() if count}, now=now)
    return report


def _evict_idle(report: TickReport, *, busy: set[str], now: datetime) -> None:
    """Free a slot for each deployment waiting for one: release the replica idle longest among
    those that may go. Its slot frees once its worker has unloaded it, for a later pass: slots
    being freed so (engines still reported without a replica) count, so as not to evict again."""
    alive = list(Worker.objects.filter(status=Worker.Status.ALIVE))
    placed = list(Replica.objects.filter(worker__in=alive))
    needing = report.waiting_for_capacity[len(_unowned(alive, placed)):]
    candidates = [r for r in selectors.evictable_replicas(now=now)
                  if r.deployment_name not in busy and r.deployment_name not in report.waiting_for_capacity]
    left = Counter(r.deployment_id for r in placed if r.deployment_id is not None)
    for name, replica in zip(needing, candidates):
        left[replica.deployment_id] -= 1
        idle = int((now - (replica.last_active_at or replica.assigned_at)).total_seconds())
        # Its owner reads the reason: the deployment that needed the slot may be another organization's.
        log.info("evicting %s from %s after %ds idle: %s needed its slot", replica.deployment_name,
                 replica.worker.hostname, idle, name)
        services.release_replica(
            replica=replica, reason=f"evicted after {idle}s idle: another deployment needed its slot",
            idle_status=Status.SCALED_TO_ZERO if left[replica.deployment_id] == 0 else None)
        report.evicted.append((replica.deployment_name, replica.worker.hostname))


HOLDING = ("loading", "ready", "unloading")  # an engine in these states holds its worker's memory


def _unowned(workers, replicas, states=HOLDING) -> list[tuple[Worker, str]]:
    """(worker, deployment name) of the engines the workers report in ``states`` that no replica
    stands for: released (still draining or unloading), or a preload nobody adopted."""
    owned = {(r.worker_id, r.deployment_name) for r in replicas}
    return [(worker, name) for worker in workers for name, hosted in (worker.engine_stats or {}).items()
            if hosted.get("state") in states and (worker.pk, name) not in owned]


def _slots_used(workers, replicas) -> dict[int, int]:
    """Slots taken per worker: its replicas, and what it still reports hosting without one (a
    released deployment that is still draining or unloading holds its memory until it is gone, so
    its slot frees only once the worker says so; a release in this pass frees nothing either)."""
    used = defaultdict(int)
    for replica in replicas:
        used[replica.worker_id] += 1
    for worker, _ in _unowned(workers, replicas):
        used[worker.pk] += 1
    return used


def _release_unowned(workers, replicas) -> None:
    """A worker hosting a deployment that no replica of it stands for (released while a heartbeat
    was on its way, or a preload nobody adopted): tell it again to let go."""
    for worker, name in _unowned(workers, replicas, states=("loading", "ready")):
        try:
            fleet.send_release(hostname=worker.hostname, name=name)
        except Exception:
            log.exception("could not tell %s to release %s", worker.hostname, name)


def _wanted(deployment: Deployment, mine: list[Replica], depth: int, *, replaced: bool) -> tuple[int, str]:
    """How many replicas the deployment should have, and why a new one would be added."""
    ready = [r for r in mine if r.status == Replica.Status.READY]
    need, trigger = deployment.min_replicas, Trigger.MIN_REPLICAS
    if not mine:
        if deployment.status == Status.SCALED_TO_ZERO and depth > 0:
            need, trigger = max(need, 1), Trigger.DEMAND
        elif deployment.status in (Status.PENDING, Status.READY, Status.LOADING):
            # New, or it lost its worker, or its settings changed: it comes up once.
            lost = replaced or "is gone" in deployment.status_reason
            need, trigger = max(need, 1), (Trigger.REPLACE if lost else Trigger.INITIAL)
    elif depth > settings.FLEET_SCALE_UP_QUEUE_DEPTH * max(1, len(ready)) and len(ready) == len(mine):
        need, trigger = max(need, len(mine) + 1), Trigger.SCALE_UP
    else:
        need = max(need, min(len(mine), _busy_floor(deployment, mine, depth)))
    return min(need, deployment.max_replicas), trigger


def _busy_floor(deployment: Deployment, mine: list[Replica], depth: int) -> int:
    """The replicas that must stay: all of them while requests wait or the deployment never scales
    down; otherwise those that served something within its idle time."""
    if depth > 0 or deployment.scale_to_zero_seconds == 0:
        return len(mine)
    limit = timezone.now() - timedelta(seconds=deployment.scale_to_zero_seconds)
    return sum(1 for r in mine if r.status != Replica.Status.READY or r.in_flight > 0
               or (r.last_active_at or r.assigned_at) > limit)


def _place_deployment(deployment: Deployment, mine: list[Replica], depth: int, *, queued: int, workers: dict,
                      used: dict, now: datetime, report: TickReport) -> None:
    if deployment.status in (Status.STOPPED, Status.FAILED):
        for replica in mine:
            services.release_replica(replica=replica, reason=f"the deployment is {deployment.status}")
            report.released.append((deployment.name, replica.worker.hostname))
        if queued:
            what = "is stopped" if deployment.status == Status.STOPPED else f"failed: {deployment.status_reason}"
            fleet.fail_queued(deployment.name, message=f"The deployment '{deployment.name}' {what}",
                              code="model_unavailable" if deployment.status == Status.STOPPED else "model_load_failed")
        return

    try:
        spec = engine_spec(deployment)
    except CatalogError as exc:  # its weights are gone: nothing can load it
        for replica in mine:
            services.release_replica(replica=replica, reason=exc.message)
        services.settle_status(deployment=deployment, idle_status=Status.FAILED, reason=exc.message)
        if queued:
            fleet.fail_queued(deployment.name, message=f"The deployment '{deployment.name}' failed: {exc.message}",
                              code="model_load_failed")
        return
    current = fleet.spec_hash(spec)
    stale = [r for r in mine if r.spec_hash != current]
    swapping = set()  # workers whose slot this deployment's replacement may take: swapped in place
    for replica in stale:
        services.release_replica(replica=replica, reason="its settings changed")
        swapping.add(replica.worker_id)
        report.released.append((deployment.name, replica.worker.hostname))
    mine = [r for r in mine if r.spec_hash == current]
    if _check_loading(deployment, mine, spec, now=now):
        deployment.refresh_from_db(fields=["status", "status_reason"])
        if deployment.status == Status.FAILED:
            return
        mine = list(Replica.objects.filter(pk__in=[r.pk for r in mine]).select_related("worker"))

    wanted, trigger = _wanted(deployment, mine, depth, replaced=bool(stale))
    if len(mine) < wanted:
        hosting = {r.worker_id for r in mine}
        candidates = sorted(
            (w for w in workers.values() if w.pk not in hosting and (used[w.pk] < w.slots or w.pk in swapping)),
            key=lambda w: (w.pk not in swapping, used[w.pk] / max(1, w.slots), used[w.pk], -w.device_memory_bytes,
                           w.hostname),
        )
        for worker in candidates[: wanted - len(mine)]:
            if services.place_replica(worker=worker, deployment=deployment, trigger=trigger, spec_hash=current) is None:
                continue  # the worker's preload of it was adopted meanwhile: that replica stands
            if worker.pk in swapping:  # the slot of the engine it replaces (the worker unloads it first)
                swapping.discard(worker.pk)
            else:  # a released engine elsewhere keeps its slot until its worker reports it gone
                used[worker.pk] += 1
            try:
                fleet.send_load(hostname=worker.hostname, spec=spec, trigger=trigger)
            except Exception:
                log.exception("could not ask %s to load %s", worker.hostname, deployment.name)
            report.placed.append((deployment.name, worker.hostname))
        if not mine and not candidates:
            report.waiting_for_capacity.append(deployment.name)
            # A scaled-to-zero deployment stays so while it waits (a slot frees once its worker
            # reports the model it released gone): its load is then still a cold start on demand.
            waiting = Status.SCALED_TO_ZERO if deployment.status == Status.SCALED_TO_ZERO else Status.PENDING
            services.settle_status(deployment=deployment, idle_status=waiting,
                                   reason="waiting for a worker with a free slot")
        elif mine:  # serving: its reason says whether its minimum is met (raised beyond the workers, say)
            services.settle_status(deployment=deployment)
    elif len(mine) > wanted:
        ready = [r for r in mine if r.status == Replica.Status.READY]
        idle = sorted((r for r in ready if r.in_flight == 0), key=lambda r: r.last_active_at or r.assigned_at)
        # While one serves, a replica still loading goes first: releasing the serving one instead
        # left the deployment loading until the other finished.
        loading = sorted((r for r in mine if r.status == Replica.Status.LOADING), key=lambda r: r.assigned_at,
                         reverse=True) if ready else []
        for replica in (loading + idle)[: len(mine) - wanted]:
            left = len(mine) - 1
            why = "not needed any more" if replica.status == Replica.Status.LOADING else \
                f"idle for {deployment.scale_to_zero_seconds}s"
            services.release_replica(
                replica=replica, reason=why,
                idle_status=Status.SCALED_TO_ZERO if left == 0 else None,
            )
            mine.remove(replica)  # its slot frees once the worker reports the unload (see _slots_used)
            report.released.append((deployment.name, replica.worker.hostname))
    else:
        services.settle_status(deployment=deployment)


def _check_loading(deployment: Deployment, mine: list[Replica], spec: dict, *, now: datetime) -> bool:
    """Loads that never started (the command was lost) are asked again; loads that take longer than
    FLEET_LOAD_TIMEOUT fail. True when one failed."""
    beat = timedelta(seconds=settings.FLEET_HEARTBEAT_SECONDS)
    failed = False
    for replica in mine:
        if replica.status != Replica.Status.LOADING:
            continue
        worker = replica.worker
        if now - replica.assigned_at > timedelta(seconds=settings.FLEET_LOAD_TIMEOUT):
            services.replica_failed(hostname=worker.hostname, instance=worker.instance,
                                    deployment_id=deployment.pk, name=deployment.name,
                                    error=f"it did not finish loading within {settings.FLEET_LOAD_TIMEOUT:g}s")
            fleet.send_release(hostname=worker.hostname, name=deployment.name)
            failed = True
        elif (deployment.name not in (worker.engine_stats or {})
              and worker.last_heartbeat - replica.assigned_at > 2 * beat):
            log.info("asking %s again to load %s", worker.hostname, deployment.name)
            fleet.send_load(hostname=worker.hostname, spec=spec, trigger=replica.trigger)
    return failed
