"""The broker transport: kombu's Redis transport, keeping its blocking client between commands."""

from __future__ import annotations

import uuid

from inference_platform import broker
from inference_platform.celery import app


def test_redis_broker_urls_use_the_transport_that_keeps_its_client():
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert isinstance(channel, broker.Channel)
        first = channel._create_client()
        assert channel._create_client() is first
        channel._disconnect_pools()  # what a lost connection does: the next client uses the new pool
        assert channel._create_client() is not first
        assert channel._create_client().connection_pool is channel.pool


def test_messages_published_through_it_arrive_in_order():
    name = f"test-broker-{uuid.uuid4().hex}"
    with app.connection_for_write() as conn:
        queue = conn.SimpleQueue(name)
        try:
            for i in range(3):
                queue.put({"n": i})
            received = []
            for _ in range(3):
                message = queue.get(timeout=5)
                received.append(message.payload["n"])
                message.ack()
            assert received == [0, 1, 2]
        finally:
            queue.clear()
            queue.close()
