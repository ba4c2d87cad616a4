"""Reserved capacity, metered by the minute for billing.

Replicas an organization keeps up cost the operator a GPU whether or not they are called, so they
are billed by the hour (``Deployment.replicas_billed_hourly`` says which): each minute, the
seconds its billed replicas were ready become one usage event of the deployment (``replica_seconds``,
no tokens, ``endpoint`` "reserved capacity"), priced at the catalog model's price per replica-hour.

A replica row is ready from its ``ready_at`` until it is released (the row goes), and held no later
than its worker's last heartbeat (and one interval): a worker that died is not billed for the
heartbeats it missed before it is marked gone. So the replicas ready now tell the minutes since
their ``ready_at``: a meter that missed minutes (beat down, a slow pass) bills them later for the
replicas still up then, back to CATCH_UP at most, at the price then. A replica released within a
minute, or during such a gap, is not billed for that part: never more than was held. A minute is
metered once SETTLE after its end, so that a worker's clock a little ahead does not bill seconds
not reached yet. Each event's id is the deployment's and the minute's, so a minute metered twice
is billed once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Callable

from django.conf import settings
from django.utils import timezone as django_timezone

from models_catalog.models import Deployment

from . import fleet
from .models import Replica, Worker

log = logging.getLogger(__name__)

MINUTE = timedelta(minutes=1)
CATCH_UP = timedelta(hours=1)
SETTLE = timedelta(seconds=15)
METERED_UNTIL_KEY = "metering:reserved-capacity:until"


@dataclass(frozen=True)
class Minute:
    deployment: Deployment
    start: datetime
    replica_seconds: int

    @property
    def request_id(self) -> str:
        return f"capacity-{self.deployment.pk}-{int(self.start.timestamp())}"


def minute_floor(moment: datetime) -> datetime:
    return moment.astimezone(timezone.utc).replace(second=0, microsecond=0)


def billed_minutes(*, since: datetime, until: datetime) -> list[Minute]:
    """The billed replica-seconds of each deployment in each whole minute from ``since`` to
    ``until`` (both on a minute), from the replicas ready now on alive workers."""
    ready = (Replica.objects.filter(status=Replica.Status.READY, worker__status=Worker.Status.ALIVE,
                                    deployment__organization__isnull=False,
                                    deployment__model__price_per_replica_hour__gt=0)
             .select_related("deployment__model", "worker"))
    heartbeat = timedelta(seconds=settings.FLEET_HEARTBEAT_SECONDS)
    by_deployment: dict[int, list[Replica]] = {}
    for replica in ready:
        by_deployment.setdefault(replica.deployment_id, []).append(replica)
    minutes = []
    for replicas in by_deployment.values():
        deployment = replicas[0].deployment
        billed = deployment.replicas_billed_hourly(len(replicas))
        start = since
        while start < until:
            end = start + MINUTE
            held = sum(sorted((_held_seconds(r, start, end, heartbeat) for r in replicas), reverse=True)[:billed])
            if held:
                minutes.append(Minute(deployment, start, held))
            start = end
    return minutes


def _held_seconds(replica: Replica, start: datetime, end: datetime, heartbeat: timedelta) -> int:
    """Whole seconds of [start, end) the replica was ready, up to its worker's last sign of life."""
    held_until = min(end, replica.worker.last_heartbeat + heartbeat)
    return max(0, int((held_until - max(start, replica.ready_at)).total_seconds()))


def usage_event(minute: Minute) -> dict:
    """The billing usage event of one deployment's minute (``billing.events``)."""
    from billing.events import RESERVED_CAPACITY
    from billing.pricing import FREE

    deployment = minute.deployment
    prices = replace(FREE, per_replica_hour=deployment.model.price_per_replica_hour).as_strings()
    return {
        "request_id": minute.request_id, "organization_id": deployment.organization_id, "api_key_id": None,
        "deployment_id": deployment.pk, "model": deployment.model.slug, "deployment": deployment.name,
        "prompt_tokens": 0, "cached_prompt_tokens": 0, "completion_tokens": 0, "status": "completed",
        "finished_at": minute.start.isoformat(), "prices": prices, "endpoint": RESERVED_CAPACITY,
        "replica_seconds": minute.replica_seconds,
    }


def meter(*, now: datetime | None = None, emit: Callable[[dict], object] | None = None) -> list[Minute]:
    """Emit the usage events of the whole minutes not metered yet (CATCH_UP at most); the minutes
    emitted. Where the meter got to is kept in Redis, moved on only once every event is out.
    ``emit``: what publishes an event (billing's queue, ``billing.dispatch.emit_usage_event``)."""
    if emit is None:
        from billing.dispatch import emit_usage_event as emit

    until = minute_floor((now or django_timezone.now()) - SETTLE)
    redis = fleet.client()
    mark = redis.get(METERED_UNTIL_KEY)
    since = until - MINUTE
    if mark:
        since = max(datetime.fromtimestamp(int(mark), tz=timezone.utc), until - CATCH_UP)
    if since >= until:
        return []
    minutes = billed_minutes(since=since, until=until)
    for minute in minutes:
        emit(usage_event(minute))
    redis.set(METERED_UNTIL_KEY, int(until.timestamp()))
    if minutes:
        log.info("metered %d replica-seconds of reserved capacity in %d deployment-minutes",
                 sum(m.replica_seconds for m in minutes), len(minutes))
    return minutes
