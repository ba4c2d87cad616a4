"""The WebSocket consumer's own rules, in process (the live ones are in tests/e2e/test_websocket.py):
request ids as clients send them, a cancel before the request started, a failure that is not the
client's. Admission is replaced by a stand-in the test controls; the connection is authenticated."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from asgiref.testing import ApplicationCommunicator

from gateway import calls
from gateway.consumers import InferenceConsumer

BODY = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def converse(frames: list[dict], begin, replies: int) -> list[dict]:
    """Send ``frames`` over an authenticated connection whose admission is ``begin``; the first
    ``replies`` frames the server sends."""
    key = SimpleNamespace(pk=1, has_scope=lambda scope: True)
    scope = {"type": "websocket", "path": "/v1/ws", "query_string": b"", "headers": [], "subprotocols": [],
             "api_key": key, "organization": SimpleNamespace(pk=1), "auth_error": None}

    async def run():
        communicator = ApplicationCommunicator(InferenceConsumer.as_asgi(), scope)
        await communicator.send_input({"type": "websocket.connect"})
        assert (await communicator.receive_output(5))["type"] == "websocket.accept"
        for frame in frames:
            await communicator.send_input({"type": "websocket.receive", "text": json.dumps(frame)})
        out = [json.loads((await communicator.receive_output(5))["text"]) for _ in range(replies)]
        await communicator.send_input({"type": "websocket.disconnect", "code": 1000})
        await communicator.wait(2)
        return out

    original = calls.begin
    calls.begin = begin
    try:
        return asyncio.run(run())
    finally:
        calls.begin = original


async def never_admitted(caller, request):
    await asyncio.Event().wait()


async def broken(caller, request):
    raise RuntimeError("a bug in admission")


def test_a_request_id_that_is_not_a_string_or_number_is_refused():
    [frame] = converse([{"request_id": [1], **BODY}], never_admitted, 1)
    assert frame["type"] == "error" and frame["error"]["param"] == "request_id"


@pytest.mark.parametrize("request_id", [7, "seven"])
def test_a_cancel_before_the_request_started_ends_it_with_done(request_id):
    [frame] = converse([{"request_id": request_id, **BODY}, {"type": "cancel", "request_id": request_id}],
                       never_admitted, 1)
    assert frame == {"type": "done", "request_id": request_id, "cancelled": True}  # as the client sent it


def test_a_failure_that_is_not_the_clients_gets_an_error_frame_and_the_connection_stays():
    frames = converse([{"request_id": "a", **BODY}, {"request_id": "b", "endpoint": {"x": 1}, **BODY}],
                      broken, 2)
    by_id = {frame["request_id"]: frame for frame in frames}
    assert by_id["a"]["error"]["code"] == "internal_error"
    assert by_id["b"]["error"]["param"] == "endpoint"  # an unhashable endpoint: refused, not a crash
