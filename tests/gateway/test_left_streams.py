"""A streaming client that leaves before its first frame, or while one is being written, has its
request cancelled at once (the model must not write on, billed, for nobody), and a Responses
reply stored as the model left it: not when its frames' generator happens to be collected, and
even when that generator never started.

Through the server's ASGI application, on the real Redis, with the test taking the request off
the deployment's queue as a worker does; the server's writes are the test's, and the ones it
holds back never complete, as for a client that is gone."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from gateway.models import StoredResponse
from tests.gateway.test_timeouts import cancel_marked
from tests.gateway.test_unfinished_responses import STARTED, delta, finished, served  # noqa: F401
from tests.project.test_api_handler import application  # noqa: F401

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def connections_kept():
    """As Django's test client does: the handler's hooks at a request's start and end would close
    the test's connection, whose transaction holds the deployment."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    for signal in (request_started, request_finished):
        signal.disconnect(close_old_connections)
    yield
    for signal in (request_started, request_finished):
        signal.connect(close_old_connections)


def worker_until_cancelled(name: str) -> threading.Thread:
    """Take the next request off the deployment's queue, start it and write one token; once its
    cancel is marked, end it as aborted, as a worker does."""
    from inference_platform.celery import app
    from workers.relay import sender

    def run():
        with app.connection_for_read() as connection:
            message = connection.SimpleQueue(f"deployment.{name}").get(timeout=20)
            message.ack()
        payload = message.payload[0][0]
        reply = payload["reply_channel"]
        sender().send(reply, STARTED)
        sender().send(reply, delta("Once"))
        deadline = time.monotonic() + 20
        while not cancel_marked(payload["request_id"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        sender().send(reply, finished("abort", 1))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


async def post_and_leave(app, path: str, key: str, body: dict, *, at_frame: int) -> dict:
    """POST ``body`` to ``path`` as a client that leaves as the server writes its ``at_frame``th
    body frame (0: its status line), a write that never completes. The response's headers."""
    left = asyncio.Event()
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    headers: dict = {}
    frames = 0

    async def receive():
        if request:
            return request.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal frames
        if message["type"] == "http.response.start":
            headers.update((name.decode().lower(), value.decode()) for name, value in message["headers"])
        elif message.get("body"):
            frames += 1
        if frames == at_frame:
            left.set()
            await asyncio.Event().wait()  # the client is gone: this write never goes out

    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http", "client": ("127.0.0.1", 50000),
             "server": ("127.0.0.1", 80), "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                                                       (b"authorization", f"Bearer {key}".encode())]}
    await app(scope, receive, send)
    return headers


def leave_and_wait(application, served, path: str, body: dict, at_frame: int, outcome):
    """Stream ``body`` to ``path`` as a client that leaves at its ``at_frame``th frame, with a
    worker that ends the request once it is cancelled; then wait for ``outcome(headers)`` (async:
    None until it is there). The response's headers and the outcome."""
    name, key = served
    worker = worker_until_cancelled(name)

    async def scenario():
        headers = await post_and_leave(application, path, key, {"model": name, **body, "stream": True},
                                       at_frame=at_frame)
        deadline = time.monotonic() + 20
        while (found := await outcome(headers)) is None:
            assert time.monotonic() < deadline, "timed out waiting for the outcome"
            await asyncio.sleep(0.01)
        return headers, found

    result = async_to_sync(scenario)()
    worker.join(timeout=20)
    assert not worker.is_alive()
    return result


AT_FRAMES = pytest.mark.parametrize("at_frame", [0, 1], ids=["before-the-first-frame", "during-a-write"])


@AT_FRAMES
def test_a_chat_client_that_leaves_has_its_request_cancelled(application, served, at_frame):  # noqa: F811
    async def cancelled(headers):
        return True if cancel_marked(headers["x-request-id"], void=False) else None  # the client's: billed

    headers, _ = leave_and_wait(application, served, "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "Hi"}]}, at_frame, cancelled)
    assert headers["content-type"] == "text/event-stream"


@AT_FRAMES
def test_a_responses_client_that_leaves_has_its_response_stored_as_cancelled(application, served, at_frame):  # noqa: F811
    @sync_to_async
    def stored(headers):
        row = StoredResponse.objects.filter(pk=headers["x-request-id"]).first()
        return json.loads(row.response) if row is not None else None

    _, response = leave_and_wait(application, served, "/v1/responses", {"input": "Tell me a story."}, at_frame,
                                 stored)
    assert response["status"] == "cancelled"
    assert response["output"][0]["content"][0]["text"] == "Once"  # what the model wrote before it stopped
    assert response["usage"]["output_tokens"] == 1  # the worker's, what it billed
