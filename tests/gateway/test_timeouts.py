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


def _spec(call: Call) -> str:
    call.spec = {"name": f"smol-{uuid.uuid4().hex[:8]}"}
    return call.spec["name"]


def test_a_queue_nobody_takes_from_is_503_after_one_period(settings):
    async def scenario():
        call = new_call(await get_channel_layer().new_channel())
        call.queue_timeout = 0.3
        _spec(call)
        with pytest.raises(ApiError) as refused:
            await call.start()
        return call, refused.value

    call, error = asyncio.run(scenario())
    assert (error.status, error.code) == (503, "model_unavailable") and "none is running" in error.message
    assert call.cancelled and cancel_marked(call.request_id)


def test_a_request_behind_busy_replicas_waits_while_its_queue_moves_and_up_to_the_stall_timeout(settings):
    """A worker takes only what its engine can run, so a burst waits on the queue: the period of
    GATEWAY_QUEUE_TIMEOUT without a take means nobody serves the deployment, but while workers keep
    taking its requests this one waits, up to GATEWAY_STALL_TIMEOUT."""
    from workers import dispatch, fleet

    settings.GATEWAY_STALL_TIMEOUT = 1.5

    async def take_every(seconds: float, name: str, stop: asyncio.Event) -> None:
        while not stop.is_set():  # what fleet.claim does each time a worker takes one of its requests
            fleet.client().set(dispatch.taken_key(name), "1", px=dispatch.TAKEN_TTL_MS)
            try:
                await asyncio.wait_for(stop.wait(), seconds)
            except asyncio.TimeoutError:
                pass

    async def scenario(*, served_after: float | None):
        layer = get_channel_layer()
        call = new_call(await layer.new_channel())
        call.queue_timeout = 0.3
        name = _spec(call)
        stop = asyncio.Event()
        workers = asyncio.create_task(take_every(0.1, name, stop))
        loop = asyncio.get_running_loop()
        if served_after is not None:  # its turn comes: a worker takes it and starts it
            loop.call_later(served_after, lambda: asyncio.ensure_future(
                layer.send(call.reply_channel, {"type": "inference.started", "prompt_tokens": 3})))
        started = loop.time()
        try:
            await call.start()
            return call, None, loop.time() - started
        except ApiError as error:
            return call, error, loop.time() - started
        finally:
            stop.set()
            await workers
            fleet.client().delete(dispatch.taken_key(name))

    call, error, waited = asyncio.run(scenario(served_after=0.9))  # three periods: served, not refused
    assert error is None and call.prompt_tokens == 3 and waited >= 0.9
    call, error, waited = asyncio.run(scenario(served_after=None))
    assert (error.status, error.code) == (503, "model_overloaded") and "busy" in error.message
    assert waited >= 1.2 and call.cancelled and cancel_marked(call.request_id)  # several periods, not one
