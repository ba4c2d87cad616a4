"""The gateway's waits on a worker end in 504 (a load that never finishes, a stream that stalls),
and the request is cancelled wherever it is, so the worker stops and bills what it produced."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import pytest
from channels.layers import get_channel_layer

from gateway.calls import Call
from gateway.errors import ApiError
from gateway.timing import Stages


def new_call(reply_channel: str) -> Call:
    caller = SimpleNamespace(key_id=f"test-{uuid.uuid4().hex}", org_id=f"test-{uuid.uuid4().hex}")
    return Call(caller=caller, request=None, spec={"name": "smol"}, request_id=f"chatcmpl-{uuid.uuid4().hex}",
                reply_channel=reply_channel, headers={}, stages=Stages(), queue_timeout=5)


def cancel_marked(request_id: str) -> bool:
    from workers import fleet
    from workers.cancellation import mark_key

    return fleet.client().exists(mark_key(request_id)) == 1


async def reply_channel_with(*events: dict) -> str:
    layer = get_channel_layer()
    channel = await layer.new_channel()
    for event in events:
        await layer.send(channel, event)
    return channel


def test_a_model_that_never_finishes_loading_is_504(settings):
    settings.GATEWAY_START_TIMEOUT = 0.5

    async def scenario():
        call = new_call(await reply_channel_with({"type": "inference.accepted"}))
        with pytest.raises(ApiError) as timed_out:
            await call.start()
        return call, timed_out.value

    call, error = asyncio.run(scenario())
    assert (error.status, error.code) == (504, "timeout") and "did not start" in error.message
    assert call.cancelled and cancel_marked(call.request_id)


def test_a_stream_that_stalls_is_504(settings):
    settings.GATEWAY_STALL_TIMEOUT = 0.5
    started = {"type": "inference.started", "prompt_tokens": 3}
    delta = {"type": "inference.delta", "text": "Hel", "token_ids": [1]}

    async def scenario():
        call = new_call(await reply_channel_with(started, delta))
        await call.start()
        received = []
        with pytest.raises(ApiError) as timed_out:
            async for event in call.events():
                received.append(event)
        return call, received, timed_out.value

    call, received, error = asyncio.run(scenario())
    assert call.prompt_tokens == 3 and [e["type"] for e in received] == ["inference.delta"]
    assert (error.status, error.code) == (504, "timeout") and "stopped producing" in error.message
    assert call.cancelled and cancel_marked(call.request_id)


def test_the_wait_of_a_cold_start_is_reported_as_load_not_queue():
    """The fleet loads the model for a scaled-to-zero deployment before any worker takes the
    request: Server-Timing must say where the time went."""
    async def scenario(cold: bool):
        call = new_call(await reply_channel_with({"type": "inference.started", "prompt_tokens": 3}))
        call.cold_start = cold
        await call.start()
        return call.stages.durations

    cold, warm = asyncio.run(scenario(True)), asyncio.run(scenario(False))
    assert list(cold) == list(warm) == ["queue", "load"]  # the same stages, for the header's readers
    assert cold["queue"] == 0 < cold["load"]
