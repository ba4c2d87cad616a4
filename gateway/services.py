"""Writes of the gateway: stored responses, files, and batches with their runners' leases."""

from __future__ import annotations

import json
import logging
import secrets
from datetime import timedelta

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from . import selectors
from .batch_input import line_id
from .models import Batch, BatchOutcome, FileChunk, StoredResponse, UploadedFile

log = logging.getLogger(__name__)


def store_response(*, organization_id, response: dict, conversation: list[dict]) -> None:
    """Keep a whole response and the input items it answered. Idempotent: storing one id again
    changes nothing."""
    StoredResponse.objects.get_or_create(pk=response["id"], defaults={
        "organization_id": organization_id,
        "created_at": timezone.now(),
        "conversation": _json_text(conversation),
        "response": _json_text(response),
    })


def _json_text(value) -> str:
    """JSON text the database takes: UTF-8 where it can be, ASCII escapes where a client's text holds
    a lone surrogate (which UTF-8 cannot encode). JSON escapes NUL either way."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def delete_response(*, organization_id, response_id: str) -> bool:
    """Delete one of the organization's stored responses; False when it has none by that id."""
    if not selectors.fits(response_id, StoredResponse):
        return False
    deleted, _ = selectors.kept(organization_id=organization_id).filter(pk=response_id).delete()
    return deleted > 0


def purge_expired_responses(*, now=None) -> int:
    """Delete the responses past their retention; how many were deleted."""
    cutoff = (now or timezone.now()) - timedelta(days=settings.RESPONSES_RETENTION_DAYS)
    deleted, _ = StoredResponse.objects.filter(created_at__lte=cutoff).delete()
    return deleted


# ------------------------------------------------------------------------------------------ files

class FileWriter:
    """Writes a new file a chunk at a time, so that its content never has to be whole in memory,
    each chunk in a transaction of its own; the file is seen once ``close`` makes it ready (one
    never closed, its writer gone, is purged with the expired files)."""

    def __init__(self, *, organization_id, purpose: str, filename: str):
        self.file = UploadedFile.objects.create(pk=f"file-{secrets.token_hex(12)}", organization_id=organization_id,
                                                purpose=purpose, filename=filename[:255], size=0,
                                                created_at=timezone.now(), ready=False)
        self.pending = bytearray()
        self.chunks = 0

    def write(self, data: bytes) -> None:
        self.pending += data
        self.file.size += len(data)
        while len(self.pending) >= FileChunk.CHUNK_BYTES:
            self._store(self.pending[:FileChunk.CHUNK_BYTES])
            del self.pending[:FileChunk.CHUNK_BYTES]

    def close(self) -> UploadedFile:
        if self.pending:
            self._store(self.pending)
            self.pending = bytearray()
        UploadedFile.objects.filter(pk=self.file.pk).update(size=self.file.size, ready=True)
        self.file.ready = True
        return self.file

    def _store(self, data) -> None:
        FileChunk.objects.create(file_id=self.file.pk, index=self.chunks, data=bytes(data))
        self.chunks += 1


def create_file(*, organization_id, purpose: str, filename: str, content: bytes) -> UploadedFile:
    writer = FileWriter(organization_id=organization_id, purpose=purpose, filename=filename)
    writer.write(content)
    return writer.close()


UNFINISHED_FILE_AGE = timedelta(days=1)  # a file not ready after this: its writer died


def purge_expired_batch_files(*, now=None) -> int:
    """Delete the batch output and error files past BATCH_OUTPUT_RETENTION_DAYS, and those a dead
    writer left unfinished; how many."""
    now = now or timezone.now()
    cutoff = now - timedelta(days=settings.BATCH_OUTPUT_RETENTION_DAYS)
    _, deleted = UploadedFile.objects.filter(
        models.Q(purpose=UploadedFile.Purpose.BATCH_OUTPUT, created_at__lte=cutoff)
        | models.Q(ready=False, created_at__lte=now - UNFINISHED_FILE_AGE)).delete()
    return deleted.get(UploadedFile._meta.label, 0)  # not counting their chunks


def delete_file(*, organization_id, file_id: str) -> bool:
    if not selectors.fits(file_id, UploadedFile):
        return False
    deleted, _ = UploadedFile.objects.filter(organization_id=organization_id, pk=file_id).delete()
    return deleted > 0


