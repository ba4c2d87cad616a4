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
    restored = 0
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        for tag, raw in channel.client.hgetall(channel.unacked_key).items():
            if _routing_key(raw) == BILLING_QUEUE:
                channel.qos.restore_by_tag(tag, leftmost=True)
                restored += 1
    if restored:
        log.warning("requeued %d usage events left unacknowledged by a billing worker that stopped", restored)
    return restored


def pending_events(app) -> int:
    """Usage events not recorded yet: waiting on the billing queue, or held by a billing worker."""
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        client = channel.client
        waiting = sum(client.llen(channel._q_for_pri(BILLING_QUEUE, step)) for step in channel.priority_steps)
        held = sum(1 for raw in client.hvals(channel.unacked_key) if _routing_key(raw) == BILLING_QUEUE)
    return waiting + held


def _routing_key(raw: bytes | str) -> str | None:
    """The routing key of an unacknowledged entry (kombu stores [message, exchange, routing key])."""
    try:
        return json.loads(raw)[2]
    except (ValueError, TypeError, IndexError):
        return None
