"""The current organization of a dashboard request: the session's choice when the user belongs to
it, else the first organization they joined (the same rule as the WebSocket API's)."""

from __future__ import annotations

from accounts.middleware import SESSION_ORGANIZATION_KEY
from accounts.selectors import current_organization_for_user

_CACHE = "_dashboard_organization"


def current_organization(request):
    """The request user's current Organization, or None (anonymous, or no membership)."""
    if not hasattr(request, _CACHE):
        user = getattr(request, "user", None)
        organization = None
        if user is not None and user.is_authenticated:
            organization = current_organization_for_user(
                user=user, organization_id=request.session.get(SESSION_ORGANIZATION_KEY)
            )
        setattr(request, _CACHE, organization)
    return getattr(request, _CACHE)


def choose_organization(request, organization) -> None:
    """Makes ``organization`` the session's current one (the caller checked the membership)."""
    request.session[SESSION_ORGANIZATION_KEY] = organization.pk
    setattr(request, _CACHE, organization)
