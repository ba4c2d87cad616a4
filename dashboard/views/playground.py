"""The playground: chat with a deployment over the WebSocket API, with each reply's tokens and cost."""

from __future__ import annotations

from django.http import JsonResponse
from django.shortcuts import render
from django.utils.http import urlencode
from django.views.decorators.http import require_GET

from accounts.middleware import ORGANIZATION_PARAMETER
from accounts.selectors import organizations_for_user

from .. import selectors, snippets
from .common import organization_required


@organization_required
def playground(request):
    deployments = selectors.playground_deployments(organization=request.organization)
    wanted = request.GET.get("deployment", "")
    selected = next((d for d in deployments if d.name == wanted), deployments[0] if deployments else None)
    # The socket names the organization this page shows: it bills that one, or is refused, even
    # after the user switches organization in another tab (never the session's new one unseen).
    ws_url = f"{snippets.endpoints(request)['ws_url']}?{urlencode({ORGANIZATION_PARAMETER: request.organization.pk})}"
    return render(request, "dashboard/playground.html", {
        "deployments": deployments, "selected": selected, "ws_url": ws_url,
    })


def _count(request, name: str) -> int | None:
    raw = request.GET.get(name, "0")
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 10 else None  # not "²": a digit, not a number


def _billed_organization(request):
    """The organization the playground page's socket bills (its ``organization`` parameter), which
    stays the page's after the user switches organization in another tab; the current one when the
    parameter is absent. None unless the user belongs to it."""
    raw = request.GET.get("organization", "")
    if not raw:
        return request.organization
    if not (raw.isascii() and raw.isdigit() and len(raw) < 19):
        return None
    return organizations_for_user(user=request.user).filter(pk=int(raw)).first()


def _not_found() -> JsonResponse:
    return JsonResponse({"error": {"message": "Unknown reply.", "type": "invalid_request_error", "param": None,
                                   "code": "not_found"}}, status=404)


@organization_required
@require_GET
def reply_cost(request):
    """``GET /playground/cost/?request_id&organization&deployment&prompt_tokens&cached_prompt_tokens
    &completion_tokens&status``: one reply's tokens and cost, billed (the usage record of the
    organization it was billed to) or estimated with the same prices."""
    counts = {name: _count(request, name) for name in ("prompt_tokens", "cached_prompt_tokens", "completion_tokens")}
    if any(value is None for value in counts.values()) or counts["cached_prompt_tokens"] > counts["prompt_tokens"]:
        return JsonResponse({"error": {"message": "Token counts must be whole numbers.", "type": "invalid_request_error",
                                       "param": None, "code": "invalid_value"}}, status=400)
    organization = _billed_organization(request)
    if organization is None:  # not the user's: answered as an unknown reply, saying nothing of it
        return _not_found()
    deployment = selectors.deployment_for(organization=organization, name=request.GET.get("deployment", ""))
    cost = selectors.reply_cost(organization=organization, request_id=request.GET.get("request_id", ""),
                                deployment=deployment, status=request.GET.get("status", "completed"), **counts)
    if cost is None:
        return _not_found()
    return JsonResponse({"source": cost.source, "prompt_tokens": cost.prompt_tokens,
                         "cached_prompt_tokens": cost.cached_prompt_tokens,
                         "completion_tokens": cost.completion_tokens, "cost": str(cost.cost), "status": cost.status})
