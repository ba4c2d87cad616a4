"""DRF permissions on API key scopes."""

from __future__ import annotations

from rest_framework.permissions import BasePermission

from .models import SCOPES, ApiKey

_cache: dict[str, type[BasePermission]] = {}


def require_scope(scope: str) -> type[BasePermission]:
    """A permission class: an API key needs ``scope`` (else 403 "missing scope"); a user logged in
    through the session (the dashboard) passes; nobody else does (401)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}: choose from {', '.join(SCOPES)}")
    if scope in _cache:
        return _cache[scope]

    class HasScope(BasePermission):
        message = f"This API key is missing the '{scope}' scope. Create a key with that scope in the dashboard."
        code = "missing_scope"
        required_scope = scope

        def has_permission(self, request, view) -> bool:
            if isinstance(request.auth, ApiKey):
                return request.auth.has_scope(scope)
            user = getattr(request, "user", None)
            return bool(user is not None and user.is_authenticated and request.auth is None)

    HasScope.__name__ = HasScope.__qualname__ = f"RequireScope_{scope}"
    _cache[scope] = HasScope
    return HasScope
