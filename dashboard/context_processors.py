"""What every dashboard page's layout needs: the organization switcher and the user's role."""

from __future__ import annotations

from collections import Counter

from django.conf import settings

from accounts.models import MANAGER_ROLES
from billing.selectors import quota_refusal

from .organizations import current_organization
from .selectors import memberships_of


def dashboard(request) -> dict:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"signup_open": settings.SIGNUP_OPEN}
    organization = current_organization(request)
    memberships = list(memberships_of(user=user))
    role = next((m.role for m in memberships if organization and m.organization_id == organization.pk), None)
    # Two of the user's organizations may share a name (each made its own, or an invitation to
    # another "Acme"): the switcher shows those with their slug, unique across the platform.
    names = Counter(_name_key(m.organization.name) for m in memberships)
    for membership in memberships:
        membership.name_is_shared = names[_name_key(membership.organization.name)] > 1
    match = getattr(request, "resolver_match", None)
    return {
        "current_organization": organization,
        "memberships": memberships,
        "current_role": role,
        "current_name_is_shared": organization is not None and names[_name_key(organization.name)] > 1,
        "can_manage_members": role in MANAGER_ROLES,
        "nav_section": _section(match.url_name if match else ""),
        # Said on every page: the API and the playground refuse requests until it is resolved.
        "quota_refusal": quota_refusal(organization=organization) if organization is not None else None,
        "email_unconfirmed": not user.email_verified,
        "signup_credit": settings.BILLING_SIGNUP_CREDIT,
    }


def _name_key(name: str) -> str:
    """Names that read the same in the switcher: "Acme" and "acme " too."""
    return " ".join(name.split()).casefold()


_SECTIONS = {
    "home": "home",
    "catalog": "catalog", "model-detail": "catalog",
    "deployments": "deployments", "deployment-new": "deployments", "deployment-detail": "deployments",
    "playground": "playground",
    "api-keys": "api-keys",
    "responses": "responses", "response-detail": "responses",
    "batches": "batches",
    "usage": "usage",
    "billing": "billing",
    "members": "members", "organization-new": "members",
    "fleet": "fleet",
    "model-import": "model-import",
}


def _section(url_name: str | None) -> str:
    return _SECTIONS.get(url_name or "", "")
