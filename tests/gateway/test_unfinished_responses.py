"""Responses that do not end well are stored too: one that fails once started, as ``failed`` with
its error and what it wrote, and one whose client leaves, as ``cancelled`` with what the model
wrote until it stopped and the usage the worker billed for it. A failed response cannot be
continued; a cancelled one can.

In process, on the real Redis: a real call whose worker events the test sends, and the real views
with the test taking the request off the deployment's queue as a worker does."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time

import pytest
from channels.layers import get_channel_layer

from gateway import response_events
from gateway.errors import ApiError
from gateway.response_events import ResponseBuilder, collect, stream
from gateway.responses import parse_response_request
from tests.gateway.conftest import own_deployment
from tests.gateway.test_timeouts import cancel_marked, new_call, reply_channel_with

STARTED = {"type": "inference.started", "prompt_tokens": 3}


def delta(text: str, tokens: int = 1) -> dict:
    return {"type": "inference.delta", "text": text, "token_ids": [1] * tokens, "logprobs": None}


def finished(reason: str, completion_tokens: int, error: str | None = None) -> dict:
    return {"type": "inference.finished", "finish_reason": reason, "error": error, "timings": {},
            "usage": {"prompt_tokens": 3, "cached_prompt_tokens": 0, "completion_tokens": completion_tokens}}


def new_builder() -> ResponseBuilder:
    return ResponseBuilder(response_id="resp_t", created=0, model="m", sampling={}, settings={"store": True})


class Keeper:
    """A ``keep`` that remembers each response it was given, as it was then, and when."""

    def __init__(self, sent: list | None = None):
        self.kept: list[dict] = []
        self.at: list[int] = []  # how many events were out at each keep
        self._sent = sent if sent is not None else []

    async def __call__(self, response: dict) -> bool:
        self.kept.append(copy.deepcopy(response))
        self.at.append(len(self._sent))
        return True


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] for part in item.get("content", []))


def run_stream(*events: dict, leave_at=None):
    """Stream a call whose worker sent ``events``; ``leave_at(event)`` says when the client leaves
    (the view closes the stream then, as here). The call, the events sent, and the keeper."""
    async def scenario():
        call = new_call(await reply_channel_with(STARTED, *events))
        await call.start()
        sent: list[dict] = []
        keeper = Keeper(sent)
        async with contextlib.aclosing(stream(call, new_builder(), keeper)) as out:
            async for event in out:
                sent.append(event)
                if leave_at is not None and leave_at(event):
                    break
        return call, sent, keeper

    return asyncio.run(scenario())


def test_an_engine_failure_mid_stream_ends_with_response_failed_and_is_kept_first():
    call, sent, keeper = run_stream(delta("Hel"), delta("lo"), finished("error", 2, "step failed: CUDA error"))
    last = sent[-1]
    assert last["type"] == "response.failed" and keeper.at == [len(sent) - 1]  # kept before its last event
    [response] = keeper.kept
    assert last["response"] == response
    assert response["status"] == "failed" and response["error"]["code"] == "server_error"
    assert set(response["error"]) == {"code", "message"} and "step failed" in response["error"]["message"]
    assert text_of(response) == "Hello" and response["output"][0]["status"] == "incomplete"
    assert response["usage"]["input_tokens"] == 3 and response["usage"]["output_tokens"] == 2  # the worker's
    assert response["incomplete_details"] is None
    done = [e for e in sent if e["type"] == "response.output_item.done"]
    assert [e["item"]["status"] for e in done] == ["incomplete"]


def test_a_worker_error_without_usage_keeps_what_reached_the_gateway():
    lost = {"type": "inference.error", "status": 503, "code": "worker_lost", "param": None,
            "message": "The worker running this request stopped."}
    _, sent, keeper = run_stream(delta("Hel", tokens=2), delta("lo", tokens=2), lost)
    [response] = keeper.kept
    assert sent[-1]["type"] == "response.failed" and response["error"]["code"] == "server_error"
    assert response["error"]["message"] == "The worker running this request stopped."
    assert (response["usage"]["input_tokens"], response["usage"]["output_tokens"]) == (3, 4)


def test_a_stream_that_stalls_fails_as_a_timeout_and_is_cancelled(settings):
    settings.GATEWAY_STALL_TIMEOUT = 0.3
    call, sent, keeper = run_stream(delta("Hel"))
    [response] = keeper.kept
    assert sent[-1]["type"] == "response.failed" and response["error"]["code"] == "server_error"
    assert "stopped producing tokens" in response["error"]["message"]
    assert text_of(response) == "Hel" and cancel_marked(call.request_id)


def test_a_client_that_leaves_has_the_response_kept_with_what_the_model_wrote_until_it_stopped():
    """After the client left, the worker still sent what it made before the cancel reached it, and
    the usage it billed: the stored response holds both."""
    call, sent, keeper = run_stream(delta("Hel"), delta("lo"), delta(" there"), finished("abort", 3),
                                    leave_at=lambda e: e["type"] == "response.output_text.delta")
    assert [e["delta"] for e in sent if e["type"] == "response.output_text.delta"] == ["Hel"]
    assert call.cancelled and cancel_marked(call.request_id)
    [response] = keeper.kept
    assert response["status"] == "cancelled" and response["error"] is None and response["incomplete_details"] is None
    assert text_of(response) == "Hello there" and response["output"][0]["status"] == "incomplete"
    assert response["usage"]["output_tokens"] == 3


def test_a_client_that_leaves_a_silent_worker_has_the_response_kept_as_it_stands(monkeypatch):
    monkeypatch.setattr(response_events, "LEFT_WAIT_S", 0.3)
    started = time.monotonic()
    call, _, keeper = run_stream(delta("Hel", tokens=2), leave_at=lambda e: e["type"] == "response.output_text.delta")
    assert time.monotonic() - started < 5
    [response] = keeper.kept
    assert response["status"] == "cancelled" and text_of(response) == "Hel"
    assert (response["usage"]["input_tokens"], response["usage"]["output_tokens"]) == (3, 2)
    assert cancel_marked(call.request_id)


def test_a_client_that_leaves_once_the_response_is_whole_changes_nothing(monkeypatch):
    monkeypatch.setattr(response_events, "LEFT_WAIT_S", 30)  # a wait for a worker already done would show
    started = time.monotonic()
    call, sent, keeper = run_stream(delta("Hi"), finished("stop", 1),
                                    leave_at=lambda e: e["type"] == "response.output_item.done")
    assert time.monotonic() - started < 5
    assert [r["status"] for r in keeper.kept] == ["completed"] and not call.cancelled


async def until(predicate, *, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        await asyncio.sleep(0.01)


def test_a_client_that_does_not_stream_and_leaves_has_the_response_kept_too():
    async def scenario():
        channel = await reply_channel_with(STARTED, delta("Hel"))
        call = new_call(channel)
        await call.start()
        keeper = Keeper()
        waiting = asyncio.ensure_future(collect(call, new_builder, keeper))
        await until(lambda: call.completion_seen == 1)
        waiting.cancel()  # the client went away (Django cancels the view)
        for event in (delta("lo"), finished("abort", 2)):  # what the worker made before it stopped
            await get_channel_layer().send(channel, event)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return call, keeper

    call, keeper = asyncio.run(scenario())
    [response] = keeper.kept
    assert response["status"] == "cancelled" and text_of(response) == "Hello"
    assert response["usage"]["output_tokens"] == 2 and cancel_marked(call.request_id)


def test_a_client_that_leaves_while_its_response_is_being_stored_does_not_undo_the_store():
    """The store runs in a thread of the admission pool: cancelled with the view, it never ran."""
    async def scenario():
        call = new_call(await reply_channel_with(STARTED, delta("Hi"), finished("stop", 1)))
        await call.start()
        storing, release, kept = asyncio.Event(), asyncio.Event(), []

        async def slow_keep(response: dict) -> bool:
            storing.set()
            await release.wait()
            kept.append(response["status"])
            return True

        waiting = asyncio.ensure_future(collect(call, new_builder, slow_keep))
        await storing.wait()
        waiting.cancel()  # the client went away meanwhile
        with pytest.raises(asyncio.CancelledError):
            await waiting
        release.set()
        await until(lambda: kept)
        return kept

    assert asyncio.run(scenario()) == ["completed"]


def test_a_client_that_leaves_just_as_the_worker_finished_has_it_stored_whole():
    """The cancel lands after the call took the worker's last event, before the reply was built
    from it: the response is whole, not cancelled."""
    async def scenario():
        call = new_call(await reply_channel_with(STARTED, delta("Hi"), delta(" there"), finished("length", 2)))
        await call.start()
        counting = asyncio.Event()

        async def count_tokens_forever(tokens: int) -> None:  # where the last event is taken, not yet passed on
            counting.set()
            await asyncio.Event().wait()

        call._count_tokens = count_tokens_forever
        keeper = Keeper()
        waiting = asyncio.ensure_future(collect(call, new_builder, keeper))
        await counting.wait()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return call, keeper

    call, keeper = asyncio.run(scenario())
    [response] = keeper.kept
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert text_of(response) == "Hi there" and response["usage"]["output_tokens"] == 2


def test_a_failure_of_a_client_that_does_not_stream_is_kept_then_raised():
    async def scenario():
        call = new_call(await reply_channel_with(STARTED, delta("Hel"), finished("error", 1, "boom")))
        await call.start()
        keeper = Keeper()
        with pytest.raises(ApiError) as failed:
            await collect(call, new_builder, keeper)
        return failed.value, keeper

    error, keeper = asyncio.run(scenario())
    assert (error.status, error.code) == (500, "engine_error")
    [response] = keeper.kept
    assert response["status"] == "failed" and response["error"]["code"] == "server_error"
    assert text_of(response) == "Hel"


def test_a_bug_while_building_the_response_cancels_the_request_and_keeps_it_failed(monkeypatch):
    """The client gets a 500 with the request's id; the model does not write on for nobody."""
    def broken_feed(self, event):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ResponseBuilder, "feed", broken_feed)

    async def scenario():
        call = new_call(await reply_channel_with(STARTED, delta("Hel")))
        await call.start()
        keeper = Keeper()
        with pytest.raises(ApiError) as failed:
            await collect(call, new_builder, keeper)
        return call, failed.value, keeper

    call, error, keeper = asyncio.run(scenario())
    assert error.status == 500 and call.cancelled and cancel_marked(call.request_id)
    assert [r["status"] for r in keeper.kept] == ["failed"]


