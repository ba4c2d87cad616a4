"""The Batch API in the process: reading an input file, the batch's lifecycle in the database
(the lease of its runner, its outcomes, its output and error files), and the endpoints' refusals.
The runs themselves, through the real stack, are in tests/e2e/test_batches.py."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from gateway import batch_input, selectors, services
from gateway.errors import ApiError
from gateway.models import Batch, FileChunk, UploadedFile

CHAT = "/v1/chat/completions"


def _line(custom_id="a", url=CHAT, model="smol", **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": model, "messages": [{"role": "user", "content": "Hi"}]}, **extra}) + "\n"


# ------------------------------------------------------------------------------------ input files

def test_an_input_file_is_read_into_its_requests_and_model():
    requests, model = batch_input.read_requests((_line("a") + "\n  \n" + _line("b")).encode(), endpoint=CHAT)
    assert [r["custom_id"] for r in requests] == ["a", "b"] and model == "smol"
    assert requests[0]["body"]["messages"] == [{"role": "user", "content": "Hi"}]


def test_only_a_newline_ends_a_line_and_a_byte_order_mark_is_no_part_of_it():
    # As json.dumps(ensure_ascii=False) writes them: separators that str.splitlines would split on.
    text = json.dumps({"custom_id": "a\u2028b\x85c\x1cd", "method": "POST", "url": CHAT,
                       "body": {"model": "smol"}}, ensure_ascii=False)
    requests, _ = batch_input.read_requests(("\ufeff" + text + "\r\n").encode(), endpoint=CHAT)
    assert requests[0]["custom_id"] == "a\u2028b\x85c\x1cd"


@pytest.mark.parametrize("content, said", [
    (b"\xff\xfe", "not UTF-8"),
    (b"[1, 2]\n", "Line 1 is not a JSON object"),
    (_line("a") + "{not json\n", "Line 2 is not valid JSON"),
    (_line("") , "Line 1: custom_id"),
    (_line("a") + _line("a"), "Line 2: custom_id \"a\" is used twice"),
    (_line("a", method="GET"), "method"),
    (_line("a", url="/v1/embeddings"), "a batch runs one endpoint"),
    (_line("a") + _line("b", model="other"), "Line 2: body.model is \"other\""),
    (json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": []}), "body must be a JSON object"),
    (b"\n\n", "no requests"),
])
def test_a_malformed_input_file_is_a_400_naming_the_line(content, said):
    with pytest.raises(ApiError) as refused:
        batch_input.read_requests(content.encode() if isinstance(content, str) else content, endpoint=CHAT)
    assert refused.value.status == 400 and refused.value.param == "input_file_id"
    assert said in refused.value.message, refused.value.message


def test_a_file_of_more_requests_than_a_batch_takes_is_refused(monkeypatch):
    monkeypatch.setattr(batch_input, "MAX_REQUESTS", 2)
    with pytest.raises(ApiError) as refused:
        batch_input.read_requests("".join(_line(str(i)) for i in range(3)).encode(), endpoint=CHAT)
    assert "more than 2 requests" in refused.value.message


def test_a_batch_is_billed_at_its_share_of_the_prices():
    from gateway.calls import _scaled

    prices = {"input_per_mtok": "0.05", "cached_input_per_mtok": "0.025", "output_per_mtok": "0.10",
              "per_request": "0.000003"}
    assert _scaled(prices, Decimal("0.5")) == {"input_per_mtok": "0.0250000000", "cached_input_per_mtok": "0.0125000000",
                                               "output_per_mtok": "0.0500000000", "per_request": "0.0000015000"}
    assert _scaled(prices, Decimal("0.333"))["per_request"] == "0.0000009990"  # ten places, as a record keeps


# ------------------------------------------------------------------------------------- lifecycle

def _batch(org, key, *, lines: int = 4, age: timedelta = timedelta(), **fields) -> Batch:
    requests = [{"custom_id": f"c{i}", "body": {"model": "smol"}} for i in range(lines)]
    now = timezone.now() - age
    return Batch.objects.create(pk=f"batch_{len(requests)}_{timezone.now().timestamp()}", organization=org,
                                api_key=key, endpoint=CHAT, model="smol", input_file_id="file-x",
                                requests=json.dumps(requests), total=lines, completion_window="24h", created_at=now,
                                in_progress_at=now, expires_at=now + timedelta(hours=24), **fields)


def _answer(text: str) -> dict:
    return {"id": "chatcmpl-1", "choices": [{"message": {"content": text}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}}


@pytest.mark.django_db
def test_a_creation_starts_its_runner_once_committed(org_key, django_capture_on_commit_callbacks, monkeypatch):
    from gateway import tasks

    started = []
    monkeypatch.setattr(tasks.run_batch, "delay", started.append)
    org, key, _ = org_key()
    with django_capture_on_commit_callbacks(execute=True):
        batch = services.create_batch(organization_id=org.pk, api_key_id=key.pk, endpoint=CHAT, input_file_id="file-x",
                                      requests=[{"custom_id": "a", "body": {"model": "smol"}}], model="smol",
                                      metadata={"k": "v"})
        assert started == []  # not before the batch is there for the runner to read
    assert started == [batch.pk]
    shown = selectors.batch_json(batch)
    assert shown["status"] == "in_progress" and shown["request_counts"] == {"total": 1, "completed": 0, "failed": 0}
    assert shown["expires_at"] - shown["created_at"] == 24 * 3600 and shown["metadata"] == {"k": "v"}


@pytest.mark.django_db
def test_one_runner_at_a_time_and_a_silent_one_is_replaced(org_key, monkeypatch):
    from gateway import tasks

    org, key, _ = org_key()
    batch = _batch(org, key, age=timedelta(minutes=5))
    lease = timedelta(seconds=60)
    _, first = services.claim_batch(batch_id=batch.pk, lease=lease)
    assert services.claim_batch(batch_id=batch.pk, lease=lease) is None  # the first one is alive
    assert services.beat_batch(batch_id=batch.pk, token=first) == "in_progress"
    assert services.silent_batches() == []
    Batch.objects.filter(pk=batch.pk).update(runner_seen_at=timezone.now() - timedelta(seconds=61))
    resumed = []
    monkeypatch.setattr(tasks.run_batch, "delay", resumed.append)
    assert tasks.resume_batches() == 1 and resumed == [batch.pk]
    _, second = services.claim_batch(batch_id=batch.pk, lease=lease)
    # The first runner, back from a stall, finds its lease gone: it stops, and cannot release it.
    assert services.beat_batch(batch_id=batch.pk, token=first) is None
    services.release_batch(batch_id=batch.pk, token=first)
    assert services.claim_batch(batch_id=batch.pk, lease=lease) is None
    assert services.finish_batch(batch_id=batch.pk, token=first).status == "in_progress"  # not its to end
    services.release_batch(batch_id=batch.pk, token=second)  # a stopping worker's: the next resume takes it
    assert services.silent_batches() == [batch.pk]
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.COMPLETED)
    assert services.claim_batch(batch_id=batch.pk, lease=lease) is None and services.silent_batches() == []
    assert not UploadedFile.objects.exists()  # the refused finish left no file behind


@pytest.mark.django_db
def test_a_silent_cancelled_or_expired_batch_is_ended_by_the_resume_itself(org_key, monkeypatch):
    from gateway import tasks

    org, key, _ = org_key()
    started = []
    monkeypatch.setattr(tasks.run_batch, "delay", started.append)
    cancelled = _batch(org, key, lines=1, age=timedelta(minutes=5), status=Batch.Status.CANCELLING)
    expired = _batch(org, key, lines=1, age=timedelta(hours=25))
    assert tasks.resume_batches() == 2 and started == []
    assert Batch.objects.get(pk=cancelled.pk).status == "cancelled"
    assert Batch.objects.get(pk=expired.pk).status == "expired"


@pytest.mark.django_db
@pytest.mark.parametrize("chunk_bytes", [FileChunk.CHUNK_BYTES, 7])
def test_the_output_holds_the_answers_and_the_errors_the_rest_in_input_order(org_key, monkeypatch, chunk_bytes):
    monkeypatch.setattr(FileChunk, "CHUNK_BYTES", chunk_bytes)  # 7: many chunks, lines cut across them
    org, key, _ = org_key()
    batch = _batch(org, key)
    services.record_outcome(batch_id=batch.pk, line=2, request_id="chatcmpl-2", status_code=200, body=_answer("two"))
    services.record_outcome(batch_id=batch.pk, line=0, request_id="chatcmpl-0", status_code=200, body=_answer("zero"))
    services.record_outcome(batch_id=batch.pk, line=1, request_id="", status_code=400,
                            body={"error": {"param": "temperature"}})
    services.record_outcome(batch_id=batch.pk, line=0, request_id="chatcmpl-x", status_code=500, body={})  # dropped
    assert selectors.done_lines(batch_id=batch.pk) == {0, 1, 2}
    services.cancel_batch(batch=batch)
    ended = services.finish_batch(batch_id=batch.pk)
    assert ended.status == "cancelled" and ended.cancelled_at and ended.cancelling_at

    def lines(file_id):
        return [json.loads(line) for line in selectors.file_content(organization_id=org.pk, file_id=file_id)
                .decode().splitlines()]

    answers, errors = lines(ended.output_file_id), lines(ended.error_file_id)
    assert [(a["custom_id"], a["response"]["body"]["choices"][0]["message"]["content"]) for a in answers] == \
        [("c0", "zero"), ("c2", "two")]
    assert answers[0]["response"]["request_id"] == "chatcmpl-0" and answers[0]["id"].startswith("batch_req_")
    assert [(e["custom_id"], e["response"] and e["response"]["status_code"]) for e in errors] == \
        [("c1", 400), ("c3", None)]
    assert errors[1]["error"]["code"] == "batch_cancelled"
    shown = selectors.batch_json(ended)
    assert shown["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert shown["usage"]["input_tokens"] == 10 and shown["usage"]["output_tokens"] == 4
    assert shown["usage"]["input_tokens_details"]["cached_tokens"] == 6
    output = UploadedFile.objects.get(pk=ended.output_file_id)
    assert output.purpose == "batch_output" and output.organization_id == org.pk
    chunks = list(output.chunks.order_by("index").values_list("index", "data"))
    assert [index for index, _ in chunks] == list(range(-(-output.size // chunk_bytes)))
    assert all(len(data) == chunk_bytes for _, data in chunks[:-1]) and sum(len(d) for _, d in chunks) == output.size
    assert services.finish_batch(batch_id=batch.pk).output_file_id == ended.output_file_id  # ends once


@pytest.mark.django_db(transaction=True)
def test_a_file_is_seen_once_whole_and_one_its_writer_left_unfinished_is_purged(org_key, monkeypatch):
    from django.db import connection

    monkeypatch.setattr(FileChunk, "CHUNK_BYTES", 4)
    stores, outside = services.FileWriter._store, []

    def store(writer, data):  # each chunk commits on its own: no transaction holds the write lock
        outside.append(not connection.in_atomic_block)
        stores(writer, data)

    monkeypatch.setattr(services.FileWriter, "_store", store)
    org, _, _ = org_key()
    writer = services.FileWriter(organization_id=org.pk, purpose="batch_output", filename="o.jsonl")
    writer.write(b'{"a": 1}\n')
    assert FileChunk.objects.filter(file_id=writer.file.pk).count() == 2 and outside == [True, True]
    assert selectors.file_of(organization_id=org.pk, file_id=writer.file.pk) is None
    assert writer.file.pk not in [f["id"] for f in selectors.files_of(organization_id=org.pk)]
    later = timezone.now() + services.UNFINISHED_FILE_AGE + timedelta(minutes=1)
    done = services.create_file(organization_id=org.pk, purpose="batch", filename="i.jsonl", content=b"{}\n")
    assert services.purge_expired_batch_files(now=later) == 1  # the unfinished one, not the upload
    assert not UploadedFile.objects.filter(pk=writer.file.pk).exists() and not FileChunk.objects.filter(
        file_id=writer.file.pk).exists()
    assert selectors.file_content(organization_id=org.pk, file_id=done.pk) == b"{}\n"


@pytest.mark.django_db
def test_an_outcome_that_comes_in_while_the_files_are_written_voids_them(org_key, monkeypatch):
    """A runner that lost its lease may still record a line: the files written without it are
    deleted and the batch stays running, for the next finish to write them whole."""
    org, key, _ = org_key()
    batch = _batch(org, key, lines=2)
    services.record_outcome(batch_id=batch.pk, line=0, request_id="chatcmpl-0", status_code=200, body=_answer("a"))
    writes = services.FileWriter.write

    def write_then_a_late_outcome(writer, data):
        writes(writer, data)
        services.record_outcome(batch_id=batch.pk, line=1, request_id="chatcmpl-1", status_code=200,
                                body=_answer("b"))

    monkeypatch.setattr(services.FileWriter, "write", write_then_a_late_outcome)
    assert services.finish_batch(batch_id=batch.pk).status == "in_progress"
    assert not UploadedFile.objects.filter(purpose="batch_output").exists() and not FileChunk.objects.exists()
    monkeypatch.setattr(services.FileWriter, "write", writes)
    ended = services.finish_batch(batch_id=batch.pk)
    assert ended.status == "completed" and ended.error_file_id is None
    assert len(selectors.file_content(organization_id=org.pk, file_id=ended.output_file_id).splitlines()) == 2


@pytest.mark.django_db(transaction=True)
def test_the_migration_moves_each_file_into_chunks_and_back(org_key, monkeypatch):
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    org, _, _ = org_key()
    before, after = [("gateway", "0002_batches")], [("gateway", "0003_file_chunks")]
    big = bytes(range(256)) * 5000  # over one chunk
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    try:
        old_file = executor.loader.project_state(before).apps.get_model("gateway", "UploadedFile")
        for name, content in (("big", big), ("small", b"{}\n"), ("empty", b"")):
            old_file.objects.create(pk=f"file-{name}", organization_id=org.pk, purpose="batch", filename=name,
                                    content=content, size=len(content), created_at=timezone.now())
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
    for name, content in (("big", big), ("small", b"{}\n"), ("empty", b"")):
        assert selectors.file_content(organization_id=org.pk, file_id=f"file-{name}") == content
    assert FileChunk.objects.filter(file_id="file-big").count() == 2
    executor = MigrationExecutor(connection)
    executor.migrate(before)  # and back: each file whole again
    try:
        old_file = executor.loader.project_state(before).apps.get_model("gateway", "UploadedFile")
        assert bytes(old_file.objects.get(pk="file-big").content) == big
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.mark.django_db
def test_a_batch_past_its_window_expires_and_a_whole_one_completes(org_key):
    org, key, _ = org_key()
    late = _batch(org, key, lines=2, age=timedelta(hours=25))
    services.record_outcome(batch_id=late.pk, line=0, request_id="r", status_code=200, body=_answer("a"))
    ended = services.finish_batch(batch_id=late.pk)
    assert ended.status == "expired" and ended.expired_at
    assert selectors.batch_json(ended)["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    whole = _batch(org, key, lines=1)
    services.record_outcome(batch_id=whole.pk, line=0, request_id="r", status_code=200, body=_answer("a"))
    ended = services.finish_batch(batch_id=whole.pk)
    assert ended.status == "completed" and ended.error_file_id is None and ended.completed_at


# ------------------------------------------------------------------------------------- endpoints

def _auth(key: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def _upload(client, key: str, content: bytes, purpose: str = "batch"):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return client.post("/v1/files", {"file": SimpleUploadedFile("in.jsonl", content), "purpose": purpose},
                       **_auth(key))


@pytest.mark.django_db
def test_an_upload_is_checked_and_kept_for_its_organization(client, org_key, settings):
    org, _, key = org_key()
    _, _, their_key = org_key()
    uploaded = _upload(client, key, _line().encode())
    assert uploaded.status_code == 200 and uploaded.json()["purpose"] == "batch"
    file_id = uploaded.json()["id"]
    download = client.get(f"/v1/files/{file_id}/content", **_auth(key))
    assert b"".join(download) == _line().encode() and download["Content-Length"] == str(len(_line().encode()))
    assert client.get(f"/v1/files/{file_id}", **_auth(their_key)).status_code == 404
    assert [f["id"] for f in client.get("/v1/files?purpose=batch", **_auth(key)).json()["data"]] == [file_id]
    assert client.get("/v1/files", **_auth(their_key)).json()["data"] == []
    for purpose in ("\x00", "fine-tune"):
        refused = client.get("/v1/files", {"purpose": purpose}, **_auth(key))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "purpose"
    refused = _upload(client, key, _line().encode(), purpose="fine-tune")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "purpose"
    refused = _upload(client, key, b"plain text\n")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "file"
    settings.FILES_MAX_BYTES = 10
    assert _upload(client, key, _line().encode()).status_code == 413
    assert client.delete(f"/v1/files/{file_id}", **_auth(key)).json()["deleted"] is True
    assert client.get(f"/v1/files/{file_id}", **_auth(key)).status_code == 404


@pytest.mark.django_db
@pytest.mark.parametrize("body, status, param", [
    ({"endpoint": "/v1/moderations"}, 400, "endpoint"),
    ({"completion_window": "1h"}, 400, "completion_window"),
    ({"metadata": {"k": 1}}, 400, "metadata"),
    ({"priority": "high"}, 400, "priority"),
    ({"input_file_id": "file-unknown"}, 404, "input_file_id"),
    ({"input_file_id": 7}, 400, "input_file_id"),
    ({"endpoint": ["/v1/chat/completions"]}, 400, "endpoint"),
    ({"completion_window": {"h": 24}}, 400, "completion_window"),
])
def test_a_batch_request_that_cannot_run_is_refused_naming_the_parameter(client, org_key, seeded, body, status,
                                                                            param):
    _, _, key = org_key()
    file_id = _upload(client, key, _line(model="smollm2-135m-instruct").encode()).json()["id"]
    sent = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", **body}
    refused = client.post("/v1/batches", sent, content_type="application/json", **_auth(key))
    assert refused.status_code == status and refused.json()["error"]["param"] == param, refused.json()
    assert not Batch.objects.exists()


@pytest.mark.django_db
def test_a_file_that_is_no_batch_input_is_refused_saying_what_it_is(client, org_key, seeded):
    org, _, key = org_key()
    output = services.create_file(organization_id=org.pk, purpose="batch_output", filename="out.jsonl",
                                  content=_line(model="smollm2-135m-instruct").encode())
    refused = client.post("/v1/batches", {"input_file_id": output.pk, "endpoint": CHAT, "completion_window": "24h"},
                          content_type="application/json", **_auth(key))
    error = refused.json()["error"]
    assert refused.status_code == 400 and (error["param"], error["code"]) == ("input_file_id", "invalid_file_purpose")
    assert '"batch_output"' in error["message"] and not Batch.objects.exists()


@pytest.mark.django_db
def test_a_batch_of_a_model_the_caller_cannot_call_is_a_404(client, org_key, seeded):
    _, _, key = org_key()
    file_id = _upload(client, key, _line(model="nobodys-model").encode()).json()["id"]
    refused = client.post("/v1/batches", {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"},
                          content_type="application/json", **_auth(key))
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"


@pytest.mark.django_db
def test_a_batch_is_read_and_cancelled_by_its_organization_only(client, org_key, seeded):
    org, api_key, key = org_key()
    _, _, their_key = org_key()
    _, _, reader_key = org_key(scopes=("read_usage",))
    batch = _batch(org, api_key)
    assert client.get(f"/v1/batches/{batch.pk}", **_auth(key)).json()["id"] == batch.pk
    assert client.get(f"/v1/batches/{batch.pk}", **_auth(their_key)).status_code == 404
    assert client.post(f"/v1/batches/{batch.pk}/cancel", **_auth(their_key)).status_code == 404
    assert client.get(f"/v1/batches/{batch.pk}", **_auth(reader_key)).status_code == 403
    assert client.get(f"/v1/batches/{batch.pk}/cancel", **_auth(key)).status_code == 405
    assert client.post(f"/v1/batches/{batch.pk}/cancel", **_auth(key)).json()["status"] == "cancelling"
    assert client.post(f"/v1/batches/{batch.pk}/cancel", **_auth(key)).json()["status"] == "cancelling"
    assert [b["id"] for b in client.get("/v1/batches", **_auth(key)).json()["data"]] == [batch.pk]
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.COMPLETED)
    refused = client.post(f"/v1/batches/{batch.pk}/cancel", **_auth(key))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "batch_not_cancellable"


# ---------------------------------------------------------------------------------------- runner

def on_a_thread(fn, **kwargs):
    """``fn`` on a thread of its own, its connection closed after, as admission's threads do."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    def call():
        try:
            return fn(**kwargs)
        finally:
            connections.close_all()

    return sync_to_async(call, thread_sensitive=False)()


