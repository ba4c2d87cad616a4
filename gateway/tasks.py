"""Celery tasks of the gateway: they only call services."""

from __future__ import annotations

import logging

from celery import shared_task

from . import services

log = logging.getLogger(__name__)


@shared_task(name="gateway.purge_expired_responses", ignore_result=True)
def purge_expired_responses() -> int:
    """Hourly (the beat schedule): delete stored responses past RESPONSES_RETENTION_DAYS."""
    deleted = services.purge_expired_responses()
    if deleted:
        log.info("deleted %d stored responses past their retention", deleted)
    return deleted
