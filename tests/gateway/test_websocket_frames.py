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
            text = frame if isinstance(frame, str) else json.dumps(frame, ensure_ascii=False)
            await communicator.send_input({"type": "websocket.receive", "text": text})
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


async def never_admitted(request, *, caller, endpoint):
    await asyncio.Event().wait()


async def broken(request, *, caller):
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


def test_a_request_without_an_id_gets_one_its_frames_carry():
    frames = converse([{**BODY}, {**BODY}], broken, 2)
    ids = [frame["request_id"] for frame in frames]
    assert all(isinstance(i, str) and len(i) == 32 for i in ids) and ids[0] != ids[1]  # one each
    assert [frame["error"]["code"] for frame in frames] == ["internal_error", "internal_error"]


def test_a_frame_of_another_type_is_refused_not_taken_for_a_request():
    [frame] = converse([{"type": "bogus", "request_id": "t", **BODY}], never_admitted, 1)
    assert frame["type"] == "error" and frame["request_id"] == "t" and frame["error"]["param"] == "type"


def test_a_frame_nested_too_deeply_for_the_parser_is_bad_json_and_the_connection_stays():
    frames = converse(["[" * 5000 + "]" * 5000, {"request_id": 1, **BODY}], broken, 2)
    assert frames[0]["error"]["code"] == "invalid_json"
    assert frames[1]["request_id"] == 1 and frames[1]["error"]["code"] == "internal_error"  # still served


def test_a_frame_over_the_body_limit_is_refused_before_it_is_parsed(settings):
    settings.GATEWAY_MAX_BODY_BYTES = 2048
    [frame] = converse([{"request_id": "big", **BODY, "messages": [{"role": "user", "content": "é" * 1100}]}],
                       never_admitted, 1)  # 1,100 characters, 2,200 bytes
    assert frame["error"]["code"] == "request_too_large" and frame["request_id"] is None


@pytest.mark.parametrize("refusal", [OSError("the client disconnected"),  # uvicorn's ClientDisconnected
                                     RuntimeError("Unexpected ASGI message 'websocket.send', after sending "
                                                  "'websocket.close'")])  # a send after the close
def test_a_client_gone_mid_stream_ends_its_request_quietly(monkeypatch, caplog, refusal):
    """The server's send fails once the client closed: the request is cancelled, and nothing is
    logged as a failure (an alert on errors would fire)."""
    cancelled = asyncio.Event()

    class Streaming:
        request_id, created, fingerprint = "chatcmpl-gone", 0, None

        async def cancel(self):
            cancelled.set()

    async def admitted(request, *, caller, endpoint):
        return Streaming(), {}

    async def chunks(call, ctx, include_usage):
        yield {"choices": []}

    async def closed(self, text_data=None, **kwargs):
        raise refusal

    async def run():
        scope = {"type": "websocket", "path": "/v1/ws", "query_string": b"", "headers": [], "subprotocols": [],
                 "api_key": SimpleNamespace(pk=1, has_scope=lambda scope: True),
                 "organization": SimpleNamespace(pk=1), "auth_error": None}
        communicator = ApplicationCommunicator(InferenceConsumer.as_asgi(), scope)
        await communicator.send_input({"type": "websocket.connect"})
        assert (await communicator.receive_output(5))["type"] == "websocket.accept"
        monkeypatch.setattr(InferenceConsumer, "send", closed)  # from here on, the client is gone
        await communicator.send_input({"type": "websocket.receive", "text": json.dumps({"request_id": "a", **BODY})})
        await asyncio.wait_for(cancelled.wait(), 5)
        await communicator.send_input({"type": "websocket.disconnect", "code": 1006})
        await communicator.wait(2)

    monkeypatch.setattr(calls, "begin", admitted)
    monkeypatch.setattr("gateway.consumers.stream_chunks", chunks)
    with caplog.at_level("ERROR"):
        asyncio.run(run())
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