class _FakeCall:
    def __init__(self, request_id: str):
        self.request_id, self.created, self.cancelled, self.fingerprint = request_id, 0, False, None

    async def cancel(self):
        self.cancelled = True


@pytest.mark.django_db(transaction=True)
def test_the_runner_retries_a_refusal_of_a_moment_records_each_outcome_and_stops_on_a_cancel(org_key, monkeypatch):
    """The runner's own logic, with the calls faked: what reaches a worker is tests/e2e's."""
    import asyncio

    from gateway import batch_runner

    org, key, _ = org_key()
    batch = _batch(org, key, lines=4)
    batch_id = batch.pk
    _, token = services.claim_batch(batch_id=batch.pk, lease=timedelta(seconds=60))
    beats = []  # the statuses the runner read, beat by beat

    async def counted(fn, **kwargs):
        result = await on_a_thread(fn, **kwargs)
        if fn is services.beat_batch:
            beats.append(result)
        return result

    monkeypatch.setattr(batch_runner, "_db", counted)
    monkeypatch.setattr(batch_runner, "BEAT_SECONDS", 0.05)
    monkeypatch.setattr(batch_runner, "_retry_after", lambda exc: 0.01)
    attempts, calls_made = {}, []
    release = {}  # line 3's answer waits for this event: it is still running when the cancel comes

    async def begin(inference, *, caller, batch):
        line = int(inference.messages[0]["content"])
        assert batch == (Decimal("0.5"), batch_input.line_id(batch_id, line))
        attempts[line] = attempts.get(line, 0) + 1
        if line == 0 and attempts[line] == 1:
            raise ApiError(429, "queue full", code="queue_full")
        if line == 1:
            raise ApiError(404, "no such model", param="model", code="model_not_found")
        call = _FakeCall(f"chatcmpl-{line}")
        calls_made.append(call)
        return call, {}

    async def collect(call, ctx):
        if call.request_id == "chatcmpl-2":
            raise RuntimeError("a bug in the relay")
        if call.request_id == "chatcmpl-3":
            release["event"] = asyncio.Event()
            await release["event"].wait()
        return _answer(call.request_id)

    monkeypatch.setattr(batch_runner.calls, "begin", begin)
    monkeypatch.setattr(batch_runner.answers, "collect", collect)
    monkeypatch.setattr(batch_runner.calls.Caller, "__init__", lambda self, **kw: None)
    requests = [{"custom_id": f"c{i}", "body": {"model": "smol", "messages": [{"role": "user", "content": str(i)}]}}
                for i in range(4)]
    Batch.objects.filter(pk=batch.pk).update(requests=json.dumps(requests))
    batch.refresh_from_db()

    async def scenario():
        runner = batch_runner._Runner(batch, token)
        task = asyncio.create_task(runner.run())
        while len(await on_a_thread(selectors.done_lines, batch_id=batch.pk)) < 3 or "event" not in release:
            await asyncio.sleep(0.02)
        await on_a_thread(services.cancel_batch, batch=batch)
        while beats.count("cancelling") < 3:  # it saw the cancel and beats on: the running line is not cut off
            assert not task.done()
            await asyncio.sleep(0.02)
        assert not task.done()
        release["event"].set()
        return await asyncio.wait_for(task, timeout=10)

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=30)) is True  # its waits end, or the test fails
    outcomes = {o.line: o for o in Batch.objects.get(pk=batch.pk).outcomes.all()}
    assert attempts[0] == 2 and outcomes[0].status_code == 200  # sent again after the 429
    assert outcomes[1].status_code == 404 and attempts[1] == 1  # not a refusal of a moment
    assert outcomes[2].status_code == 500 and json.loads(outcomes[2].body)["error"]["code"] == "internal_error"
    cancelled = {c.request_id: c.cancelled for c in calls_made}
    assert cancelled["chatcmpl-2"]  # the bug stopped its generation
    assert outcomes[3].status_code == 200 and not cancelled["chatcmpl-3"]  # it ran on: kept, as it was billed
    ended = services.finish_batch(batch_id=batch.pk, token=token)
    assert ended.status == "cancelled" and selectors.batch_json(ended)["request_counts"] == \
        {"total": 4, "completed": 2, "failed": 2}


