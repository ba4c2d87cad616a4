"""Logs: the Responses API responses the organization's calls stored, newest first; one with its
whole conversation; and their deletion. Batches: the Batch API's jobs, their progress, their
files."""

from __future__ import annotations

from datetime import datetime, timezone

from django.contrib import messages
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from gateway import selectors as responses
from gateway.downloads import download
from gateway import services as response_services

from accounts.models import MANAGER_ROLES
from accounts.selectors import can_change, membership_for

from .common import forbidden, organization_required

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
        "can_delete": _manages(request),
    })


def _manages(request) -> bool:
    """Stored responses keep no creator: deleting one from the dashboard is an owner's or admin's."""
    return request.role in MANAGER_ROLES


@organization_required
@require_POST
def response_delete(request, response_id: str):
    if not _manages(request):
        return forbidden(request, "Deleting a stored response needs an owner or admin of the organization.")
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


# ---------------------------------------------------------------------------------------- batches

@organization_required
def batch_list(request):
    batches = _batches(request)
    return render(request, "dashboard/batches.html", {"batches": batches, "polling": any(b["running"] for b in batches)})


@organization_required
@require_GET
def batch_rows(request):
    """The table alone: htmx polls it while a batch runs, so its progress moves without a reload;
    once none runs, 286 tells htmx to stop."""
    batches = _batches(request)
    return render(request, "dashboard/_batch_rows.html", {"batches": batches},
                  status=200 if any(b["running"] for b in batches) else 286)


def _batches(request) -> list[dict]:
    rows = responses.latest_batches(organization_id=request.organization.pk, limit=BATCHES_SHOWN)
    membership = membership_for(user=request.user, organization=request.organization)
    shown = responses.batches_json(rows)
    present = responses.present_files(organization_id=request.organization.pk, file_ids=[
        batch[f"{kind}_file_id"] for batch in shown for kind in ("input", "output", "error")])
    for batch, row in zip(shown, rows):
        # Each file with its link, or none once deleted or expired (the link would be a 404).
        batch["files"] = [(label, batch[f"{kind}_file_id"], batch[f"{kind}_file_id"] in present)
                          for kind, label in (("input", "Input"), ("output", "Output"), ("error", "Errors"))
                          if batch[f"{kind}_file_id"]]
        batch["can_cancel"] = _may_cancel(membership, row)
        counts = batch["request_counts"]
        batch["done"] = counts["completed"] + counts["failed"]
        batch["percent"] = round(100 * batch["done"] / counts["total"]) if counts["total"] else 100
        batch["created"] = datetime.fromtimestamp(batch["created_at"], tz=timezone.utc)
        batch["running"] = batch["status"] in ("in_progress", "cancelling")
    return shown


BATCHES_SHOWN = 50


def _may_cancel(membership, batch) -> bool:
    return can_change(membership=membership, organization_id=batch.organization_id,
                      created_by_id=responses.batch_creator_id(batch))


@organization_required
@require_POST
def batch_cancel(request, batch_id: str):
    batch = responses.batch_of(organization_id=request.organization.pk, batch_id=batch_id)
    if batch is None:
        raise Http404("No such batch.")
    if not _may_cancel(membership_for(user=request.user, organization=request.organization), batch):
        return forbidden(request, "A member may cancel the batches their own keys started; ask an owner or admin.")
    if response_services.cancel_batch(batch=batch).status == "cancelling":
        messages.success(request, f"Batch {batch_id} is cancelling: the requests running finish, no other starts.")
    else:
        messages.info(request, f"Batch {batch_id} had already ended.")
    return redirect("batches")


@organization_required
@require_GET
def batch_file(request, file_id: str):
    """A batch's input, output or error file, downloaded from the dashboard."""
    found = responses.file_of(organization_id=request.organization.pk, file_id=file_id)
    if found is None:  # none, expired, or deleted
        raise Http404("No such file (it may have expired or been deleted).")
    return download(found, attachment=True)
