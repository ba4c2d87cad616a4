"""Every request that ran is recorded once with the tokens it produced; a cancelled stream pays
only for what it produced."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support import assert_billed_as_priced, wait_until

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
    assert row.deployment_name == DEPLOYMENT
    # The engine's own figures travel with it: timings, and the batch it was decoded in.
    assert 0 <= row.queue_ms <= row.ttft_ms <= row.latency_ms
    assert row.mean_batch_size is not None and row.mean_batch_size >= 1
    # The catalog's prices are applied, and the charge is billing's one cost function of them.
    catalog = db_read(lambda: catalog_model(row.model))
    assert_billed_as_priced(row)
    assert (row.price_input_per_mtok, row.price_cached_input_per_mtok, row.price_output_per_mtok,
            row.price_per_request) == (catalog.price_input_per_mtok, catalog.price_cached_input_per_mtok,
                                       catalog.price_output_per_mtok, catalog.price_per_request)


def catalog_model(slug):
    from models_catalog.models import CatalogModel

    return CatalogModel.objects.get(slug=slug)


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
    assert_billed_as_priced(row)


EOS = 2  # the bundled model's end of turn: banned below, so only the client's leaving ends the request
PRICE_COLUMNS = ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "price_per_request")


def test_a_price_changed_while_a_request_runs_does_not_apply_to_it(tenant, db_read):
    """The prices in effect when a request was admitted bill it: the catalog's change while it
    streams, before its usage event even leaves the worker, and still its record has the old ones."""
    from models_catalog.models import CatalogModel
    from models_catalog.services import update_catalog_model

    model = db_read(lambda: CatalogModel.objects.get(deployments__name=DEPLOYMENT))
    before = {name: getattr(model, name) for name in PRICE_COLUMNS}
    body = {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 1500, "stream": True, "logit_bias": {str(EOS): -100}}
    try:
        with httpx.stream("POST", f"{tenant.base_url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {tenant.api_key}"}) as response:
            chunks = (json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))
            request_id = next(chunk["id"] for chunk in chunks if chunk["choices"][0]["delta"].get("content"))
            assert record(db_read, request_id) is None  # admitted and running: nothing billed yet
            db_read(lambda: update_catalog_model(catalog_model=model,
                                                 **{name: price * 10 + 1 for name, price in before.items()}))
        # Leaving the block closes the stream: the request ends now, after the change.
        row = wait_until(lambda: record(db_read, request_id), timeout=60, message="the request's record")
    finally:
        db_read(lambda: update_catalog_model(catalog_model=model, **before))
    assert row.status == "cancelled" and row.completion_tokens >= 1
    assert {name: getattr(row, name) for name in PRICE_COLUMNS} == before
    assert_billed_as_priced(row)
