"""Writes of the gateway's stored responses."""

from __future__ import annotations

import json
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from . import selectors
from .models import StoredResponse


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
    if not response_id.isprintable():  # a NUL cannot even be sent to the database
        return False
    deleted, _ = selectors.kept(organization_id=organization_id).filter(pk=response_id).delete()
    return deleted > 0


def purge_expired_responses(*, now=None) -> int:
    """Delete the responses past their retention; how many were deleted."""
    cutoff = (now or timezone.now()) - timedelta(days=settings.RESPONSES_RETENTION_DAYS)
    deleted, _ = StoredResponse.objects.filter(created_at__lte=cutoff).delete()
    return deleted
