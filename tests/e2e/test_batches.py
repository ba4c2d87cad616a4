"""The Files and Batch APIs through the real stack, with the official client: upload a JSONL file
of requests, run them as a batch (in the worker's batch runner, through the same admission and
workers as the API), read the answers and the failures back, billed at the batch discount."""

from __future__ import annotations

import json
from decimal import Decimal

import openai
import pytest

from tests.support import assert_billed_as_priced, wait_until

from .conftest import DEPLOYMENT

pytestmark = pytest.mark.slow
QUESTIONS = ["Name a colour.", "Name a fruit.", "Name an animal."]
ENDED = ("completed", "cancelled", "expired", "failed")


def _line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


def _chat(question: str, **extra) -> dict:
    return {"model": DEPLOYMENT, "messages": [{"role": "user", "content": question}], "max_tokens": 8,
            "temperature": 0, **extra}


def _ended(client, batch_id: str, timeout: float = 240):
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).status in ENDED and b, timeout=timeout,
                      interval=0.5, message=f"batch {batch_id} to end")


def _lines(client, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []


def test_a_batch_answers_each_request_as_the_api_would_at_the_batch_price(openai_client, tenant, db_read):
    content = "".join(_line(f"q{i}", _chat(q)) for i, q in enumerate(QUESTIONS))
    content += _line("bad", _chat("Hi", temperature=5))
    uploaded = openai_client.files.create(file=("requests.jsonl", content.encode()), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(content.encode())
    batch = openai_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 4 and batch.metadata == {"job": "nightly"}

    done = _ended(openai_client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)
    answers = _lines(openai_client, done.output_file_id)
    assert [a["custom_id"] for a in answers] == ["q0", "q1", "q2"]  # input order
    for answer, question in zip(answers, QUESTIONS):
        direct = openai_client.chat.completions.create(**_chat(question))
        assert answer["response"]["status_code"] == 200 and answer["error"] is None
        assert answer["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    [failure] = _lines(openai_client, done.error_file_id)
    assert failure["custom_id"] == "bad" and failure["response"]["status_code"] == 400
    assert failure["response"]["body"]["error"]["param"] == "temperature"
    assert failure["response"]["request_id"].startswith("req_")  # named, as the API's 400 is
    assert done.usage.output_tokens == sum(a["response"]["body"]["usage"]["completion_tokens"] for a in answers)
    assert done.usage.input_tokens_details.cached_tokens == \
        sum(a["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)

    def prices():
        from billing.models import UsageRecord
        from models_catalog.models import CatalogModel

        ids = [a["id"] for a in answers]  # a batch request is billed under its line's id
        records = list(UsageRecord.objects.filter(request_id__in=ids))
        return records, CatalogModel.objects.get(slug=DEPLOYMENT)

    records, catalog = wait_until(lambda: (r := db_read(prices)) and len(r[0]) == 3 and r, timeout=30,
                                  message="the batch's usage records")
    for record in records:  # billed once each, at half the catalog's prices, as the batch's
        assert record.endpoint == "/v1/batches"
        assert record.price_input_per_mtok == catalog.price_input_per_mtok * Decimal("0.5")
        assert record.price_output_per_mtok == catalog.price_output_per_mtok * Decimal("0.5")
        assert_billed_as_priced(record)
    # Outside the key's per-minute limits: its windows hold the direct requests, none of the batch's.
    import redis
    from django.conf import settings

    windows = redis.Redis.from_url(settings.REDIS_URL)
    counted = {m.decode().split(":")[0] for name in ("req", "tok")
               for m in windows.zrange(f"rl:key:{tenant.api_key_id}:{name}", 0, -1)}
    assert len(counted) == len(QUESTIONS) and not counted & {a["response"]["request_id"] for a in answers}
    listed = [b.id for b in openai_client.batches.list(limit=5)]
    assert listed[0] == batch.id  # newest first


def test_a_cancelled_batch_keeps_what_finished_and_runs_nothing_more(openai_client):
    # Four rounds of BATCH_MAX_IN_FLIGHT (16): the cancel lands while most are still to run.
    content = "".join(_line(f"story{i}", _chat("Write a story about the sea.", max_tokens=24)) for i in range(64))
    uploaded = openai_client.files.create(file=("long.jsonl", content.encode()), purpose="batch")
    batch = openai_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
    wait_until(lambda: openai_client.batches.retrieve(batch.id).request_counts.completed >= 1, timeout=240,
               interval=0.5, message="a first answer")
    cancelling = openai_client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = _ended(openai_client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert 1 <= counts.completed < 64 and counts.completed + counts.failed == 64
    answers, failures = _lines(openai_client, done.output_file_id), _lines(openai_client, done.error_file_id)
    assert len(answers) == counts.completed and len(answers) + len(failures) == 64
    assert {f["error"]["code"] for f in failures if f["response"] is None} == {"batch_cancelled"}
    with pytest.raises(openai.BadRequestError):
        openai_client.batches.create(input_file_id=done.output_file_id, endpoint="/v1/chat/completions",
                                     completion_window="24h")  # an output file is no batch input


@pytest.mark.parametrize("content, said", [
    (b"not json\n", "Line 1 is not valid JSON"),
    (_line("a", _chat("Hi")) + _line("a", _chat("Hi")), "used twice"),
    (_line("a", _chat("Hi"), url="/v1/completions"), "endpoint"),
    (_line("a", _chat("Hi")) + _line("b", {**_chat("Hi"), "model": "other-model"}), "one model"),
])
def test_a_malformed_input_file_is_a_400_naming_its_line(openai_client, content, said):
    data = content if isinstance(content, bytes) else content.encode()
    if said.startswith("Line 1 is not"):
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client.files.create(file=("bad.jsonl", data), purpose="batch")
    else:
        uploaded = openai_client.files.create(file=("bad.jsonl", data), purpose="batch")
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
    assert said in refused.value.body["message"]


def test_files_are_the_organizations_own(openai_client, make_tenant):
    uploaded = openai_client.files.create(file=("mine.jsonl", _line("a", _chat("Hi")).encode()), purpose="batch")
    assert uploaded.id in [f.id for f in openai_client.files.list()]
    other = make_tenant()
    theirs = openai.OpenAI(base_url=f"{other.base_url}/v1", api_key=other.api_key, max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        theirs.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        theirs.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert uploaded.id not in [f.id for f in theirs.files.list()]
    assert openai_client.files.content(uploaded.id).text == _line("a", _chat("Hi"))
    assert openai_client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        openai_client.files.retrieve(uploaded.id)


def test_a_file_of_several_chunks_downloads_whole_through_the_server(openai_client):
    """Stored and streamed a chunk (1 MiB) at a time: what comes back is the upload, byte for byte."""
    from gateway.models import FileChunk

    pad = "x" * 1000
    content = "".join(_line(f"c{i}", _chat(f"{i} {pad}")) for i in range(3000)).encode()
    assert len(content) > 2 * FileChunk.CHUNK_BYTES
    uploaded = openai_client.files.create(file=("big.jsonl", content), purpose="batch")
    download = openai_client.files.content(uploaded.id)
    assert download.response.headers["content-length"] == str(len(content)) and download.content == content
