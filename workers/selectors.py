"""Reads of the fleet: workers and what they host, capacity, and a deployment's live figures.

Request figures (requests per minute, tokens per second, latency percentiles, batch size) come
from the workers' heartbeats: each worker reports its last minute per deployment, and these
functions add them up over the alive workers. They are therefore live (a heartbeat old at most)
and need nothing but this app; billing's usage records remain the exact, long-term account.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, F, QuerySet
from django.utils import timezone
from redis.exceptions import RedisError

from models_catalog.models import Deployment

from .models import FleetEvent, Replica, Worker

log = logging.getLogger(__name__)


def workers(*, include_gone: bool = True) -> QuerySet[Worker]:
    queryset = Worker.objects.prefetch_related("replicas").order_by("status", "hostname")
    if not include_gone:
        queryset = queryset.filter(status=Worker.Status.ALIVE)
    return queryset


def can_host(*, deployment_id: int) -> bool:
    """Whether the fleet can serve the deployment soon: a replica of it exists, or an alive worker
    has a free slot, or an idle replica may give it its slot."""
    if Replica.objects.filter(deployment_id=deployment_id, worker__status=Worker.Status.ALIVE).exists():
        return True
    return (Worker.objects.filter(status=Worker.Status.ALIVE)
            .annotate(used=Count("replicas")).filter(used__lt=F("slots")).exists()
            or bool(evictable_replicas(now=timezone.now())))


def evictable_replicas(*, now: datetime) -> list[Replica]:
    """Replicas that may give their slot to a deployment that has none, idle longest first: ready,
    nothing in flight for FLEET_EVICT_IDLE_SECONDS, and above what their deployment reserves
    (``Deployment.reserved_replicas``: an organization's quota counts those, so they stay)."""
    placed = list(Replica.objects.filter(worker__status=Worker.Status.ALIVE, deployment__isnull=False)
                  .select_related("worker", "deployment"))
    left = Counter(r.deployment_id for r in placed)
    idle_since = now - timedelta(seconds=settings.FLEET_EVICT_IDLE_SECONDS)
    evictable = []
    for replica in sorted(placed, key=lambda r: r.last_active_at or r.assigned_at):
        if (replica.status == Replica.Status.READY and replica.in_flight == 0
                and (replica.last_active_at or replica.assigned_at) <= idle_since
                and left[replica.deployment_id] > replica.deployment.reserved_replicas):
            evictable.append(replica)
            left[replica.deployment_id] -= 1
    return evictable


def percentile(values: list[float], fraction: float) -> float | None:
    """The nearest-rank percentile (``fraction`` in 0..1) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return float(ordered[rank - 1])


@dataclass
class DeploymentFigures:
    replicas_ready: int
    replicas_loading: int
    workers: list[str]
    queue_depth: int | None  # None while Redis can't be reached
    in_flight: int
    requests_per_minute: float
    tokens_per_second: float
    prompt_tokens_per_second: float
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    ttft_p50_ms: float | None
    average_batch_size: float | None
    failed_per_minute: float
    cold_starts_24h: int
    cold_starts_total: int
    last_cold_start_seconds: float | None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def deployment_figures(*, deployment: Deployment, now: datetime | None = None, alive: list[Worker] | None = None,
                       depths: dict[str, tuple[int, int]] | None = None) -> DeploymentFigures:
    """The deployment's figures over the last minute, summed over the alive workers hosting it."""
    now = now or timezone.now()
    if alive is None:
        alive = list(Worker.objects.filter(status=Worker.Status.ALIVE))
    if depths is None:
        depths = _queue_depths([deployment.name])
    replicas = Replica.objects.filter(deployment=deployment, worker__status=Worker.Status.ALIVE)
    ready = replicas.filter(status=Replica.Status.READY).count()
    loading = replicas.filter(status=Replica.Status.LOADING).count()
    requests = failed = completion = prompt = steps = generated = in_flight = waiting = 0
    latencies: list[float] = []
    ttfts: list[float] = []
    window = 60.0
    hosts = []
    for worker in alive:
        hosted = (worker.engine_stats or {}).get(deployment.name)
        if not hosted or (hosted.get("deployment_id") not in (None, deployment.pk)):
            continue
        hosts.append(worker.hostname)
        window = float(hosted.get("window_s") or window)
        requests += int(hosted.get("requests") or 0)
        failed += int(hosted.get("failed") or 0)
        completion += int(hosted.get("completion_tokens") or 0)
        prompt += int(hosted.get("prompt_tokens") or 0)
        steps += int(hosted.get("steps") or 0)
        generated += int(hosted.get("generated_tokens") or 0)
        in_flight += int(hosted.get("in_flight") or 0)
        waiting += int((hosted.get("engine") or {}).get("waiting") or 0)
        latencies.extend(v for v in hosted.get("latencies_ms") or [] if isinstance(v, (int, float)))
        ttfts.extend(v for v in hosted.get("ttft_ms") or [] if isinstance(v, (int, float)))
    colds = FleetEvent.objects.filter(deployment=deployment, kind=FleetEvent.Kind.READY, cold_start=True)
    last_cold = colds.order_by("-created_at").values_list("seconds", flat=True).first()
    return DeploymentFigures(
        replicas_ready=ready,
        replicas_loading=loading,
        workers=sorted(hosts),
        queue_depth=_queue_depth(depths, deployment.name, engine_waiting=waiting),
        in_flight=in_flight,
        requests_per_minute=_round(requests * 60.0 / window),
        tokens_per_second=_round(completion / window),
        prompt_tokens_per_second=_round(prompt / window),
        latency_p50_ms=_round(percentile(latencies, 0.5), 1),
        latency_p99_ms=_round(percentile(latencies, 0.99), 1),
        ttft_p50_ms=_round(percentile(ttfts, 0.5), 1),
        average_batch_size=_round(generated / steps) if steps else None,
        failed_per_minute=_round(failed * 60.0 / window),
        cold_starts_24h=colds.filter(created_at__gte=now - timedelta(hours=24)).count(),
        cold_starts_total=colds.count(),
        last_cold_start_seconds=_round(last_cold, 3),
    )


def all_deployment_figures(*, now: datetime | None = None) -> list[tuple[Deployment, DeploymentFigures]]:
    """Every deployment with its figures (for Prometheus), with one read of the workers and queues."""
    deployments = list(Deployment.objects.select_related("organization", "model").order_by("name"))
    alive = list(Worker.objects.filter(status=Worker.Status.ALIVE))
    depths = _queue_depths([d.name for d in deployments])
    return [(d, deployment_figures(deployment=d, now=now, alive=alive, depths=depths)) for d in deployments]


UNKNOWN_DEPTHS: dict[str, tuple[int, int]] = {}  # Redis unreachable: the queue depths are not known


def _queue_depths(names: list[str]) -> dict[str, tuple[int, int]]:
    """Per deployment, the messages on its queue and the requests someone still waits for; or
    ``UNKNOWN_DEPTHS`` while Redis can't be reached: the figures from the database still count (a
    scrape during an incident is when they matter)."""
    from . import fleet

    try:
        messages, awaited = fleet.queue_depths(names), fleet.waiting_counts(names)
    except (RedisError, OSError) as exc:
        log.warning("queue depths unknown, Redis unreachable: %s", exc)
        return UNKNOWN_DEPTHS
    return {name: (messages.get(name, 0), awaited.get(name, 0)) for name in names}


def _queue_depth(depths: dict[str, tuple[int, int]], name: str, *, engine_waiting: int) -> int | None:
    if depths is UNKNOWN_DEPTHS:
        return None
    from . import fleet

    messages, awaited = depths.get(name, (0, 0))
    return fleet.awaited_depth(queued=messages, engine_waiting=engine_waiting, awaited=awaited)


def events(*, deployment: Deployment | None = None, kinds: list[str] | None = None, limit: int = 50) -> list[FleetEvent]:
    queryset = FleetEvent.objects.all()
    if deployment is not None:
        queryset = queryset.filter(deployment=deployment)
    if kinds:
        queryset = queryset.filter(kind__in=kinds)
    return list(queryset.order_by("-created_at", "-id")[:limit])


def status_history(*, deployment: Deployment) -> list[str]:
    """The statuses the fleet moved the deployment through, oldest first."""
    return list(FleetEvent.objects.filter(deployment=deployment, kind=FleetEvent.Kind.STATUS)
                .order_by("created_at", "id").values_list("status", flat=True))


def replicas_of(*, deployment: Deployment) -> QuerySet[Replica]:
    return Replica.objects.filter(deployment=deployment).select_related("worker").order_by("worker__hostname")