# ---------------------------------------------------------------------------------- continuing

ASKED = [{"id": "msg_q", "type": "message", "role": "user", "status": "completed",
          "content": [{"type": "input_text", "text": "Tell me a story."}]}]
WROTE = [{"id": "msg_a", "type": "message", "role": "assistant", "status": "incomplete",
          "content": [{"type": "output_text", "text": "Once upon", "annotations": [], "logprobs": []}]}]


def test_a_failed_response_cannot_be_continued_and_a_cancelled_one_can():
    with pytest.raises(ApiError) as refused:
        parse_response_request({"model": "m", "input": "Go on.", "previous_response_id": "resp_f"},
                               history=lambda rid: (ASKED + WROTE, "failed"))
    error = refused.value
    assert (error.status, error.param, error.code) == (400, "previous_response_id", "previous_response_failed")
    assert "resp_f" in error.message
    continued = parse_response_request({"model": "m", "input": "Go on.", "previous_response_id": "resp_c"},
                                       history=lambda rid: (ASKED + WROTE, "cancelled"))
    assert [m["content"] for m in continued.inference.messages] == ["Tell me a story.", "Once upon", "Go on."]


# ------------------------------------------------------------------------------- through the views

@pytest.fixture
def served(seeded, org_key):
    """An organization's own deployment of the bundled model, ready (on a queue only the test
    takes from), and its key."""
    from models_catalog.models import Deployment

    with own_deployment(org_key, seeded, prefix="unfinished", status=Deployment.Status.READY) as (_, key, name):
        yield name, key


