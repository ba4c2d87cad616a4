"""The worker's reply sender against the real Redis: what it sends, the gateway's channels_redis
``receive`` reads back, in order, with channels_redis's capacity and errors."""

from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import async_to_sync
from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer
from django.conf import settings

from workers.relay import ChannelSender


def _layer(**config) -> RedisChannelLayer:
    """A layer like the platform's (its hosts), with ``config`` instead of its capacity and expiry."""
    return RedisChannelLayer(hosts=settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"], **config)


def _receive_all(layer, channels: list[str], count: int) -> dict[str, list[dict]]:
    """``count`` messages of each channel, read in one event loop as a gateway process does."""
    async def receive():
        return {channel: [await layer.receive(channel) for _ in range(count)] for channel in channels}

    return async_to_sync(receive)()


def test_messages_from_many_threads_arrive_in_order_on_their_channels_and_share_script_calls():
    gateway = _layer(capacity=1000)  # one process's channels share one queue, and its capacity
    channels = [async_to_sync(gateway.new_channel)() for _ in range(16)]
    sender = ChannelSender(_layer(capacity=1000))
    start = threading.Barrier(len(channels))

    def stream(channel: str) -> None:
        start.wait()
        for n in range(20):
            sender.send(channel, {"type": "inference.delta", "n": n, "text": f"token {n} of {channel}"})

    threads = [threading.Thread(target=stream, args=(c,)) for c in channels]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    for channel, received in _receive_all(gateway, channels, 20).items():
        assert [m["n"] for m in received] == list(range(20))
        assert {m["text"] for m in received} == {f"token {n} of {channel}" for n in range(20)}
    # 320 messages: sent together when they were waiting together, never in more calls than messages
    assert sender.batches < 16 * 20


def test_a_full_channel_refuses_its_message_and_the_others_in_the_batch_go_through():
    # Two gateway processes: a process's reply channels share one queue and its capacity.
    busy, idle = _layer(capacity=2), _layer(capacity=2)
    sender = ChannelSender(_layer(capacity=2))

    async def scenario():  # one event loop, as in a gateway process
        full, other = await busy.new_channel(), await idle.new_channel()

        async def send(channel, kind):
            await asyncio.to_thread(sender.send, channel, {"type": kind})

        await send(full, "a")
        await send(full, "b")
        outcomes = await asyncio.gather(send(full, "c"), send(other, "d"), return_exceptions=True)
        assert isinstance(outcomes[0], ChannelFull) and outcomes[1] is None
        assert [(await busy.receive(full))["type"] for _ in range(2)] == ["a", "b"]
        assert (await idle.receive(other))["type"] == "d"
        await send(full, "e")  # room again once the gateway read
        assert (await busy.receive(full))["type"] == "e"

    async_to_sync(scenario)()


def test_redis_being_down_raises_instead_of_hanging():
    down = RedisChannelLayer(hosts=[{"address": "redis://127.0.0.1:1/0", "socket_connect_timeout": 1}])
    sender = ChannelSender(down)
    with pytest.raises(Exception) as raised:
        sender.send("specific.abc!def", {"type": "inference.delta"}, timeout=20)
    assert "connect" in str(raised.value).lower() or "refused" in str(raised.value).lower()
