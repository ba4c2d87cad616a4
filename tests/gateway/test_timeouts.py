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


def cancel_marked(request_id: str, *, void: bool | None = None) -> bool:
    """Whether the request was cancelled: by the gateway giving up (``void``), by its client (not
    ``void``), or either (None)."""
    from workers import fleet
    from workers.cancellation import VOID, mark_key

    mark = fleet.client().get(mark_key(request_id))  # a str: this client decodes
    return mark is not None if void is None else mark == (VOID if void else "1")


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
    assert call.cancelled and cancel_marked(call.request_id, void=True)


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
    assert call.cancelled and cancel_marked(call.request_id, void=True)  # the client may retry: free


def test_a_long_prompt_reporting_progress_is_not_a_stall(settings):
    """Its worker reports each stretch of the prompt computed: the stall timer starts again, and
    the client gets its answer though the first token came after more than the timeout."""
    settings.GATEWAY_STALL_TIMEOUT = 0.5
    finished = {"type": "inference.finished", "finish_reason": "stop", "error": None, "choices": [],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "cached_prompt_tokens": 0}}

    async def scenario():
        layer = get_channel_layer()
        channel = await reply_channel_with({"type": "inference.started", "prompt_tokens": 3})
        call = new_call(channel)
        await call.start()

        async def worker():  # progress every 0.2 s for 1.2 s, then the token and the end
            for _ in range(6):
                await asyncio.sleep(0.2)
                await layer.send(channel, {"type": "inference.progress"})
            await layer.send(channel, {"type": "inference.delta", "text": "Hi", "token_ids": [1]})
            await layer.send(channel, finished)

        sending = asyncio.create_task(worker())
        received = [event["type"] async for event in call.events()]
        await sending
        return call, received

    call, received = asyncio.run(scenario())
    assert received == ["inference.delta", "inference.finished"] and not call.cancelled


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


def test_a_deployment_no_worker_serves_is_503_after_its_first_wait(settings):
    async def scenario():
        call = new_call(await get_channel_layer().new_channel())
        call.queue_timeout = 0.3
        _spec(call)
        with pytest.raises(ApiError) as refused:
            await call.start()
        return call, refused.value

    call, error = asyncio.run(scenario())
    assert (error.status, error.code) == (503, "model_unavailable") and "none is running" in error.message
    assert call.cancelled and cancel_marked(call.request_id, void=True)


def test_a_503_says_what_the_placement_loop_says_of_the_deployment(monkeypatch):
    """Every slot held by replicas that may not go: retrying in a moment is not the whole story."""
    from models_catalog import selectors

    reasons = {7: "waiting for a worker with a free slot"}
    monkeypatch.setattr(selectors, "status_reason", lambda *, deployment_id: reasons[deployment_id])

    async def scenario():
        call = new_call(await get_channel_layer().new_channel())
        call.queue_timeout, call.spec = 0.3, {"id": 7, "name": "smol-full"}
        with pytest.raises(ApiError) as refused:
            await call.start()
        return refused.value

    error = asyncio.run(scenario())
    assert (error.status, error.code) == (503, "model_unavailable")
    assert "No worker took this request for 'smol-full': waiting for a worker with a free slot" in error.message


def test_a_request_behind_busy_replicas_waits_while_a_worker_serves_its_deployment(settings):
    """A worker takes only what its engine can run, so a burst waits on the queue: past its first
    wait (GATEWAY_QUEUE_TIMEOUT) a request waits on while a live worker hosts the deployment, up to
    GATEWAY_STALL_TIMEOUT more, and no longer once none does."""
    from workers import dispatch, fleet

    settings.GATEWAY_QUEUE_TIMEOUT = 0.3
    settings.GATEWAY_STALL_TIMEOUT = 1.2

    async def scenario(*, served_after: float | None, hosted_for: float):
        layer = get_channel_layer()
        call = new_call(await layer.new_channel())
        call.queue_timeout = None
        name = _spec(call)
        # What each live worker hosting the engine does with every heartbeat (fleet.mark_serving).
        fleet.client().set(dispatch.serving_key(name), "1", px=int(hosted_for * 1000))
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
            fleet.client().delete(dispatch.serving_key(name))

    call, error, waited = asyncio.run(scenario(served_after=1.0, hosted_for=60))  # served, not refused
    assert error is None and call.prompt_tokens == 3 and waited >= 1.0
    call, error, waited = asyncio.run(scenario(served_after=None, hosted_for=60))
    assert (error.status, error.code) == (503, "model_overloaded") and "busy" in error.message
    assert error.expected  # load, as a 429 is: a warning in the log, not an error to page for
    assert waited >= 0.3 + 1.2 and call.cancelled and cancel_marked(call.request_id)
    call, error, waited = asyncio.run(scenario(served_after=None, hosted_for=0.5))  # its worker went away
    assert (error.status, error.code) == (503, "model_unavailable")  # before its deadline: not "busy"
