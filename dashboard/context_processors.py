"""What every dashboard page's layout needs: the organization switcher and the user's role."""

from __future__ import annotations

from accounts.models import MANAGER_ROLES

from .organizations import current_organization
from .selectors import memberships_of


def dashboard(request) -> dict:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    organization = current_organization(request)
    memberships = list(memberships_of(user=user))
    role = next((m.role for m in memberships if organization and m.organization_id == organization.pk), None)
    match = getattr(request, "resolver_match", None)
    return {
        "current_organization": organization,
        "memberships": memberships,
        "current_role": role,
        "can_manage_members": role in MANAGER_ROLES,
        "nav_section": _section(match.url_name if match else ""),
    }


_SECTIONS = {
    "home": "home",
    "catalog": "catalog", "model-detail": "catalog",
    "deployments": "deployments", "deployment-new": "deployments", "deployment-detail": "deployments",
    "playground": "playground",
    "api-keys": "api-keys",
    "usage": "usage",
    "billing": "billing",
    "members": "members", "organization-new": "members",
    "fleet": "fleet",
    "model-import": "model-import",
}


def _section(url_name: str | None) -> str:
    return _SECTIONS.get(url_name or "", "")
