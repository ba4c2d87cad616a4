"""The WebSocket API with a real client: same chunks as SSE, cancel, dropped connections, multiplexing."""

from __future__ import annotations

import json

import pytest
from websockets.sync.client import connect

from .conftest import DEPLOYMENT
from .stats import engine_stats, wait_idle

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def ws_url(tenant) -> str:
    return tenant.base_url.replace("http://", "ws://") + "/v1/ws"


def open_ws(tenant):
    return connect(ws_url(tenant), additional_headers={"Authorization": f"Bearer {tenant.api_key}"},
                   open_timeout=30, close_timeout=5)


def frames_until_done(ws, request_id: str, *, timeout: float = 120) -> list[dict]:
    frames = []
    while True:
        frame = json.loads(ws.recv(timeout=timeout))
        if frame.get("request_id") != request_id:
            continue
        frames.append(frame)
        if frame.get("type") in ("done", "error"):
            return frames


def test_streams_the_same_text_as_the_http_api(tenant, openai_client, db_read):
    body = {"model": DEPLOYMENT, "messages": QUESTION, "temperature": 0, "max_tokens": 16}
    http = openai_client.chat.completions.create(**body)
    with open_ws(tenant) as ws:
        ws.send(json.dumps({"request_id": "a", **body, "stream_options": {"include_usage": True}}))
        frames = frames_until_done(ws, "a")
    chunks = [f for f in frames if f.get("object") == "chat.completion.chunk"]
    assert frames[-1] == {"type": "done", "request_id": "a"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == \
        http.choices[0].message.content
    assert chunks[-1]["usage"]["completion_tokens"] == http.usage.completion_tokens

    def endpoints():  # usage reports tell the two apart
        from billing.models import UsageRecord

        rows = UsageRecord.objects.filter(request_id__in=[http.id, chunks[0]["id"]]).values_list("request_id", "endpoint")
        return dict(rows)

    from tests.support import wait_until

    seen = wait_until(lambda: len(e := db_read(endpoints)) == 2 and e, timeout=60, message="both usage records")
    assert seen == {http.id: "/v1/chat/completions", chunks[0]["id"]: "/v1/ws"}


def test_several_requests_share_one_connection(tenant):
    with open_ws(tenant) as ws:
        for rid, prompt in (("x", "Count to five."), ("y", "Name a fruit.")):
            ws.send(json.dumps({"request_id": rid, "model": DEPLOYMENT, "temperature": 0, "max_tokens": 6,
                                "messages": [{"role": "user", "content": prompt}]}))
        seen = {"x": [], "y": []}
        while not all(f and f[-1].get("type") == "done" for f in seen.values()):
            frame = json.loads(ws.recv(timeout=120))
            seen[frame["request_id"]].append(frame)
    ids = {rid: {f["id"] for f in frames if "id" in f} for rid, frames in seen.items()}
    assert all(len(v) == 1 for v in ids.values()) and ids["x"] != ids["y"]


def test_cancel_message_aborts_the_request_and_frees_its_blocks(tenant, inference_worker):
    with open_ws(tenant) as ws:
        ws.send(json.dumps({"request_id": "c", "model": DEPLOYMENT, "messages": QUESTION, "max_tokens": 2000,
                            "temperature": 0, "stream_options": {"include_usage": True}}))
        first = [json.loads(ws.recv(timeout=120)) for _ in range(4)]  # the request is generating
        assert all(f["request_id"] == "c" and "choices" in f for f in first)
        ws.send(json.dumps({"type": "cancel", "request_id": "c"}))
        frames = frames_until_done(ws, "c")
    usage = [f for f in frames if f.get("usage")][-1]["usage"]
    assert 3 <= usage["completion_tokens"] < 2000
    assert engine_stats(inference_worker, DEPLOYMENT)["requests_aborted"] >= 1
    wait_idle(inference_worker, DEPLOYMENT)


def test_a_dropped_connection_aborts_the_request(tenant, inference_worker):
    aborted_before = engine_stats(inference_worker, DEPLOYMENT)["requests_aborted"]
    with open_ws(tenant) as ws:  # leaving the block drops the connection mid-answer
        ws.send(json.dumps({"request_id": "d", "model": DEPLOYMENT, "messages": QUESTION, "max_tokens": 2000}))
        for _ in range(3):
            json.loads(ws.recv(timeout=120))
    stats = wait_idle(inference_worker, DEPLOYMENT)
    assert stats["requests_aborted"] > aborted_before


def test_bad_frames_get_errors_and_the_connection_stays_usable(tenant):
    with open_ws(tenant) as ws:
        ws.send("not json")
        assert json.loads(ws.recv(timeout=30))["error"]["code"] == "invalid_json"
        ws.send(json.dumps({"request_id": "bad", "model": DEPLOYMENT, "messages": [], "max_tokens": 3}))
        frame = json.loads(ws.recv(timeout=30))
        assert frame["type"] == "error" and frame["error"]["param"] == "messages"
        ws.send("[" * 5000 + "]" * 5000)  # too deep for the JSON parser: a bad frame, not a crash
        assert json.loads(ws.recv(timeout=30))["error"]["code"] == "invalid_json"
        ws.send(json.dumps({"request_id": "big", "model": DEPLOYMENT, "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hello " * 200_000}]}))
        frame = json.loads(ws.recv(timeout=30))  # over the HTTP body limit: refused before any worker
        assert frame["type"] == "error" and frame["error"]["code"] == "request_too_large"
        ws.send(json.dumps({"request_id": "ok", "model": DEPLOYMENT, "max_tokens": 2,
                            "messages": [{"role": "user", "content": "Hi"}]}))
        assert frames_until_done(ws, "ok")[-1]["type"] == "done"


def test_a_key_revoked_while_its_connection_is_open_is_refused_from_the_next_request(tenant, db_read):
    from accounts.models import ApiKey
    from accounts.services import revoke_api_key

    ask = {"model": DEPLOYMENT, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    with open_ws(tenant) as ws:
        ws.send(json.dumps({"request_id": "before", **ask}))
        assert frames_until_done(ws, "before")[-1]["type"] == "done"
        db_read(lambda: revoke_api_key(api_key=ApiKey.objects.get(pk=tenant.api_key_id)))
        ws.send(json.dumps({"request_id": "after", **ask}))
        [frame] = frames_until_done(ws, "after")
    assert frame["type"] == "error" and frame["error"]["type"] == "invalid_request_error"
    assert "revoked" in frame["error"]["message"]


def test_a_bad_key_is_refused_at_the_handshake(tenant):
    with connect(ws_url(tenant), additional_headers={"Authorization": "Bearer sk-nope"}) as ws:
        frame = json.loads(ws.recv(timeout=30))
    assert frame["type"] == "error" and frame["error"]["type"] == "invalid_request_error"
