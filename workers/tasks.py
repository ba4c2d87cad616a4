"""Celery tasks of the GPU workers: thin wrappers around ``workers.inference``."""

from __future__ import annotations

import logging
import threading

from celery import shared_task
from celery.signals import worker_ready
from celery.worker.control import inspect_command
from django.conf import settings

from . import inference
from .agent import agent  # also registers the fleet's worker signals and remote control commands
from .cancellation import listener
from .relay import relay, sender
from .runtime import host, preload_names

log = logging.getLogger(__name__)


@shared_task(name="workers.run_inference", bind=True, acks_late=True, ignore_result=True)
def run_inference(self, payload: dict) -> None:
    worker_name = self.request.hostname or ""
    agent.serve(payload, hostname=worker_name, send=sender().send,
                run=lambda send, ticket: inference.run(payload, host=host, send=send, relay=relay(),
                                                       cancels=listener(), worker_name=worker_name, ticket=ticket))


@shared_task(name="workers.fleet_tick", ignore_result=True)
def fleet_tick() -> None:
    """One pass of the placement loop (Celery beat runs it every FLEET_TICK_SECONDS)."""
    from .placement import tick

    tick()


@shared_task(name="workers.meter_reserved_capacity", ignore_result=True)
def meter_reserved_capacity() -> None:
    """Bill the minutes of reserved replicas not billed yet (Celery beat runs it every minute)."""
    from .metering import meter

    meter()


@worker_ready.connect
def preload_engines(sender=None, **kwargs) -> None:
    """Load the deployments named in INFERENCE_PRELOAD in the background as the worker starts, so
    the first request does not pay for it (requests arriving meanwhile wait for the load). A worker
    with slots leaves it to its fleet agent, which also records a load that fails."""
    names = preload_names()
    if names and int(settings.WORKER_SLOTS) == 0:
        threading.Thread(target=_preload, args=(names,), name="engine-preload", daemon=True).start()


def _preload(names: list[str]) -> None:
    from models_catalog.models import Deployment

    from .dispatch import engine_spec

    for deployment in Deployment.objects.filter(name__in=names).select_related("model"):
        try:
            host.engine_for(engine_spec(deployment))
        except Exception:
            log.exception("could not preload %s", deployment.name)


@inspect_command()
def engine_stats(state) -> dict:
    """``app.control.broadcast("engine_stats", reply=True)``: each worker's engines' statistics."""
    return {"engines": host.stats(), "load_seconds": dict(host.load_seconds)}
