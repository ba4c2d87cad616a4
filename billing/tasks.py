"""Celery tasks of the billing app (the ``billing`` queue): they only call services."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.signals import worker_init
from django.db import InterfaceError, OperationalError

from . import balance_alerts, recovery, reserved_capacity, services, spend_alerts
from .dispatch import BILLING_QUEUE
from .errors import InvalidUsageEvent, UnknownModel

logger = logging.getLogger(__name__)


@shared_task(
    name="billing.tasks.record_usage_event",
    acks_late=True,
    reject_on_worker_lost=True,
    # The database down or restarting: retry with exponential backoff (up to 10 minutes apart) for
    # as long as it takes; a usage event is money and must not be dropped.
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=1,
    retry_backoff_max=600,
    retry_jitter=True,
    max_retries=None,
)
def record_usage_event(event: dict) -> int | None:
    """Record one usage event (idempotent by request id); returns the usage record's id."""
    try:
        return services.record_usage(event=event).pk
    except (InvalidUsageEvent, UnknownModel) as exc:
        # Permanent: a redelivery carries the same event. Kept for the operator to replay once the
        # cause is fixed (an unknown model put back, a billing worker upgraded), and logged loudly.
        logger.error("usage event refused, kept for `manage.py replay_usage_events`: %s; event=%r", exc.message, event)
        services.keep_refused_event(event=event, error=exc.message)
        return None


# An alert's email: the mail server refusing or unreachable (SMTPException is an OSError), or the
# database, tried again for up to about a day, then given up (logged); the next alert is its own.
EMAIL_RETRIES = {"autoretry_for": (OSError, OperationalError, InterfaceError), "retry_backoff": 30,
                 "retry_backoff_max": 3600, "retry_jitter": True, "max_retries": 30}


@shared_task(name="billing.tasks.send_balance_alert", **EMAIL_RETRIES)
def send_balance_alert(organization_id: int) -> int:
    """Email an organization's owners and admins that its balance fell below its alert."""
    return balance_alerts.send_email(organization_id=organization_id)


@shared_task(name="billing.tasks.send_spend_alert", **EMAIL_RETRIES)
def send_spend_alert(organization_id: int, month: str) -> int:
    """Email an organization's owners and admins that this month's spend reached its alert."""
    return spend_alerts.send_email(organization_id=organization_id, month=month)


@shared_task(name="billing.tasks.send_capacity_stopped", **EMAIL_RETRIES)
def send_capacity_stopped(organization_id: int, names: list, refusal: str) -> int:
    """Email an organization's owners and admins that its reserved deployments were stopped, unpaid."""
    return reserved_capacity.send_email(organization_id=organization_id, names=names, refusal=refusal)


@worker_init.connect
def requeue_events_of_stopped_billing_workers(sender=None, **kwargs) -> None:
    """A worker that consumes the billing queue, as it starts (before it consumes anything)."""
    if sender is not None and BILLING_QUEUE in sender.app.amqp.queues.consume_from:
        recovery.restore_unacked_events(sender.app)