@pytest.mark.django_db(transaction=True)
def test_a_stopping_worker_cancels_the_running_requests_and_leaves_the_batch_to_resume(org_key, monkeypatch):
    import asyncio
    import threading

    from gateway import batch_runner

    org, key, _ = org_key()
    batch = _batch(org, key, lines=1)
    batch_id = batch.pk
    requests = [{"custom_id": "c0", "body": {"model": "smol", "messages": [{"role": "user", "content": "0"}]}}]
    Batch.objects.filter(pk=batch.pk).update(requests=json.dumps(requests))
    batch.refresh_from_db()
    _, token = services.claim_batch(batch_id=batch.pk, lease=timedelta(seconds=60))

    stopping, running = threading.Event(), []
    monkeypatch.setattr(batch_runner, "_db", on_a_thread)
    monkeypatch.setattr(batch_runner, "BEAT_SECONDS", 0.05)
    monkeypatch.setattr(batch_runner, "stopping", stopping)

    billed_as = []

    async def begin(inference, *, caller, batch):
        billed_as.append(batch.billing_id)
        running.append(_FakeCall(f"chatcmpl-{len(running)}"))
        return running[-1], {}

    async def collect(call, ctx):
        if call is running[0]:
            stopping.set()  # the worker is told to stop while the answer is being written
            await asyncio.Event().wait()
        return {"id": call.request_id, "usage": {"prompt_tokens": 1, "completion_tokens": 1}}

    monkeypatch.setattr(batch_runner.calls, "begin", begin)
    monkeypatch.setattr(batch_runner.answers, "collect", collect)
    assert asyncio.run(asyncio.wait_for(batch_runner._Runner(batch, token).run(), timeout=10)) is True
    assert running[0].cancelled and not Batch.objects.get(pk=batch.pk).outcomes.exists()

    # Resumed by another runner: the line runs again as a new request, billed under the same id
    # (the cancelled run's charge is the line's one; billing drops the second).
    services.release_batch(batch_id=batch.pk, token=token)
    stopping.clear()
    _, token = services.claim_batch(batch_id=batch.pk, lease=timedelta(seconds=60))
    assert asyncio.run(asyncio.wait_for(batch_runner._Runner(batch, token).run(), timeout=10)) is True
    [answer] = services.finish_batch(batch_id=batch.pk, token=token).outcomes.all()
    assert answer.request_id == "chatcmpl-1" and billed_as == [batch_input.line_id(batch_id, 0)] * 2