# ---------------------------------------------------------------------------------------- batches

def create_batch(*, organization_id, api_key_id, endpoint: str, input_file_id: str, requests: list[dict],
                 model: str, metadata: dict, completion_window: str = "24h") -> Batch:
    """A batch of ``requests``, started once the transaction commits (or by the next resume, if the
    broker cannot take the task now)."""
    now = timezone.now()
    batch = Batch.objects.create(
        pk=f"batch_{secrets.token_hex(16)}", organization_id=organization_id, api_key_id=api_key_id,
        endpoint=endpoint, model=model, input_file_id=input_file_id, requests=json.dumps(requests),
        total=len(requests), completion_window=completion_window, metadata=metadata, created_at=now,
        in_progress_at=now, expires_at=now + BATCH_WINDOWS[completion_window])
    transaction.on_commit(lambda: _start(batch.pk))
    return batch


def _start(batch_id: str) -> None:
    from .tasks import run_batch

    try:
        run_batch.delay(batch_id)
    except Exception as exc:  # the broker is down: resume_batches starts it within a minute of its return
        log.warning("batch %s waits for the broker to start: %s", batch_id, exc)


BATCH_WINDOWS = {"24h": timedelta(hours=24)}
RUNNING = (Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING)
RUNNER_LEASE = timedelta(seconds=60)  # a runner silent this long is taken for dead


def cancel_batch(*, batch: Batch) -> Batch:
    """Ask a running batch to stop: its runner starts no other request, lets those running finish
    and writes what finished. A batch that already ended is returned as it is."""
    now = timezone.now()
    Batch.objects.filter(pk=batch.pk, status=Batch.Status.IN_PROGRESS).update(
        status=Batch.Status.CANCELLING, cancelling_at=now)
    return Batch.objects.defer("requests").get(pk=batch.pk)


def claim_batch(*, batch_id: str, lease: timedelta) -> tuple[Batch, str] | None:
    """The batch and a token of its lease for this runner, unless it ended or another runner
    showed life within ``lease``."""
    now, token = timezone.now(), secrets.token_hex(16)
    with transaction.atomic():
        row = (Batch.objects.select_for_update().filter(pk=batch_id, status__in=RUNNING)
               .values_list("pk", "runner_seen_at").first())
        if row is None or (row[1] and now - row[1] < lease):
            return None
        Batch.objects.filter(pk=batch_id).update(runner=token, runner_seen_at=now)
    return Batch.objects.get(pk=batch_id), token


def beat_batch(*, batch_id: str, token: str) -> str | None:
    """A runner's sign of life: the batch's status (a cancel shows here), or None once the lease is
    another runner's (this one must stop)."""
    if not Batch.objects.filter(pk=batch_id, runner=token).update(runner_seen_at=timezone.now()):
        return None
    return Batch.objects.filter(pk=batch_id).values_list("status", flat=True).first()


def release_batch(*, batch_id: str, token: str) -> None:
    """A stopping runner's batch: the next resume takes it at once."""
    Batch.objects.filter(pk=batch_id, runner=token).update(runner="", runner_seen_at=None)


