"""Reads of the gateway's stored responses. A response past its retention is gone for every read,
whether or not the hourly purge has deleted its row yet."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Q, Sum
from django.utils import timezone

from .models import Batch, BatchOutcome, FileChunk, StoredResponse, UploadedFile


def kept(*, organization_id) -> "QuerySet[StoredResponse]":  # noqa: F821
    """The organization's stored responses still within their retention."""
    since = timezone.now() - timedelta(days=settings.RESPONSES_RETENTION_DAYS)
    return StoredResponse.objects.filter(organization_id=organization_id, created_at__gt=since)


def fits(value: str, model) -> bool:
    """Whether ``value`` can be a primary key of ``model``: a longer one is no row, and a NUL cannot
    even be sent to the database."""
    return value.isprintable() and len(value) <= model._meta.pk.max_length


def _row(*, organization_id, response_id: str) -> StoredResponse | None:
    if not fits(response_id, StoredResponse):
        return None
    return kept(organization_id=organization_id).filter(pk=response_id).first()


def stored_response(*, organization_id, response_id: str) -> dict | None:
    """The response object, as it was returned; None if the organization has no such response."""
    row = _row(organization_id=organization_id, response_id=response_id)
    return json.loads(row.response) if row is not None else None


def input_items(*, organization_id, response_id: str) -> list[dict] | None:
    """Every input item a response answered, first to last (those of the responses it continued
    included); None if the organization has no such response."""
    row = _row(organization_id=organization_id, response_id=response_id)
    return json.loads(row.conversation) if row is not None else None


def conversation_after(*, organization_id, response_id: str) -> tuple[list[dict], str] | None:
    """What a response that continues ``response_id`` starts from (its input items, then its
    output), and that response's status; None if the organization has no such response."""
    row = _row(organization_id=organization_id, response_id=response_id)
    if row is None:
        return None
    response = json.loads(row.response)
    return [*json.loads(row.conversation), *response["output"]], response.get("status", "completed")


PREVIEW_CHARS = 160


@dataclass(frozen=True)
class LoggedResponse:
    """A stored response as the dashboard lists it."""

    id: str
    created_at: datetime
    model: str
    status: str
    input_tokens: int
    output_tokens: int
    asked: str  # the last user message's text, cut short
    answered: str  # the output's text (or its calls' names), cut short


def response_log(*, organization_id, offset: int = 0, limit: int = 25) -> tuple[list[LoggedResponse], bool]:
    """The organization's stored responses, newest first, from ``offset``; and whether more follow."""
    rows = list(kept(organization_id=organization_id).order_by("-created_at", "-pk")[offset:offset + limit + 1])
    return [_logged(row) for row in rows[:limit]], len(rows) > limit


def _logged(row: StoredResponse) -> LoggedResponse:
    response, items = json.loads(row.response), json.loads(row.conversation)
    usage = response.get("usage") or {}
    asked = next((item_text(item) for item in reversed(items) if item.get("role") == "user"), "")
    answered = " ".join(item_text(item) for item in response.get("output", []))
    return LoggedResponse(row.pk, row.created_at, response.get("model", ""), response.get("status", ""),
                          usage.get("input_tokens", 0), usage.get("output_tokens", 0),
                          _cut(asked), _cut(answered))


def item_text(item: dict) -> str:
    """What an item says, in one line of text: a message's text, a call's name and arguments, a result."""
    kind = item.get("type", "message")
    if kind == "message":
        return "".join(part.get("text", "") for part in item.get("content") or [])
    if kind == "function_call":
        return f"{item.get('name', '')}({item.get('arguments', '')})"
    return str(item.get("output", ""))


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS - 1] + "…"


# ------------------------------------------------------------------------------------------ files

def _files(organization_id) -> "QuerySet[UploadedFile]":  # noqa: F821
    """The organization's files, less those being written and the batch outputs past their
    retention (gone for every read, whether or not the hourly purge has deleted them yet)."""
    cutoff = timezone.now() - timedelta(days=settings.BATCH_OUTPUT_RETENTION_DAYS)
    return UploadedFile.objects.filter(organization_id=organization_id, ready=True).exclude(
        purpose=UploadedFile.Purpose.BATCH_OUTPUT, created_at__lte=cutoff)


def file_of(*, organization_id, file_id: str) -> UploadedFile | None:
    if not fits(file_id, UploadedFile):
        return None
    return _files(organization_id).filter(pk=file_id).first()


def present_files(*, organization_id, file_ids) -> set[str]:
    """Which of ``file_ids`` the organization still has (a file may be deleted or expire)."""
    return set(_files(organization_id).filter(pk__in=[f for f in file_ids if f]).values_list("pk", flat=True))


def file_content(*, organization_id, file_id: str) -> bytes | None:
    """A whole file (a batch's input: at most FILES_MAX_BYTES); downloads read ``file_chunk``."""
    found = file_of(organization_id=organization_id, file_id=file_id)
    if found is None:
        return None
    parts = FileChunk.objects.filter(file_id=found.pk).order_by("index").values_list("data", flat=True)
    return b"".join(bytes(part) for part in parts)


