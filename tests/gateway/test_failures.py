"""What a client sees when something other than its request fails: the engine mid-stream, its
worker stopping, Redis. Always an error in OpenAI's shape (in-band once streaming), never a
normal-looking end and never Django's HTML 500."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
from channels.layers import get_channel_layer

from gateway.errors import ApiError
from tests.gateway.test_timeouts import cancel_marked, new_call, reply_channel_with

STARTED = {"type": "inference.started", "prompt_tokens": 3}
DELTA = {"type": "inference.delta", "text": "Hel", "token_ids": [1], "logprobs": None}
USAGE = {"prompt_tokens": 3, "cached_prompt_tokens": 0, "completion_tokens": 1}


def finished(reason: str, error: str | None = None) -> dict:
    return {"type": "inference.finished", "finish_reason": reason, "error": error, "usage": USAGE, "timings": {}}


def run_call(*events: dict, cancel_first: bool = False):
    """Start a call whose worker sends ``events``; the events it yields and the error it raises."""
    async def scenario():
        call = new_call(await reply_channel_with(*events))
        await call.start()
        if cancel_first:
            await call.cancel()
        received = []
        try:
            async for event in call.events():
                received.append(event["type"])
        except ApiError as exc:
            return call, received, exc
        return call, received, None

    return asyncio.run(scenario())


def test_an_engine_failure_mid_stream_is_an_error_not_a_stop():
    call, received, error = run_call(STARTED, DELTA, finished("error", "step failed: CUDA error"))
    assert received == ["inference.delta"]
    assert (error.status, error.type, error.code) == (500, "server_error", "engine_error")
    assert "step failed" in error.message
    assert call.tokens_used == 4  # what it produced still counts against the rate limits


def test_an_abort_nobody_asked_for_is_an_interruption():
    _, _, error = run_call(STARTED, DELTA, finished("abort"))
    assert (error.status, error.code) == (503, "interrupted")


def test_an_abort_the_client_asked_for_ends_normally():
    call, received, error = run_call(STARTED, DELTA, finished("abort"), cancel_first=True)
    assert error is None and received == ["inference.delta", "inference.finished"]
    assert cancel_marked(call.request_id, void=False)  # the client's: what was produced is billed


def test_a_client_that_leaves_mid_stream_is_counted_what_it_got():
    from gateway import ratelimit

    async def scenario():
        call = new_call(await reply_channel_with(STARTED, DELTA, DELTA, finished("length")))
        await call.start()
        async for event in call.events():
            if event["type"] == "inference.delta" and call.completion_seen == 2:
                break  # the client went away before the end
        await call.cancel()
        key_sum = ratelimit._keys(call.caller.key_id, call.caller.org_id)[4]
        return int(await ratelimit.client().get(key_sum) or 0)

    assert asyncio.run(scenario()) == 3 + 2  # the prompt and the two tokens it received


def test_losing_redis_while_waiting_is_a_503(monkeypatch):
    async def broken_receive(channel):
        raise ConnectionError("the channel layer's reader lost Redis")

    async def scenario():
        channel = await reply_channel_with(STARTED)
        monkeypatch.setattr(get_channel_layer(), "receive", broken_receive)
        with pytest.raises(ApiError) as caught:
            await new_call(channel).start()
        return caught.value

    error = asyncio.run(scenario())
    assert (error.status, error.type, error.code) == (503, "server_error", "service_unavailable")
    assert error.headers["Retry-After"]


@pytest.mark.django_db
def test_a_request_when_redis_refuses_is_a_json_503(client, seeded, org_key, monkeypatch):
    from gateway import ratelimit

    def down(**kwargs):
        raise redis.exceptions.ConnectionError("Connection refused")

    monkeypatch.setattr(ratelimit, "admit", down)
    _, _, key = org_key()
    body = {"model": seeded, "messages": [{"role": "user", "content": "Hi"}]}
    response = client.post("/v1/chat/completions", data=json.dumps(body), content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 503 and response["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "service_unavailable" and response["x-request-id"]


def test_a_client_that_does_not_stream_gets_only_the_redelivered_copys_answer():
    """Its worker died after some tokens reached the gateway (held for the end, never sent): the
    copy that runs again says so first, and the answer is the copy's alone."""
    from types import SimpleNamespace

    from gateway import formatting
    from gateway.answers import collect

    again = {"type": "inference.delta", "text": "Hello", "token_ids": [1, 2], "logprobs": None}

    async def scenario():
        call = new_call(await reply_channel_with(STARTED, DELTA, {"type": "inference.restarted"}, again,
                                                 finished("length")))
        call.request = SimpleNamespace(sampling={}, n=1, prompts=None)
        await call.start()
        ctx = formatting.Context(kind="chat", id=call.request_id, created=0, model="smol")
        return call, await collect(call, ctx)

    call, body = asyncio.run(scenario())
    assert body["choices"][0]["message"]["content"] == "Hello"
    assert call.completion_seen == 2  # the void tokens are not the client's