@pytest.mark.django_db
def test_output_files_expire_after_their_retention_and_uploads_stay(org_key, settings):
    from gateway.tasks import purge_expired_batch_files

    settings.BATCH_OUTPUT_RETENTION_DAYS = 30
    org, _, _ = org_key()
    old_output = services.create_file(organization_id=org.pk, purpose="batch_output", filename="o", content=b"x")
    new_output = services.create_file(organization_id=org.pk, purpose="batch_output", filename="n", content=b"x")
    old_input = services.create_file(organization_id=org.pk, purpose="batch", filename="i", content=b"x")
    UploadedFile.objects.filter(pk__in=[old_output.pk, old_input.pk]).update(
        created_at=timezone.now() - timedelta(days=30, seconds=1))
    shown = selectors.file_json(new_output)
    assert shown["expires_at"] - shown["created_at"] == 30 * 86400
    assert selectors.file_json(old_input)["expires_at"] is None
    # Gone for every read at once, before the purge deletes it.
    assert selectors.file_of(organization_id=org.pk, file_id=old_output.pk) is None
    assert selectors.file_content(organization_id=org.pk, file_id=old_output.pk) is None
    assert {f["id"] for f in selectors.files_of(organization_id=org.pk)} == {new_output.pk, old_input.pk}
    assert purge_expired_batch_files() == 1
    assert set(UploadedFile.objects.values_list("pk", flat=True)) == {new_output.pk, old_input.pk}
