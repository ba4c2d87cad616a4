"""Reads of the gateway's stored responses. A response past its retention is gone for every read,
whether or not the hourly purge has deleted its row yet."""

from __future__ import annotations

import json
from datetime import timedelta

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
