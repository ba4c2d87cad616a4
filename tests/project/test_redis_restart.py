"""The channel layer across a Redis restart (killed, started again empty): every connection its
pools held died with the old server, and the first send and the first receive of each process
must still get through, on a fresh connection. A Redis that stays down still fails them at once
(the gateway's 503), instead of being waited on."""

from __future__ import annotations

import asyncio

import pytest
import redis

from inference_platform.channel_layer import RedisChannelLayer
from tests.project.restartable_redis import restartable_redis  # noqa: F401 (a fixture)
from workers.relay import ChannelSender

STARTED = {"type": "inference.started", "prompt_tokens": 3}


def _layer(url: str) -> RedisChannelLayer:
    """A process's layer (a new one is a new process: its own pools, its own channel names)."""
    return RedisChannelLayer(hosts=[{"address": url, "socket_timeout": 30}])


@pytest.mark.parametrize("way", ["send", "send_many"])
def test_a_workers_first_send_after_a_restart_arrives(restartable_redis, way):  # noqa: F811
    server = restartable_redis
    sender = ChannelSender(_layer(server.url))  # the worker's: start and end messages, and the relay's tokens

    def send(channel: str, message: dict) -> None:
        if way == "send":
            sender.send(channel, message)
        else:
            future = asyncio.run_coroutine_threadsafe(sender.layer.send_many([(channel, message)]), sender.loop)
            error = future.result(timeout=10)[0]
            if error is not None:
                raise error

    async def scenario():
        before = _layer(server.url)
        await asyncio.to_thread(send, await before.new_channel(), STARTED)  # its pool now holds a connection
        await asyncio.to_thread(server.restart)

        gateway = _layer(server.url)  # a fresh pool: only the worker's side crosses the restart
        channel = await gateway.new_channel()
        await asyncio.to_thread(send, channel, STARTED)
        assert await asyncio.wait_for(gateway.receive(channel), 10) == STARTED

        await asyncio.to_thread(server.kill)
        with pytest.raises(redis.exceptions.ConnectionError):  # down: said at once, not hidden
            await asyncio.to_thread(send, channel, STARTED)

    asyncio.run(scenario())


def test_a_gateways_first_receive_after_a_restart_gets_its_message(restartable_redis):  # noqa: F811
    server = restartable_redis
    gateway = _layer(server.url)

    async def scenario():
        channel = await gateway.new_channel()
        await _layer(server.url).send(channel, STARTED)
        assert await asyncio.wait_for(gateway.receive(channel), 10) == STARTED  # its reader's pool is warm
        await asyncio.to_thread(server.restart)

        await _layer(server.url).send(channel, {**STARTED, "prompt_tokens": 4})  # a worker's fresh pool
        assert (await asyncio.wait_for(gateway.receive(channel), 10))["prompt_tokens"] == 4

        await asyncio.to_thread(server.kill)
        with pytest.raises(redis.exceptions.ConnectionError):  # down: the reader fails its receivers at once
            await asyncio.wait_for(gateway.receive(channel), 10)

    asyncio.run(scenario())
