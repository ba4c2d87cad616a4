"""How a worker hands a usage event to billing: :func:`emit_usage_event`.

It validates the event and publishes the ``billing.tasks.record_usage_event`` task on the ``billing``
queue (Redis), by name, so a GPU worker imports no billing models. Call it BEFORE acknowledging the
inference task: once it returns, the event is in Redis, and a worker that dies right after still
leaves it there for the billing worker. The Celery task id is derived from the request id
(:func:`usage_task_id`), so a redelivered or re-emitted event is traceable in logs and flower;
billing itself is idempotent by ``request_id``, so emitting an event twice records it once.
"""

from __future__ import annotations

from typing import Any, Mapping

from .events import parse_usage_event

RECORD_USAGE_TASK = "billing.tasks.record_usage_event"
BILLING_QUEUE = "billing"


def usage_task_id(request_id: str) -> str:
    return f"usage-{request_id}"


def emit_usage_event(event: Mapping[str, Any]) -> str:
    """Validate ``event`` (:class:`billing.events.UsageEvent`) and publish it for recording.

    Returns the Celery task id. Raises :class:`billing.errors.InvalidUsageEvent` for a malformed
    event (nothing is published) and the broker's error when Redis cannot be reached after retries.
    """
    from inference_platform.celery import app

    parsed = parse_usage_event(event)
    task_id = usage_task_id(parsed.request_id)
    app.send_task(
        RECORD_USAGE_TASK,
        args=[parsed.to_wire()],
        task_id=task_id,
        argsrepr=f"[{parsed.request_id!r}]",  # for logs: the request, not the whole event (cheaper too)
        queue=BILLING_QUEUE,
        retry=True,
        retry_policy={"max_retries": 5, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 3},
    )
    return task_id