def play_worker(name: str, *events: dict) -> threading.Thread:
    """Take the next request off the deployment's queue, as a worker does, and send ``events`` to
    its reply channel (in a thread: the view waits for them)."""
    from inference_platform.celery import app
    from workers.relay import sender

    def run():
        with app.connection_for_read() as connection:
            message = connection.SimpleQueue(f"deployment.{name}").get(timeout=20)
            message.ack()
        payload = message.payload[0][0]
        for event in events:
            sender().send(payload["reply_channel"], event)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def post(client, key: str, body: dict):
    return client.post("/v1/responses", data=json.dumps(body), content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {key}")


def get(client, key: str, path: str):
    return client.get(path, HTTP_AUTHORIZATION=f"Bearer {key}")


FAILING = (STARTED, delta("Once"), delta(" upon"), finished("error", 2, "step failed"))


@pytest.mark.django_db
def test_a_failed_response_is_an_error_to_its_client_and_stored_as_failed(client, served):
    name, key = served
    worker = play_worker(name, *FAILING)
    response = post(client, key, {"model": name, "input": "Tell me a story."})
    worker.join(timeout=20)
    assert response.status_code == 500 and response.json()["error"]["code"] == "engine_error"
    response_id = response["x-request-id"]  # the response's id: what the client can read it by
    stored = get(client, key, f"/v1/responses/{response_id}")
    assert stored.status_code == 200, stored.content
    failed = stored.json()
    assert failed["id"] == response_id and failed["status"] == "failed" and failed["store"] is True
    assert failed["error"]["code"] == "server_error" and "step failed" in failed["error"]["message"]
    assert text_of(failed) == "Once upon" and failed["usage"]["output_tokens"] == 2
    items = get(client, key, f"/v1/responses/{response_id}/input_items").json()["data"]
    assert [item["content"][0]["text"] for item in items] == ["Tell me a story."]

    refused = post(client, key, {"model": name, "input": "Go on.", "previous_response_id": response_id})
    assert refused.status_code == 400
    assert (refused.json()["error"]["param"], refused.json()["error"]["code"]) == ("previous_response_id",
                                                                                    "previous_response_failed")


@pytest.mark.django_db
@pytest.mark.filterwarnings("ignore:StreamingHttpResponse must consume")  # the test client reads it synchronously
def test_a_streamed_failure_ends_with_the_stored_failed_response(client, served):
    name, key = served
    worker = play_worker(name, *FAILING)
    response = post(client, key, {"model": name, "input": "Tell me a story.", "stream": True})
    frames = b"".join(response).decode()
    worker.join(timeout=20)
    events = [json.loads(line[6:]) for line in frames.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.failed"
    assert "event: error" not in frames
    last = events[-1]["response"]
    assert last["status"] == "failed" and last["error"]["code"] == "server_error"
    assert get(client, key, f"/v1/responses/{last['id']}").json() == last


@pytest.mark.django_db
def test_a_failed_response_asked_not_to_be_stored_is_not(client, served):
    name, key = served
    worker = play_worker(name, *FAILING)
    response = post(client, key, {"model": name, "input": "Tell me a story.", "store": False})
    worker.join(timeout=20)
    assert response.status_code == 500
    assert get(client, key, f"/v1/responses/{response['x-request-id']}").status_code == 404
