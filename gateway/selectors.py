"""Reads of the gateway's stored responses. A response past its retention is gone for every read,
whether or not the hourly purge has deleted its row yet."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from .models import StoredResponse


def kept(*, organization_id) -> "QuerySet[StoredResponse]":  # noqa: F821
    """The organization's stored responses still within their retention."""
    since = timezone.now() - timedelta(days=settings.RESPONSES_RETENTION_DAYS)
    return StoredResponse.objects.filter(organization_id=organization_id, created_at__gt=since)


def _row(*, organization_id, response_id: str) -> StoredResponse | None:
    if not response_id.isprintable() or len(response_id) > StoredResponse._meta.pk.max_length:
        return None  # a NUL cannot even be sent to the database
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


def conversation_after(*, organization_id, response_id: str) -> list[dict] | None:
    """What a response that continues ``response_id`` starts from: its input items, then its output."""
    row = _row(organization_id=organization_id, response_id=response_id)
    if row is None:
        return None
    return [*json.loads(row.conversation), *json.loads(row.response)["output"]]


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
