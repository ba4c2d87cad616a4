"""API keys: create (the secret shown once), list with their use and spend, revoke."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from accounts.errors import InvalidInput
from accounts.selectors import can_revoke_api_key, membership_for
from accounts.services import revoke_api_key

from .. import selectors, services, snippets
from ..forms import ApiKeyForm
from .common import organization_required

# The new secret rides to the next page (post/redirect/get, so a reload creates nothing) in a
# signed cookie that lives a minute at most and is deleted on that page: it is stored nowhere on
# the server, not even in the session.
NEW_KEY_COOKIE, NEW_KEY_SALT, NEW_KEY_MAX_AGE = "new_api_key", "dashboard.new-api-key", 60


def _new_key(request) -> dict | None:
    """The key created just before this page, if it is this organization's."""
    value = request.get_signed_cookie(NEW_KEY_COOKIE, default=None, salt=NEW_KEY_SALT, max_age=NEW_KEY_MAX_AGE)
    key_id, _, secret = (value or "").partition(":")
    if not key_id.isdecimal() or selectors.api_key_of(organization=request.organization, key_id=int(key_id)) is None:
        return None
    return {"id": int(key_id), "secret": secret}


@organization_required
@require_http_methods(["GET", "POST"])
def api_keys(request):
    form = ApiKeyForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            api_key, secret = services.create_api_key(
                organization=request.organization, name=data["name"], scopes=data["scopes"],
                created_by=request.user, expires_at=form.expires_at(), spend_limit=data.get("spend_limit"))
        except InvalidInput as exc:
            form.add_error(exc.field if exc.field in form.fields else None, exc.message)
        else:
            response = redirect("api-keys")
            response.set_signed_cookie(NEW_KEY_COOKIE, f"{api_key.pk}:{secret}", salt=NEW_KEY_SALT,
                                       max_age=NEW_KEY_MAX_AGE, path=request.path, secure=request.is_secure(),
                                       httponly=True, samesite="Strict")
            return response
    new_key = _new_key(request) if request.method == "GET" else None
    keys = selectors.api_keys_with_spend(organization=request.organization)
    membership = membership_for(user=request.user, organization=request.organization)
    for key in keys:  # the Revoke button only where the revoke would be allowed
        key.can_revoke = can_revoke_api_key(membership=membership, api_key=key)
    response = render(request, "dashboard/api_keys.html", {
        "form": form, "keys": keys, "new_key": new_key, "open_form": request.method == "POST",
        "active_count": sum(1 for k in keys if k.state == "active"),
        "base_url": snippets.endpoints(request)["base_url"], "key_variable": snippets.KEY_VARIABLE,
    }, status=400 if request.method == "POST" else 200)
    if NEW_KEY_COOKIE in request.COOKIES:
        response.delete_cookie(NEW_KEY_COOKIE, path=request.path, samesite="Strict")
    if new_key is not None:
        response["Cache-Control"] = "no-store"  # nor in the browser's cache
    return response


@organization_required
@require_POST
def api_key_revoke(request, key_id: int):
    api_key = selectors.api_key_of(organization=request.organization, key_id=key_id)
    if api_key is None:
        raise Http404("No such API key.")
    membership = membership_for(user=request.user, organization=request.organization)
    if not can_revoke_api_key(membership=membership, api_key=api_key):
        messages.error(request, f"{api_key.name} was not revoked: members may revoke only the keys they created. "
                                "Ask an owner or an admin.")
        return redirect("api-keys")
    revoke_api_key(api_key=api_key)
    messages.success(request, f"{api_key.name} ({api_key.display_prefix}) is revoked: calls with it now fail.")
    return redirect("api-keys")
