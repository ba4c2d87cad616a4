"""Every request that ran is recorded once with the tokens it produced; a cancelled stream pays
only for what it produced."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support import wait_until

from .conftest import DEPLOYMENT

pytestmark = pytest.mark.slow


def record(db_read, request_id):
    from billing.models import UsageRecord

    return db_read(lambda: UsageRecord.objects.filter(request_id=request_id).first())


def test_a_completed_request_is_recorded_once_with_its_tokens(openai_client, db_read):
    reply = openai_client.chat.completions.create(model=DEPLOYMENT, messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=5, temperature=0)
    assert reply._request_id == reply.id  # the x-request-id a client quotes is the usage record's key
    row = wait_until(lambda: record(db_read, reply.id), timeout=60, message="the usage record")
    assert row.status == "completed"
    assert (row.prompt_tokens, row.completion_tokens) == (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    assert row.cost > 0 and row.deployment_name == DEPLOYMENT


def test_a_stream_the_client_drops_is_billed_for_the_tokens_produced(tenant, db_read):
    body = {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 1500, "stream": True}
    seen = 0
    with httpx.stream("POST", f"{tenant.base_url}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {tenant.api_key}"}) as response:
        header_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                request_id = json.loads(line[6:])["id"]
                seen += 1
                if seen == 6:
                    break  # leaving the block closes the connection mid-stream
    assert header_id == request_id
    row = wait_until(lambda: record(db_read, request_id), timeout=60, message="the cancelled request's record")
    assert row.status == "cancelled"
    assert 5 <= row.completion_tokens < 1500
