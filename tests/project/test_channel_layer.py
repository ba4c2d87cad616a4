"""The platform's channel layer against the real Redis: what one process sends, another receives,
in order, with channels_redis's capacity rules and wire format, and nothing lost to a cancelled
receiver or a cancelled reader."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
from asgiref.sync import async_to_sync
from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer as PlainLayer
from django.conf import settings

from inference_platform.channel_layer import RedisChannelLayer
from workers.relay import ChannelSender

HOSTS = settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"]


def _layer(cls=RedisChannelLayer, **config):
    """A layer like the platform's (its hosts), with ``config`` for capacity and expiry; a new one
    is a new process as far as channel names go."""
    return cls(hosts=HOSTS, **config)


def test_many_threads_stream_to_many_receivers_in_order_and_share_redis_calls():
    gateway, worker = _layer(capacity=1000), _layer(capacity=1000)
    sender = ChannelSender(worker)
    tokens = 20

    async def scenario():
        channels = [await gateway.new_channel() for _ in range(16)]
        round_start = threading.Barrier(len(channels))

        def stream(channel):  # a worker's task thread: one message per engine step
            for n in range(tokens):
                round_start.wait()
                sender.send(channel, {"type": "inference.delta", "n": n, "text": f"{n} for {channel}"})

        async def read(channel):
            return [await gateway.receive(channel) for _ in range(tokens)]

        threads = [threading.Thread(target=stream, args=(c,)) for c in channels]
        for t in threads:
            t.start()
        received = await asyncio.gather(*(read(c) for c in channels))
        await asyncio.to_thread(lambda: [t.join() for t in threads])
        return channels, received

    channels, received = async_to_sync(scenario)()
    for channel, messages in zip(channels, received):
        assert [m["n"] for m in messages] == list(range(tokens))
        assert all(m["text"] == f"{m['n']} for {channel}" for m in messages)
    sent = len(channels) * tokens
    assert worker.send_calls < sent and gateway.receive_calls < sent  # batched, both ways


def test_a_full_channel_refuses_its_message_and_the_others_sent_with_it_arrive():
    # Two gateway processes: a process's reply channels share one queue in Redis, and its capacity.
    busy, idle = _layer(capacity=2), _layer(capacity=2)
    sender = _layer(capacity=2)

    async def scenario():
        full, other = await busy.new_channel(), await idle.new_channel()
        await sender.send(full, {"type": "a"})
        await sender.send(full, {"type": "b"})
        outcomes = await asyncio.gather(sender.send(full, {"type": "c"}), sender.send(other, {"type": "d"}),
                                        return_exceptions=True)
        assert isinstance(outcomes[0], ChannelFull) and outcomes[1] is None
        assert sender.send_calls == 3  # c and d went in one call
        assert [(await busy.receive(full))["type"] for _ in range(2)] == ["a", "b"]
        assert (await idle.receive(other))["type"] == "d"
        await sender.send(full, {"type": "e"})  # room again once the gateway has read
        assert (await busy.receive(full))["type"] == "e"

    async_to_sync(scenario)()


@pytest.mark.parametrize("sender_cls, receiver_cls", [(RedisChannelLayer, PlainLayer), (PlainLayer, RedisChannelLayer)],
                         ids=["ours-to-channels_redis", "channels_redis-to-ours"])
def test_it_speaks_channels_redis_both_ways(sender_cls, receiver_cls):
    sender, receiver = _layer(sender_cls), _layer(receiver_cls)

    async def scenario():
        channel = await receiver.new_channel()
        for n in range(3):
            await sender.send(channel, {"type": "inference.delta", "n": n})
        return [(await receiver.receive(channel))["n"] for _ in range(3)]

    assert async_to_sync(scenario)() == [0, 1, 2]


def test_receivers_cancelled_at_any_moment_lose_no_message():
    gateway, worker = _layer(), _layer()
    count = 40

    async def scenario():
        channel = await gateway.new_channel()

        async def send_all():
            for n in range(count):
                await worker.send(channel, {"n": n})
                await asyncio.sleep(0.002 * (n % 3))

        async def impatient_reader():  # gives up after a moment, again and again
            got = []
            while len(got) < count:
                try:
                    got.append((await asyncio.wait_for(gateway.receive(channel), 0.001 * (len(got) % 5 + 1)))["n"])
                except asyncio.TimeoutError:
                    pass
            return got

        _, got = await asyncio.gather(send_all(), impatient_reader())
        return got

    assert async_to_sync(scenario)() == list(range(count))


def test_a_batch_popped_by_a_reader_that_was_cancelled_is_received_by_the_next():
    gateway, worker = _layer(), _layer()

    async def scenario():
        channel = await gateway.new_channel()
        await worker.send(channel, {"type": "first"})
        await worker.send(channel, {"type": "second"})
        # Pop them into the backup as a reader does, and stop there (cancelled before sorting).
        key = gateway.prefix + gateway.non_local_name(channel)
        connection = gateway.connection(gateway.consistent_hash(channel))
        popped = await connection.zpopmin(key, 2)
        await connection.zadd(gateway._backup_channel_name(key), {member: score for member, score in popped})
        return [(await asyncio.wait_for(gateway.receive(channel), 5))["type"] for _ in range(2)]

    assert async_to_sync(scenario)() == ["first", "second"]


def test_redis_being_down_fails_senders_and_receivers_instead_of_hanging():
    layer = RedisChannelLayer(hosts=[{"address": "redis://127.0.0.1:1/0", "socket_connect_timeout": 1}])

    async def scenario():
        channel = await layer.new_channel()
        with pytest.raises(redis.exceptions.ConnectionError):
            await asyncio.wait_for(layer.send(channel, {"type": "x"}), 20)
        with pytest.raises(redis.exceptions.ConnectionError):
            await asyncio.wait_for(layer.receive(channel), 20)

    async_to_sync(scenario)()


def test_a_stream_that_never_waits_keeps_its_backlog_past_the_expiry():
    # A slow client: its messages are always there when it asks, for longer than the expiry.
    gateway, worker = _layer(expiry=1), _layer(expiry=1)

    async def scenario():
        channel, other = await gateway.new_channel(), await gateway.new_channel()
        for n in range(4):
            await worker.send(channel, {"n": n})
        got = [(await gateway.receive(channel))["n"]]  # the reader sorts all four at once
        for _ in range(3):
            await asyncio.sleep(0.6)
            await worker.send(other, {"n": "other"})  # the reader runs again, dropping what it may
            await gateway.receive(other)
            got.append((await gateway.receive(channel))["n"])
        return got

    assert async_to_sync(scenario)() == [0, 1, 2, 3]


def test_messages_sorted_in_one_event_loop_are_received_in_the_next():
    gateway, worker = _layer(), _layer()
    channel = async_to_sync(gateway.new_channel)()
    for n in range(3):
        async_to_sync(worker.send)(channel, {"n": n})
    # One loop per call, as in sync code: the first call's reader sorts all three.
    assert [async_to_sync(gateway.receive)(channel)["n"] for _ in range(3)] == [0, 1, 2]


def test_group_messages_and_unreadable_ones_do_not_block_the_others():
    gateway, plain = _layer(), _layer(PlainLayer)

    async def scenario():
        first, second = await gateway.new_channel(), await gateway.new_channel()
        await plain.group_add("watchers", first)
        await plain.group_add("watchers", second)
        await plain.group_send("watchers", {"type": "status", "state": "ready"})
        key = gateway.prefix + gateway.non_local_name(first)
        connection = gateway.connection(gateway.consistent_hash(first))
        await connection.zadd(key, {b"not a message": time.time()})
        await plain.send(first, {"type": "after"})
        received = [await asyncio.wait_for(gateway.receive(first), 5) for _ in range(2)]
        received.append(await asyncio.wait_for(gateway.receive(second), 5))
        await plain.group_discard("watchers", first)
        await plain.group_discard("watchers", second)
        return received

    assert async_to_sync(scenario)() == [{"type": "status", "state": "ready"}, {"type": "after"},
                                         {"type": "status", "state": "ready"}]


def test_a_batch_handed_out_is_not_received_again_by_the_next_reader():
    gateway, worker = _layer(), _layer()
    channel = async_to_sync(gateway.new_channel)()

    async def first_loop():
        await worker.send(channel, {"n": 0})
        return (await gateway.receive(channel))["n"]

    async def second_loop():  # a new reader, with the first one's batch still in the backup
        await worker.send(channel, {"n": 1})
        return (await asyncio.wait_for(gateway.receive(channel), 5))["n"]

    assert async_to_sync(first_loop)() == 0
    assert async_to_sync(second_loop)() == 1
