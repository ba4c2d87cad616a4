"""Usage events a billing worker held when it died, back on the queue when the next one starts.

A billing worker acknowledges an event only once it is recorded (``acks_late``). One killed
mid-event leaves it in Redis's unacknowledged set, which the broker redelivers only after its
visibility timeout (an hour by default): usage, balances and spend limits would lag that long. A
billing worker starting, before it consumes anything, puts every unacknowledged billing event
back at the head of the queue instead. One that a live billing worker is still recording comes
back too, harmlessly: recording is idempotent by request id.
"""

from __future__ import annotations

import json
import logging

from .dispatch import BILLING_QUEUE

log = logging.getLogger(__name__)


def restore_unacked_events(app) -> int:
    """Requeue the unacknowledged messages of the billing queue; returns how many."""
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        held = _held_tags(channel)
        for tag in held:
            channel.qos.restore_by_tag(tag, leftmost=True)
    if held:
        log.warning("requeued %d usage events left unacknowledged by a billing worker that stopped", len(held))
    return len(held)


def pending_events(app) -> int:
    """Usage events not recorded yet: waiting on the billing queue, or held by a billing worker."""
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        waiting = sum(channel.client.llen(channel._q_for_pri(BILLING_QUEUE, step)) for step in channel.priority_steps)
        return waiting + len(_held_tags(channel))


def _held_tags(channel) -> list:
    """The delivery tags of the billing events taken by a worker and not acknowledged yet."""
    return [tag for tag, raw in channel.client.hgetall(channel.unacked_key).items()
            if _routing_key(raw) == BILLING_QUEUE]


def _routing_key(raw: bytes | str) -> str | None:
    """The routing key of an unacknowledged entry (kombu stores [message, exchange, routing key])."""
    try:
        return json.loads(raw)[2]
    except (ValueError, TypeError, IndexError):
        return None
