"""Celery tasks of the gateway: they only call services."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.signals import worker_shutting_down

from . import batch_runner, services  # imported now: a shutdown must not import (see _stop_batch_runners)

log = logging.getLogger(__name__)


@shared_task(name="gateway.purge_expired_responses", ignore_result=True)
def purge_expired_responses() -> int:
    """Hourly (the beat schedule): delete stored responses past RESPONSES_RETENTION_DAYS."""
    deleted = services.purge_expired_responses()
    if deleted:
        log.info("deleted %d stored responses past their retention", deleted)
    return deleted


@shared_task(name="gateway.purge_expired_batch_files", ignore_result=True)
def purge_expired_batch_files() -> int:
    """Hourly (the beat schedule): delete batch output and error files past their retention."""
    deleted = services.purge_expired_batch_files()
    if deleted:
        log.info("deleted %d batch output files past their retention", deleted)
    return deleted


@shared_task(name="gateway.run_batch", ignore_result=True, acks_late=False)
def run_batch(batch_id: str) -> None:
    """Run a batch to its end (on the ``batches`` queue). Acknowledged at once: a runner that dies
    is resumed by ``resume_batches``, not by the broker's redelivery."""
    batch_runner.run(batch_id)


@shared_task(name="gateway.resume_batches", ignore_result=True)
def resume_batches() -> int:
    """Every minute (the beat schedule): the running batches whose runner went silent."""
    return services.resume_batches()


@worker_shutting_down.connect
def _stop_batch_runners(**kwargs) -> None:
    batch_runner.stopping.set()
