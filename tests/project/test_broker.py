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


def test_a_channel_closed_under_a_task_leaves_its_messages_unacknowledged_instead_of_failing():
    """Redis going away mid-task: the connection is closed (its transport has no client, the pool
    was dropped) when kombu restores the channel's unacknowledged messages. That failed with an
    AttributeError which stopped the worker for good; the message stays in Redis's unacknowledged
    set instead, for the fleet's recovery or the visibility timeout."""
    name = f"test-broker-{uuid.uuid4().hex}"
    conn = app.connection_for_write()
    channel = conn.channel()
    try:
        queue = conn.SimpleQueue(name, channel=channel)
        queue.put({"n": 1})
        taken = channel.basic_get(name, no_ack=False)
        assert taken is not None
        tag = taken.delivery_tag
        client = channel.client
        assert client.hexists(channel.unacked_key, tag)
        conn.transport.client, channel._pool = None, None  # as a lost connection leaves them
        channel.qos.restore_unacked_once()  # raised AttributeError: 'NoneType' object has no attribute 'hostname'
        with app.connection_for_write() as fresh:
            other = fresh.default_channel
            assert other.client.hexists(other.unacked_key, tag)  # still there, to be redelivered
            other.qos.restore_by_tag(tag)  # (tidy up: back on its queue, then gone with it)
            other.client.delete(name)
    finally:
        conn.release()


def test_a_command_on_a_closed_channel_is_a_connection_error_that_retries_handle():
    """Not an AttributeError: a worker's publish (its usage event) then goes through kombu's
    connection-error retries instead of stopping the worker."""
    import pytest
    from redis.exceptions import ConnectionError as RedisConnectionError

    conn = app.connection_for_write()
    channel = conn.channel()
    try:
        channel.connection = None  # as closing the connection under it leaves the channel
        with pytest.raises(RedisConnectionError):
            channel._create_client()
        assert RedisConnectionError in tuple(conn.connection_errors) or \
            any(issubclass(RedisConnectionError, error) for error in conn.connection_errors)
    finally:
        conn.release()