def file_chunk(*, file_id: str, index: int) -> bytes | None:
    """A file's ``index``-th chunk; None past its end, or once the file is deleted."""
    data = FileChunk.objects.filter(file_id=file_id, index=index).values_list("data", flat=True).first()
    return None if data is None else bytes(data)


def files_of(*, organization_id, purpose: str | None = None) -> list[dict]:
    """The organization's files, oldest first (``pages`` orders and cuts them)."""
    rows = _files(organization_id).order_by("created_at", "pk")
    if purpose:
        rows = rows.filter(purpose=purpose)
    return [file_json(row) for row in rows]


def file_json(row: UploadedFile) -> dict:
    expires = (row.created_at + timedelta(days=settings.BATCH_OUTPUT_RETENTION_DAYS)
               if row.purpose == UploadedFile.Purpose.BATCH_OUTPUT else None)
    return {"id": row.pk, "object": "file", "bytes": row.size, "created_at": int(row.created_at.timestamp()),
            "filename": row.filename, "purpose": row.purpose, "status": "processed",
            "expires_at": int(expires.timestamp()) if expires else None, "status_details": None}


# ---------------------------------------------------------------------------------------- batches

def batch_of(*, organization_id, batch_id: str) -> Batch | None:
    if not fits(batch_id, Batch):
        return None
    return (Batch.objects.filter(organization_id=organization_id, pk=batch_id).select_related("api_key")
            .defer("requests").first())


def batch_creator_id(batch: Batch) -> int | None:
    """The user whose key started ``batch`` (None: a key made for no user, or deleted)."""
    return batch.api_key.created_by_id if batch.api_key is not None else None


def batch_ids_of(*, organization_id) -> list[dict]:
    """The organization's batches as ``{"id"}`` items, oldest first (``pages`` orders and cuts them;
    ``batch_json`` then shows only the page)."""
    rows = Batch.objects.filter(organization_id=organization_id).order_by("created_at", "pk")
    return [{"id": pk} for pk in rows.values_list("pk", flat=True)]


def latest_batches(*, organization_id, limit: int) -> list[Batch]:
    """The organization's ``limit`` newest batches, newest first."""
    return list(Batch.objects.filter(organization_id=organization_id).select_related("api_key")
                .defer("requests").order_by("-created_at", "-pk")[:limit])


def batches_by_id(*, organization_id, ids: list[str]) -> list[Batch]:
    return list(Batch.objects.filter(organization_id=organization_id, pk__in=ids).defer("requests"))


def done_lines(*, batch_id: str) -> set[int]:
    """The lines of a batch that already have an outcome (a resumed run skips them)."""
    return set(BatchOutcome.objects.filter(batch_id=batch_id).values_list("line", flat=True))


_COUNTS = {"completed": Count("pk", filter=Q(status_code=200)), "failed": Count("pk", filter=~Q(status_code=200)),
           "input_tokens": Sum("input_tokens"), "cached_tokens": Sum("cached_tokens"), "output_tokens": Sum("output_tokens")}


def batches_json(batches: list[Batch]) -> list[dict]:
    """Several batches as the API shows them, their outcomes counted in one query."""
    counted = {row.pop("batch_id"): row for row in BatchOutcome.objects.filter(batch__in=batches)
               .values("batch_id").annotate(**_COUNTS)}
    empty = {"completed": 0, "failed": 0, "input_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
    return [batch_json(batch, counts=counted.get(batch.pk, empty)) for batch in batches]


def batch_json(batch: Batch, *, counts: dict | None = None) -> dict:
    """A batch as the API shows it (OpenAI's Batch object)."""
    if counts is None:
        counts = BatchOutcome.objects.filter(batch=batch).aggregate(**_COUNTS)
    failed = counts["failed"]
    if batch.status in (Batch.Status.EXPIRED, Batch.Status.CANCELLED):  # the lines never run count as failed
        failed = batch.total - counts["completed"]
    input_tokens, output_tokens = counts["input_tokens"] or 0, counts["output_tokens"] or 0

    def stamp(value):
        return int(value.timestamp()) if value else None

    return {
        "id": batch.pk, "object": "batch", "endpoint": batch.endpoint, "model": batch.model, "errors": None,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window, "status": batch.status,
        "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
        "created_at": stamp(batch.created_at), "in_progress_at": stamp(batch.in_progress_at),
        "expires_at": stamp(batch.expires_at), "finalizing_at": stamp(batch.finalizing_at),
        "completed_at": stamp(batch.completed_at), "failed_at": None, "expired_at": stamp(batch.expired_at),
        "cancelling_at": stamp(batch.cancelling_at), "cancelled_at": stamp(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": counts["completed"], "failed": failed},
        "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": counts["cached_tokens"] or 0},
                  "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": input_tokens + output_tokens},
        "metadata": batch.metadata or None,
    }
