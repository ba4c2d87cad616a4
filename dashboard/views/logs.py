"""Logs: the Responses API responses the organization's calls stored, newest first; one with its
whole conversation; and their deletion."""

from __future__ import annotations

from datetime import datetime, timezone

from django.contrib import messages
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from gateway import selectors as responses
from gateway import services as response_services

from .common import organization_required

PER_PAGE = 25


@organization_required
def response_log(request):
    page = request.GET.get("page", "1")
    page = int(page) if page.isascii() and page.isdigit() and 0 < len(page) < 6 and int(page) > 0 else 1
    rows, more = responses.response_log(organization_id=request.organization.pk, offset=(page - 1) * PER_PAGE,
                                        limit=PER_PAGE)
    return render(request, "dashboard/responses.html", {
        "rows": rows, "page": page, "previous_page": page - 1 if page > 1 else None,
        "next_page": page + 1 if more else None,
    })


@organization_required
def response_detail(request, response_id: str):
    response = responses.stored_response(organization_id=request.organization.pk, response_id=response_id)
    if response is None:
        raise Http404("No such response (it may have expired or been deleted).")
    items = responses.input_items(organization_id=request.organization.pk, response_id=response_id) or []
    created = response.get("created_at")
    return render(request, "dashboard/response_detail.html", {
        "response": response,
        "created": datetime.fromtimestamp(created, tz=timezone.utc) if isinstance(created, int) else None,
        "items": [_shown(item) for item in items],
        "output": [_shown(item) for item in response.get("output", [])],
    })


@organization_required
@require_POST
def response_delete(request, response_id: str):
    if not response_services.delete_response(organization_id=request.organization.pk, response_id=response_id):
        raise Http404("No such response.")
    messages.success(request, f"Response {response_id} is deleted.")
    return redirect("responses")


def _shown(item: dict) -> dict:
    """An item as the page shows it: who or what, and its text."""
    kind = item.get("type", "message")
    label = item.get("role", "") if kind == "message" else kind.replace("_", " ")
    return {"id": item.get("id", ""), "kind": kind, "label": label, "text": responses.item_text(item),
            "call_id": item.get("call_id")}
