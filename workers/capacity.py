"""Part of the workers' dispatch interface for the gateway: wake a deployment that has no replica.

A request to a scaled-to-zero (or pending, or loading) deployment is put on its queue like any
other; ``wake`` then runs the placement loop at once, which sees the waiting request and has a
worker load the model, and tells the gateway how long to wait for a worker to take the request:
FLEET_COLD_START_TIMEOUT when a worker can host it, the usual GATEWAY_QUEUE_TIMEOUT otherwise
(nobody can serve it: the request fails as before). Meanwhile the deployment's status (loading)
is visible through the API.
"""

from __future__ import annotations

import logging

from django.conf import settings

log = logging.getLogger(__name__)


def wake(spec: dict) -> float:
    """Seconds the gateway should wait for a worker to accept a request just queued for ``spec``."""
    base = float(settings.GATEWAY_QUEUE_TIMEOUT)
    try:
        from models_catalog.models import Deployment

        from . import fleet, selectors

        status = Deployment.objects.filter(pk=spec["id"]).values_list("status", flat=True).first()
        if status is None or status == Deployment.Status.READY:
            return base
        fleet.trigger_tick()
        if status in (Deployment.Status.STOPPED, Deployment.Status.FAILED):
            return base  # the placement loop answers the waiting request with the reason
        if selectors.can_host(deployment_id=spec["id"]):
            return max(base, float(settings.FLEET_COLD_START_TIMEOUT))
    except Exception:  # never fail a request for want of a wake-up: the beat's pass will come
        log.exception("could not wake deployment %s", spec.get("name"))
    return base
