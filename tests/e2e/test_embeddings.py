"""``POST /v1/embeddings`` through the whole stack with the official client: each input's
embedding as the engine computes it, in numbers or base64, cut to ``dimensions``; billed for its
input tokens; bad input refused, unbilled."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.support import assert_billed_as_priced, wait_until
from workers.engine import SamplingParams

from .conftest import DEPLOYMENT

pytestmark = pytest.mark.slow
TEXTS = ["The sea is calm tonight.", "def add(a, b): return a + b", "Bonjour"]


def test_each_input_gets_the_engines_embedding_billed_for_its_tokens(openai_client, reference_engine, tenant, db_read):
    reply = openai_client.embeddings.create(model=DEPLOYMENT, input=TEXTS, encoding_format="float")
    assert reply.object == "list" and reply.model == DEPLOYMENT and [d.index for d in reply.data] == [0, 1, 2]
    tokens = [reference_engine.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(t) for t in tokens)
    for data, ids in zip(reply.data, tokens):
        expected = reference_engine.submit(ids, SamplingParams(embed=True)).result(timeout=120).embedding
        got = np.asarray(data.embedding, dtype=np.float32)
        assert got.shape == expected.shape and abs(np.linalg.norm(got) - 1) < 1e-3
        assert float(got @ expected) > 0.995  # the worker's dtype may be bfloat16
    # The client's default (base64, decoded by it), token ids, and a shorter embedding.
    default = openai_client.embeddings.create(model=DEPLOYMENT, input=TEXTS[0])
    assert np.abs(np.asarray(default.data[0].embedding) - np.asarray(reply.data[0].embedding)).max() < 1e-6
    by_ids = openai_client.embeddings.create(model=DEPLOYMENT, input=[tokens[1]], encoding_format="float")
    assert np.abs(np.asarray(by_ids.data[0].embedding) - np.asarray(reply.data[1].embedding)).max() < 1e-3
    short = openai_client.embeddings.create(model=DEPLOYMENT, input="Bonjour", dimensions=64, encoding_format="float")
    cut = np.asarray(reply.data[2].embedding[:64])
    assert len(short.data[0].embedding) == 64 and np.abs(np.asarray(short.data[0].embedding)
                                                         - cut / np.linalg.norm(cut)).max() < 1e-3

    def records():
        from billing.models import UsageRecord

        return list(UsageRecord.objects.filter(organization_id=tenant.organization_id, request_id__startswith="embd-"))

    billed = wait_until(lambda: len(r := db_read(records)) == 4 and r, timeout=60, message="4 usage records")
    first = next(r for r in billed if r.prompt_tokens == reply.usage.prompt_tokens)
    assert first.completion_tokens == 0 and first.status == "completed"
    assert_billed_as_priced(first)
    assert {r.endpoint for r in billed} == {"/v1/embeddings"}


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", 5]}, "input"),
    ({"input": "ok", "dimensions": 100000}, "dimensions"),
    ({"input": "ok", "dimensions": 0}, "dimensions"),
    ({"input": "ok", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "ok", "stream": True}, "stream"),
    ({"input": "hello " * 9000}, "input"),  # longer than the context
])
def test_bad_input_is_a_400_naming_it_and_not_billed(tenant, body, param, db_read):
    response = httpx.post(f"{tenant.base_url}/v1/embeddings", json={"model": DEPLOYMENT, **body}, timeout=120,
                          headers={"Authorization": f"Bearer {tenant.api_key}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]

    def records():
        from billing.models import UsageRecord

        return list(UsageRecord.objects.filter(organization_id=tenant.organization_id)
                    .values_list("request_id", flat=True))

    # A good request after it: once its own record is in, the refused one has none (they queue in order).
    good = httpx.post(f"{tenant.base_url}/v1/embeddings", json={"model": DEPLOYMENT, "input": "ok"}, timeout=120,
                      headers={"Authorization": f"Bearer {tenant.api_key}"})
    assert good.status_code == 200
    wait_until(lambda: good.headers["x-request-id"] in db_read(records), timeout=60,
               message="the good request's usage record")
    assert db_read(records) == [good.headers["x-request-id"]]


def test_an_unknown_model_is_a_404(openai_client):
    with pytest.raises(openai.NotFoundError):
        openai_client.embeddings.create(model="no-such-model", input="hi")


def test_a_batch_of_embeddings_answers_each_line(openai_client):
    import json

    lines = "".join(json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": DEPLOYMENT, "input": text}}) + "\n" for i, text in enumerate(TEXTS))
    uploaded = openai_client.files.create(file=("embed.jsonl", lines.encode()), purpose="batch")
    batch = openai_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    done = wait_until(lambda: (b := openai_client.batches.retrieve(batch.id)).status in ("completed", "failed")
                      and b, timeout=240, interval=0.5, message="the batch to end")
    assert done.status == "completed" and done.request_counts.completed == len(TEXTS)
    answers = [json.loads(line) for line in openai_client.files.content(done.output_file_id).text.splitlines()]
    direct = openai_client.embeddings.create(model=DEPLOYMENT, input=TEXTS[0], encoding_format="float")
    first = answers[0]["response"]["body"]
    assert answers[0]["custom_id"] == "e0" and first["object"] == "list"
    assert np.abs(np.asarray(first["data"][0]["embedding"]) - np.asarray(direct.data[0].embedding)).max() < 1e-3


def test_the_dashboards_embeddings_example_runs_as_shown(tenant):
    """The code the model and deployment pages show, run as a user would paste it."""
    import os
    import subprocess
    import sys

    from dashboard import snippets

    code = snippets.examples(base_url=f"{tenant.base_url}/v1", ws_url="", model=DEPLOYMENT)["embeddings"]
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, snippets.KEY_VARIABLE: tenant.api_key})
    assert run.returncode == 0, run.stderr
    first, second, usage = run.stdout.splitlines()
    size = first.split()[0]
    assert int(size) > 0 and first == f"{size} GPUs run matrix multiplications." and second.startswith(f"{size} The sea")
    assert int(usage.split()[0]) > 0 and usage.endswith(" tokens")
