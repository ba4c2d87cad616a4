"""Reads of the accounts app that are more than a lookup. The one place an API key is resolved."""

from __future__ import annotations

import hmac
import re

from django.db.models import QuerySet
from django.utils import timezone

from inference_platform.read_cache import ReadCache

from .errors import DeactivatedApiKey, ExpiredApiKey, InvalidApiKey, MissingApiKey, RevokedApiKey
from .models import KEY_PREFIX, KEY_PREFIX_LENGTH, MANAGER_ROLES, ApiKey, Membership, Organization, User, hash_api_key

_KEY_SHAPE = re.compile(rf"^{re.escape(KEY_PREFIX)}([A-Za-z0-9]{{{KEY_PREFIX_LENGTH}}})_[A-Za-z0-9_-]{{20,200}}$")


def parse_bearer(header: str | bytes | None) -> str:
    """The key from an ``Authorization: Bearer sk-...`` header value; raises MissingApiKey/InvalidApiKey."""
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    header = (header or "").strip()
    if not header:
        raise MissingApiKey()
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise InvalidApiKey("The Authorization header must be 'Bearer sk-...'.")
    return token.strip()


# Keys by their hash, with organization and creator: read once per process until a key,
# organization or user changes (the receivers in ``apps.py`` and ``revoke_api_key`` invalidate).
_keys = ReadCache()


def authenticate_api_key(raw: str) -> ApiKey:
    """The usable key for ``raw``, with its organization and creator loaded: instances this process
    shares between requests (the read cache), to be read, not changed.

    Raises InvalidApiKey (missing, malformed or unknown), RevokedApiKey, ExpiredApiKey or
    DeactivatedApiKey (its creator is deactivated).
    """
    raw = (raw or "").strip()
    if not raw:
        raise MissingApiKey()
    match = _KEY_SHAPE.match(raw)
    if match is None:
        raise InvalidApiKey()
    digest = hash_api_key(raw)
    api_key = _keys.get(digest, lambda: _load_api_key(match.group(1), digest))
    if api_key.revoked_at is not None:
        raise RevokedApiKey()
    if api_key.is_expired(timezone.now()):
        raise ExpiredApiKey()
    # A deactivated user has lost every access; their keys with it (saving the user invalidates the cache).
    if api_key.created_by is not None and not api_key.created_by.is_active:
        raise DeactivatedApiKey()
    return api_key


def _load_api_key(prefix: str, digest: str) -> ApiKey:
    api_key = ApiKey.objects.select_related("organization", "created_by").filter(prefix=prefix).first()
    # Compare even when no row matched, so both paths cost the same hash and compare.
    expected = api_key.secret_hash if api_key is not None else "0" * 64
    if not hmac.compare_digest(expected.encode(), digest.encode()) or api_key is None:
        raise InvalidApiKey()
    return api_key


def organizations_for_user(*, user: User) -> QuerySet[Organization]:
    """The organizations ``user`` belongs to, in the order they joined them."""
    if not getattr(user, "is_authenticated", False):
        return Organization.objects.none()
    return (
        Organization.objects.filter(memberships__user=user)
        .order_by("memberships__created_at", "memberships__id")
    )


def membership_for(*, user: User, organization: Organization) -> Membership | None:
    if not getattr(user, "is_authenticated", False):
        return None
    return Membership.objects.filter(user=user, organization=organization).first()


def leave_refusal(*, membership: Membership) -> str | None:
    """Why the holder of ``membership`` cannot leave its organization, or None when they can: the
    last owner cannot (someone must own it). ``services.remove_member`` asks it under the
    organization's lock; a page asks it to offer no Leave button that can only fail."""
    if membership.role != Membership.Role.OWNER:
        return None
    others = Membership.objects.filter(organization_id=membership.organization_id, role=Membership.Role.OWNER)
    if others.exclude(pk=membership.pk).exists():
        return None
    return "The last owner cannot leave the organization."


def is_active_member(*, user_id: int, organization_id: int) -> bool:
    """Whether an active user still belongs to the organization (a session checked again)."""
    return Membership.objects.filter(user_id=user_id, user__is_active=True, organization_id=organization_id).exists()


def current_organization_for_user(*, user: User, organization_id=None) -> Organization | None:
    """A session user's current organization: ``organization_id`` (from the session) when the user
    belongs to it, else the first organization they joined, else None."""
    organizations = organizations_for_user(user=user)
    if organization_id:
        try:
            chosen = organizations.filter(pk=int(organization_id)).first()
        except (TypeError, ValueError):
            chosen = None
        if chosen is not None:
            return chosen
    return organizations.first()


def api_keys_for_organization(*, organization: Organization, include_revoked: bool = False) -> QuerySet[ApiKey]:
    keys = ApiKey.objects.filter(organization=organization).select_related("created_by")
    if not include_revoked:
        keys = keys.filter(revoked_at__isnull=True)
    return keys.order_by("-created_at", "-id")


def can_revoke_api_key(*, membership: Membership | None, api_key: ApiKey) -> bool:
    """Whether the holder of ``membership`` (None: not a member) may revoke ``api_key``.

    Takes the membership rather than the user so that a page of keys asks the database once. Staff
    (operators) get nothing more here: their powers are the operator pages and the admin site."""
    return can_change(membership=membership, organization_id=api_key.organization_id,
                      created_by_id=api_key.created_by_id)


def can_change(*, membership: Membership | None, organization_id: int, created_by_id: int | None) -> bool:
    """Whether the holder of ``membership`` may change or end something of ``organization_id``
    that ``created_by_id`` made (a key; a batch, made by a key): owners and admins anything of
    their organization, a member only their own."""
    if membership is None or membership.organization_id != organization_id:
        return False
    if membership.role in MANAGER_ROLES:
        return True
    return created_by_id is not None and created_by_id == membership.user_id
