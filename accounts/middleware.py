"""API key authentication for Channels (the WebSocket API).

Reads ``Authorization: Bearer sk-...`` from the handshake headers; without one it falls back to
the session user that Channels' AuthMiddleware resolved. It sets, on the connection's scope:

- ``scope["api_key"]``: the ApiKey, or None (session user, or failure)
- ``scope["organization"]``: the caller's Organization, or None
- ``scope["auth_error"]``: a message for the client when neither worked, else None
- ``scope["user"]``: the key's user when a key authenticated

Use :func:`ApiKeyAuthMiddlewareStack` around the WebSocket router: it puts Channels'
AuthMiddlewareStack (cookies, session, user) outside this middleware.
"""

from __future__ import annotations

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async

from .authentication import user_for_api_key
from .errors import ApiKeyError, MissingApiKey
from .selectors import authenticate_api_key, current_organization_for_user, parse_bearer
from .services import touch_api_key

SESSION_ORGANIZATION_KEY = "organization_id"


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
