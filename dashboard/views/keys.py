"""API keys: create (the secret shown once), list with their use and spend, revoke."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from accounts.errors import InvalidInput
from accounts.services import create_api_key, revoke_api_key
from billing.services import set_api_key_spend_limit

from .. import selectors, snippets
from ..forms import ApiKeyForm
from .common import organization_required

NEW_KEY_SESSION = "dashboard_new_api_key"


@organization_required
@require_http_methods(["GET", "POST"])
def api_keys(request):
    form = ApiKeyForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            api_key, secret = create_api_key(organization=request.organization, name=data["name"],
                                             scopes=data["scopes"], created_by=request.user,
                                             expires_at=form.expires_at())
        except InvalidInput as exc:
            form.add_error(exc.field if exc.field in form.fields else None, exc.message)
        else:
            if data.get("spend_limit") is not None:
                set_api_key_spend_limit(api_key=api_key, amount_limit=data["spend_limit"])
            # Shown once, on the next page: the session holds it for that one rendering only.
            request.session[NEW_KEY_SESSION] = {"id": api_key.pk, "secret": secret}
            return redirect("api-keys")
    new_key = request.session.pop(NEW_KEY_SESSION, None)
    keys = selectors.api_keys_with_spend(organization=request.organization)
    return render(request, "dashboard/api_keys.html", {
        "form": form, "keys": keys, "new_key": new_key, "open_form": request.method == "POST",
        "active_count": sum(1 for k in keys if k.state == "active"),
        "base_url": snippets.endpoints(request)["base_url"], "key_variable": snippets.KEY_VARIABLE,
    }, status=400 if request.method == "POST" else 200)


@organization_required
@require_POST
def api_key_revoke(request, key_id: int):
    api_key = selectors.api_key_of(organization=request.organization, key_id=key_id)
    if api_key is None:
        raise Http404("No such API key.")
    revoke_api_key(api_key=api_key)
    messages.success(request, f"{api_key.name} ({api_key.display_prefix}) is revoked: calls with it now fail.")
    return redirect("api-keys")
