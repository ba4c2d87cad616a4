"""A call through a Redis restart (killed, started again empty). Its request was already published
when the gateway receives or cancels, so a dead pooled connection must not turn into a 503 the
client retries while the first copy runs and is billed: the receive carries on, and a call that
does give up cancels its request on a fresh connection. A Redis that stays down is still a 503."""

from __future__ import annotations

import asyncio

import pytest
import redis

from gateway import calls, ratelimit
from gateway.errors import ApiError
from inference_platform.channel_layer import RedisChannelLayer
from tests.gateway.test_timeouts import new_call
from tests.project.restartable_redis import restartable_redis  # noqa: F401 (a fixture)
from workers.cancellation import CHANNEL, VOID, mark_key

STARTED = {"type": "inference.started", "prompt_tokens": 3}


@pytest.fixture
def server(restartable_redis, settings, monkeypatch):  # noqa: F811
    """The gateway's Redis (its channel layer and its cancels) is the restartable one."""
    settings.REDIS_URL = restartable_redis.url
    monkeypatch.setattr(ratelimit, "_clients", {})  # the cancels' clients, made from REDIS_URL
    return restartable_redis


def _layer(url: str) -> RedisChannelLayer:
    return RedisChannelLayer(hosts=[{"address": url, "socket_timeout": 30}])


def test_a_call_after_a_restart_gets_its_reply_not_a_503(server, monkeypatch):
    gateway = _layer(server.url)
    monkeypatch.setattr(calls, "get_channel_layer", lambda: gateway)

    async def scenario():
        warm = new_call(await gateway.new_channel())
        await _layer(server.url).send(warm.reply_channel, STARTED)
        await warm.start()  # the gateway's pool now holds the connection its reader used
        await asyncio.to_thread(server.restart)

        call = new_call(await gateway.new_channel())
        await _layer(server.url).send(call.reply_channel, {**STARTED, "prompt_tokens": 4})
        await call.start()
        assert call.prompt_tokens == 4 and not call.cancelled

        await asyncio.to_thread(server.kill)
        down = new_call(await gateway.new_channel())  # its queue timeout is 5 s: this must come first
        with pytest.raises(ApiError) as caught:
            await down.start()
        assert (caught.value.status, caught.value.code) == (503, "service_unavailable")

    asyncio.run(scenario())


def test_a_call_that_gives_up_after_a_restart_still_cancels_its_request(server, monkeypatch):
    gateway = _layer(server.url)
    monkeypatch.setattr(calls, "get_channel_layer", lambda: gateway)
    worker = redis.Redis.from_url(server.url, socket_timeout=10)

    async def scenario():
        assert await calls._send_cancel("chatcmpl-warm")  # the cancels' pool now holds a connection
        await asyncio.to_thread(server.restart)
        listening = worker.pubsub()  # as a worker's cancel listener
        listening.subscribe(CHANNEL)
        assert listening.get_message(timeout=10)["type"] == "subscribe"

        call = new_call(await gateway.new_channel())
        call.queue_timeout = 0.2  # no worker answers: the gateway gives up on a published request
        with pytest.raises(ApiError) as caught:
            await call.start()
        assert (caught.value.status, caught.value.code) == (503, "model_unavailable")
        assert call.cancelled
        # A worker sees it: the mark before running a queued copy, the broadcast if running one.
        assert worker.exists(mark_key(call.request_id))
        message = await asyncio.to_thread(listening.get_message, timeout=10)
        assert message and message["data"].decode() == call.request_id

        await asyncio.to_thread(server.kill)
        assert not await calls._send_cancel("chatcmpl-down")  # down: said (logged) at once

    asyncio.run(scenario())


def test_the_first_request_after_a_restart_counts_against_the_token_limits(server):
    """The rate limiter's pool checks a connection before handing it out: after a restart its
    first call reconnects instead of failing (the request's tokens were then counted nowhere)."""
    async def scenario():
        await ratelimit.client().ping()  # a pooled connection, which the restart kills
        await asyncio.to_thread(server.restart)  # the loop runs on meanwhile, as a server's does
        await ratelimit.record_tokens(key_id="k-restart", org_id="o-restart", request_id="r1", tokens=5)
        key_sum = ratelimit._keys("k-restart", "o-restart")[4]
        return int(await ratelimit.client().get(key_sum) or 0)

    assert asyncio.run(scenario()) == 5


def test_a_cancel_redis_refused_is_sent_once_it_is_back(server, monkeypatch):
    """The gateway gave up on a request with a 503 while Redis was down: once Redis is back, its
    cancel goes through (void: the client got an error it may retry), so a worker that kept the
    request does not run it to its end, and bill it, for nobody."""
    gateway = _layer(server.url)
    monkeypatch.setattr(calls, "get_channel_layer", lambda: gateway)
    monkeypatch.setattr(calls, "CANCEL_RETRY_S", 0.05)

    async def scenario():
        call = new_call(await gateway.new_channel())
        await _layer(server.url).send(call.reply_channel, STARTED)
        await call.start()
        await asyncio.to_thread(server.kill)
        with pytest.raises(ApiError) as caught:
            async for _ in call.events():
                pass
        assert (caught.value.status, caught.value.code) == (503, "service_unavailable")
        assert not await asyncio.to_thread(_marked, server.url, call.request_id)  # nowhere to put it yet
        await asyncio.to_thread(server.start)  # empty: a worker's copy would run on
        deadline = asyncio.get_running_loop().time() + 15
        while not (mark := await asyncio.to_thread(_marked, server.url, call.request_id)):
            assert asyncio.get_running_loop().time() < deadline, "the cancel never went through"
            await asyncio.sleep(0.05)
        return mark

    assert asyncio.run(scenario()) == VOID.encode()


def _marked(url: str, request_id: str) -> bytes | None:
    try:
        return redis.Redis.from_url(url, socket_timeout=1).get(mark_key(request_id))
    except redis.RedisError:
        return None
