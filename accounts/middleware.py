"""API key authentication for Channels (the WebSocket API).

Reads ``Authorization: Bearer sk-...`` from the handshake headers; without one it falls back to
the session user that Channels' AuthMiddleware resolved. A session user's organization is the one
the URL names (``/v1/ws?organization=<id>``: the playground names the organization its page shows,
so that what it sends is billed there even after the user switches organization in another tab),
refused unless the user belongs to it; without the parameter, the session's current one. It sets,
on the connection's scope:

- ``scope["api_key"]``: the ApiKey, or None (session user, or failure)
- ``scope["organization"]``: the caller's Organization, or None
- ``scope["auth_error"]``: a message for the client when neither worked, else None
- ``scope["auth_status"]``, ``scope["auth_code"]``: the refusal's HTTP status and error code when
  they are not 401 ``invalid_api_key`` (absent otherwise)
- ``scope["user"]``: the key's user when a key authenticated

Use :func:`ApiKeyAuthMiddlewareStack` around the WebSocket router: it puts Channels'
AuthMiddlewareStack (cookies, session, user) outside this middleware.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async

from .authentication import user_for_api_key
from .errors import ApiKeyError, MissingApiKey
from .selectors import authenticate_api_key, current_organization_for_user, organizations_for_user, parse_bearer
from .services import touch_api_key

SESSION_ORGANIZATION_KEY = "organization_id"
ORGANIZATION_PARAMETER = "organization"  # in the WebSocket URL's query string
NOT_A_MEMBER = ("You are not a member of the organization this page was opened for (any more). "
                "Reload the page to continue with your current organization.")


def scope_header(scope, name: bytes) -> bytes | None:
    """A request header from an ASGI scope (None when absent)."""
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value
    return None


@database_sync_to_async
def _from_api_key(header: bytes):
    api_key = authenticate_api_key(parse_bearer(header))
    touch_api_key(api_key=api_key)
    return api_key, user_for_api_key(api_key)


def _named_organization(scope) -> str | None:
    """The organization the URL names (the last ``organization`` parameter), or None."""
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(ORGANIZATION_PARAMETER)
    return values[-1] if values else None


@database_sync_to_async
def _named_membership(user, organization_id: str):
    """The organization ``organization_id`` names when ``user`` belongs to it, else None."""
    if not (organization_id.isascii() and organization_id.isdigit() and len(organization_id) < 19):
        return None
    return organizations_for_user(user=user).filter(pk=int(organization_id)).first()


@database_sync_to_async
def _from_session(user, session):
    organization_id = None
    if session is not None:
        try:
            organization_id = session.get(SESSION_ORGANIZATION_KEY)
        except Exception:  # a broken or missing session store must not break the handshake
            organization_id = None
    return current_organization_for_user(user=user, organization_id=organization_id)


class ApiKeyAuthMiddleware:
    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        scope = dict(scope)
        scope["api_key"] = None
        scope["organization"] = None
        scope["auth_error"] = None
        header = scope_header(scope, b"authorization")
        user = scope.get("user")
        if header:
            try:
                api_key, key_user = await _from_api_key(header)
            except ApiKeyError as exc:
                scope["auth_error"] = exc.message
            else:
                scope["api_key"] = api_key
                scope["organization"] = api_key.organization
                scope["user"] = key_user
        elif user is not None and getattr(user, "is_authenticated", False):
            named = _named_organization(scope)
            if named is not None:
                organization = await _named_membership(user, named)
                if organization is None:  # never another one in its place: that would bill it unseen
                    scope.update(auth_error=NOT_A_MEMBER, auth_status=403, auth_code="not_a_member")
            else:
                organization = await _from_session(user, scope.get("session"))
                if organization is None:
                    scope["auth_error"] = "Your account does not belong to an organization yet."
            scope["organization"] = organization
        else:
            scope["auth_error"] = MissingApiKey.default_message
        return await self.inner(scope, receive, send)


def ApiKeyAuthMiddlewareStack(inner):  # noqa: N802 (named like Channels' AuthMiddlewareStack)
    """Cookies, session and user (Channels), then the API key: wrap the WebSocket router with it."""
    return AuthMiddlewareStack(ApiKeyAuthMiddleware(inner))
