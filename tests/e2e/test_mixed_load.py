"""A mixed load, as many real clients make it at once: streams read to the end, streams dropped
midway, plain answers, WebSocket requests cancelled midway and invalid requests. Afterwards the
books must balance: each admitted request recorded once, with no more output than it produced and
at least what reached its client; nothing recorded for a refused one; the organization's running
totals equal to its rows; and every KV block free again."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from websockets.sync.client import connect

from tests.support import wait_until

from .conftest import DEPLOYMENT
from .stats import wait_idle

pytestmark = pytest.mark.slow

REQUESTS = 36
CLIENTS = 12
NO_END = {"0": -100, "2": -100}  # the end-of-text tokens banned: only max_tokens or the client ends it


@dataclass
class Outcome:
    kind: str
    request_id: str | None = None  # None: refused before admission
    received: int = 0  # output tokens that reached the client (content chunks, or usage when sent)
    usage: int | None = None  # completion_tokens the API reported, when it did


def prompt(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": f"Write about the number {rng.randint(1, 10**6)}."}]


def stream_to_end(tenant, rng) -> Outcome:
    body = {"model": DEPLOYMENT, "messages": prompt(rng), "max_tokens": rng.randint(1, 16), "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": NO_END}
    outcome = Outcome("stream")
    with _stream(tenant, body) as response:
        assert response.status_code == 200
        for data in _events(response):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            outcome.request_id = chunk["id"]
            if chunk.get("usage"):
                outcome.usage = chunk["usage"]["completion_tokens"]
            outcome.received += sum(1 for c in chunk["choices"] if c["delta"].get("content"))
    assert outcome.usage == body["max_tokens"]
    return outcome


def stream_then_drop(tenant, rng) -> Outcome:
    body = {"model": DEPLOYMENT, "messages": prompt(rng), "max_tokens": 400, "stream": True, "logit_bias": NO_END}
    outcome, leave_after = Outcome("drop"), rng.randint(1, 6)
    with _stream(tenant, body) as response:
        assert response.status_code == 200
        outcome.request_id = response.headers["x-request-id"]
        for data in _events(response):
            chunk = json.loads(data)
            outcome.received += sum(1 for c in chunk["choices"] if c["delta"].get("content"))
            if outcome.received >= leave_after:
                break  # leaving the block closes the connection mid-answer
    return outcome


def plain(tenant, rng) -> Outcome:
    body = {"model": DEPLOYMENT, "prompt": f"Number {rng.randint(1, 10**6)} is", "max_tokens": rng.randint(1, 12)}
    response = httpx.post(f"{tenant.base_url}/v1/completions", json=body, timeout=120, headers=_auth(tenant))
    assert response.status_code == 200, response.text
    reply = response.json()
    completion = reply["usage"]["completion_tokens"]
    return Outcome("plain", reply["id"], completion, completion)


def websocket_then_cancel(tenant, rng) -> Outcome:
    outcome, cancel_after = Outcome("ws-cancel"), rng.randint(1, 6)
    url = tenant.base_url.replace("http://", "ws://") + "/v1/ws"
    with connect(url, additional_headers=_auth(tenant), open_timeout=30, close_timeout=5) as ws:
        ws.send(json.dumps({"request_id": "r", "model": DEPLOYMENT, "messages": prompt(rng), "max_tokens": 400,
                            "logit_bias": NO_END, "stream_options": {"include_usage": True}}))
        while True:
            frame = json.loads(ws.recv(timeout=120))
            if frame.get("type") == "done":
                break
            assert frame.get("type") != "error", frame
            outcome.request_id = frame["id"]
            if frame.get("usage"):
                outcome.usage = frame["usage"]["completion_tokens"]
            outcome.received += sum(1 for c in frame["choices"] if c["delta"].get("content"))
            if outcome.received == cancel_after:
                ws.send(json.dumps({"type": "cancel", "request_id": "r"}))
    assert outcome.usage is not None and outcome.usage < 400
    return outcome


def refused(tenant, rng) -> Outcome:
    body = rng.choice([
        {"model": DEPLOYMENT, "messages": prompt(rng), "temperature": 7},
        {"model": "no-such-model", "messages": prompt(rng)},
        {"model": DEPLOYMENT, "messages": []},
        {"model": DEPLOYMENT, "messages": prompt(rng), "n": 0},
    ])
    response = httpx.post(f"{tenant.base_url}/v1/chat/completions", json=body, timeout=60, headers=_auth(tenant))
    assert 400 <= response.status_code < 500 and "error" in response.json(), response.text
    return Outcome("refused")


ACTIONS = [stream_to_end, stream_then_drop, plain, websocket_then_cancel, refused]


def _auth(tenant) -> dict:
    return {"Authorization": f"Bearer {tenant.api_key}"}


def _stream(tenant, body):
    return httpx.stream("POST", f"{tenant.base_url}/v1/chat/completions", json=body, timeout=120,
                        headers=_auth(tenant))


def _events(response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def test_a_mixed_load_leaves_every_request_billed_once_and_every_block_free(tenant, inference_worker, db_read):
    rng = random.Random(20261124)
    plan = [(rng.choice(ACTIONS), random.Random(rng.random())) for _ in range(REQUESTS)]
    with ThreadPoolExecutor(CLIENTS) as pool:
        outcomes = list(pool.map(lambda step: step[0](tenant, step[1]), plan))
    assert {o.kind for o in outcomes} == {"stream", "drop", "plain", "ws-cancel", "refused"}

    admitted = {o.request_id: o for o in outcomes if o.kind != "refused"}
    assert None not in admitted and len(admitted) == sum(o.kind != "refused" for o in outcomes)
    wait_until(lambda: len(records(db_read, tenant)) >= len(admitted), timeout=90,
               message="a usage record for every admitted request")
    rows = records(db_read, tenant)
    assert sorted(r.request_id for r in rows) == sorted(admitted)  # each once, and nothing for the refused

    for row in rows:
        outcome = admitted[row.request_id]
        if outcome.usage is not None:  # the client was told the count: the bill agrees with it
            assert row.completion_tokens == outcome.usage, (outcome, row.completion_tokens)
        # Billed for no less than reached the client, and no more than was asked for.
        assert outcome.received <= row.completion_tokens <= 400, (outcome, row.completion_tokens)
        expected = "completed" if outcome.kind in ("stream", "plain") else "cancelled"
        assert row.status == expected, (outcome, row.status)

    from billing import totals

    # One charge per billed record, of its cost; the running totals equal what the rows add up to.
    assert charges(db_read, tenant) == {row.request_id: row.cost for row in rows if row.cost > 0}
    stored, truth = db_read(lambda: totals.reconcile(organization_id=tenant.organization_id, fix=False))
    assert stored == truth
    wait_idle(inference_worker, DEPLOYMENT, timeout=60)


def records(db_read, tenant) -> list:
    from billing.models import UsageRecord

    return db_read(lambda: list(UsageRecord.objects.filter(organization_id=tenant.organization_id)))


def charges(db_read, tenant) -> dict:
    from billing.models import LedgerEntry

    entries = db_read(lambda: list(LedgerEntry.objects.filter(organization_id=tenant.organization_id,
                                                              kind=LedgerEntry.Kind.USAGE)))
    charged = {entry.reference: -entry.amount for entry in entries}
    assert len(charged) == len(entries), "a request charged twice"
    return charged