def record_outcome(*, batch_id: str, line: int, request_id: str, status_code: int, body: dict) -> None:
    """What one request came to; once per line (a resumed runner's second outcome is dropped)."""
    usage = (body.get("usage") or {}) if status_code == 200 else {}
    BatchOutcome.objects.get_or_create(batch_id=batch_id, line=line, defaults={
        "request_id": request_id, "status_code": status_code, "body": _json_text(body),
        "input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)})


def finish_batch(*, batch_id: str, token: str | None = None) -> Batch:
    """Write the output file (the answers) and the error file (the failures, and the requests never
    run), in input order, and end the batch: completed, cancelled or expired. ``token``: the
    runner's lease (None: a resume ending a batch no runner holds). The files are written an
    outcome at a time before the batch's lock is taken (writing a large one takes a while), and
    deleted if the batch turns out lost."""
    batch = Batch.objects.defer("requests").get(pk=batch_id)
    now = timezone.now()
    ended = (Batch.Status.CANCELLED if batch.status == Batch.Status.CANCELLING
             else Batch.Status.EXPIRED if now >= batch.expires_at else Batch.Status.COMPLETED)
    requests = Batch.objects.filter(pk=batch_id).values_list("requests", flat=True).get()
    custom_ids = [request["custom_id"] for request in json.loads(requests)]
    written, outcomes = {}, 0
    try:
        for answers, field in ((True, "output_file_id"), (False, "error_file_id")):
            writer = None
            for entry, ran in _entries(batch_id, custom_ids, ended, answers=answers):
                outcomes += ran
                if writer is None:
                    writer = FileWriter(organization_id=batch.organization_id, purpose=UploadedFile.Purpose.BATCH_OUTPUT,
                                        filename=f"{batch_id}_{field.removesuffix('_file_id')}.jsonl")
                    written[field] = writer.file.pk
                writer.write((json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8", "replace"))
            if writer is not None:
                writer.close()
    except BaseException:
        UploadedFile.objects.filter(pk__in=written.values()).delete()
        raise
    with transaction.atomic():
        current = Batch.objects.select_for_update().defer("requests").get(pk=batch_id)
        lost = current.status not in RUNNING or (token is not None and current.runner != token) \
            or BatchOutcome.objects.filter(batch_id=batch_id).count() != outcomes
        if not lost:
            fields = {"status": ended, f"{ended}_at": timezone.now(), "finalizing_at": now, "runner": "", **written}
            Batch.objects.filter(pk=batch_id).update(**fields)
    if lost:  # another runner ended it, or an outcome came in meanwhile: this run's files are void
        UploadedFile.objects.filter(pk__in=written.values()).delete()
    return Batch.objects.defer("requests").get(pk=batch_id)


def _entries(batch_id: str, custom_ids: list[str], ended: str, *, answers: bool):
    """The output file's lines (``answers``) or the error file's, in input order, each with whether
    it is an outcome's: read from the outcomes a few hundred at a time, never all at once. A line
    with no outcome (never run) is an error."""
    outcomes = BatchOutcome.objects.filter(batch_id=batch_id).order_by("line")
    if answers:
        outcomes = outcomes.filter(status_code=200)
    rows = outcomes.values_list("line", "request_id", "status_code", "body").iterator(chunk_size=200)
    if answers:
        for line, request_id, status_code, body in rows:
            yield _entry(batch_id, line, custom_ids[line], request_id, status_code, body), True
        return
    code = "batch_cancelled" if ended == Batch.Status.CANCELLED else "batch_expired"
    ran = next(rows, None)  # every outcome, in line order beside the lines: the answers are skipped
    for line, custom_id in enumerate(custom_ids):
        if ran is not None and ran[0] == line:
            if ran[2] != 200:
                yield _entry(batch_id, line, custom_id, *ran[1:]), True
            ran = next(rows, None)
        else:
            yield {"id": line_id(batch_id, line), "custom_id": custom_id, "response": None, "error": {
                "code": code, "message": f"The batch was {ended} before this request ran."}}, False


def _entry(batch_id: str, line: int, custom_id: str, request_id: str, status_code: int, body: str) -> dict:
    return {"id": line_id(batch_id, line), "custom_id": custom_id, "response": {
        "status_code": status_code, "request_id": request_id, "body": json.loads(body)}, "error": None}


def silent_batches() -> list[str]:
    """The running batches whose runner has shown no life for a lease (or never started)."""
    cutoff = timezone.now() - RUNNER_LEASE
    return list(Batch.objects.filter(status__in=RUNNING).filter(
        models.Q(runner_seen_at__lt=cutoff) | models.Q(runner_seen_at__isnull=True, created_at__lt=cutoff))
        .order_by("created_at").values_list("pk", flat=True))


def resume_batches() -> int:
    """Each running batch whose runner went silent: one cancelled or past its window is ended here
    (its runner may wait for a free thread for long); the others get a runner again."""
    silent = silent_batches()
    for batch_id in silent:
        batch = Batch.objects.defer("requests").get(pk=batch_id)
        if batch.status == Batch.Status.CANCELLING or timezone.now() >= batch.expires_at:
            finish_batch(batch_id=batch_id)
        else:
            log.warning("resuming batch %s: its runner stopped or has not started", batch_id)
            _start(batch_id)
    return len(silent)
