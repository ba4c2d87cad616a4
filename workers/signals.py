"""Deployment changes wake the placement loop at once instead of at its next beat.

A deleted deployment's waiting requests are answered here (no replica may be left to notice them).
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from models_catalog.models import Deployment

log = logging.getLogger(__name__)


def _wake() -> None:
    from . import fleet

    try:
        fleet.trigger_tick()
    except Exception as exc:  # Redis down: the next beat will do (one line: a migration meets this)
        log.warning("could not wake the placement loop (%s: %s); its next pass finds the change",
                    type(exc).__name__, exc)


@receiver(post_save, sender=Deployment, dispatch_uid="workers.deployment_saved")
def deployment_saved(sender, instance: Deployment, created: bool, update_fields=None, **kwargs) -> None:
    if update_fields is not None and set(update_fields) <= {"status", "status_reason", "updated_at"}:
        return  # the fleet's own status writes
    transaction.on_commit(_wake)


@receiver(post_delete, sender=Deployment, dispatch_uid="workers.deployment_deleted")
def deployment_deleted(sender, instance: Deployment, **kwargs) -> None:
    name = instance.name

    def answer_waiting() -> None:
        from . import fleet

        try:
            if not Deployment.objects.filter(name=name).exists():
                fleet.fail_queued(name, message=f"The deployment '{name}' was deleted.", code="model_not_found",
                                  status=404)
        except Exception:
            log.warning("could not answer the requests waiting for %s", name, exc_info=True)
        _wake()

    transaction.on_commit(answer_waiting)
