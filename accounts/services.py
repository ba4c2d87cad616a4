"""Every write of the accounts app. Keyword-only arguments."""

from __future__ import annotations

import secrets
import string
from datetime import datetime, timedelta

from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.validators import validate_email
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.text import slugify

from inference_platform import read_cache

from .errors import InvalidInput
from .models import (CONTROL_CHARACTERS, KEY_PREFIX, KEY_PREFIX_LENGTH, NO_CONTROL_CHARACTERS, SCOPES, ApiKey,
                     Membership, Organization, User, hash_api_key)
from .selectors import leave_refusal
from .signals import email_verified, organization_created

# last_used_at is written at most this often per key.
TOUCH_INTERVAL = timedelta(seconds=60)
_PREFIX_ALPHABET = string.ascii_letters + string.digits


def _clean_name(model, name: str | None, *, missing: str | None) -> str:
    """``name`` stripped, for ``model``'s ``name`` field: refused (InvalidInput "name") when empty
    (with ``missing`` as the message; None: empty is allowed), too long, or holding a control
    character (a CR/LF in a name broke the invitation email's subject)."""
    name = (name or "").strip()
    if not name and missing is not None:
        raise InvalidInput("name", missing)
    max_length = model._meta.get_field("name").max_length
    if len(name) > max_length:
        raise InvalidInput("name", f"The name is too long ({max_length} characters at most).")
    if CONTROL_CHARACTERS.search(name):
        raise InvalidInput("name", NO_CONTROL_CHARACTERS)
    return name


def create_user(*, email: str, password: str | None, name: str = "", validate: bool = True,
                email_verified: bool = True) -> User:
    """A new user. ``password=None`` gives an unusable password (set later through a reset).
    ``email_verified=False``: the address is not known to be theirs until they confirm it
    (``verify_email``)."""
    name = _clean_name(User, name, missing=None)
    email = (email or "").strip().lower()
    try:
        validate_email(email)
    except ValidationError:
        raise InvalidInput("email", "Enter a valid email address.") from None
    if User.objects.filter(email__iexact=email).exists():
        raise InvalidInput("email", "A user with this email address already exists.")
    if password is not None and validate:
        try:
            validate_password(password, User(email=email, name=name))
        except ValidationError as exc:
            raise InvalidInput("password", " ".join(exc.messages)) from None
    try:
        with transaction.atomic():
            return User.objects.create_user(email=email, password=password, name=name,
                                            **({} if email_verified else {"email_verified_at": None}))
    except IntegrityError:
        raise InvalidInput("email", "A user with this email address already exists.") from None


@transaction.atomic
def verify_email(*, user: User) -> bool:
    """Record that ``user`` confirmed their address, once; sends ``email_verified`` then. Whether
    this call did (False: it was confirmed already)."""
    confirmed = User.objects.filter(pk=user.pk, email_verified_at__isnull=True).update(email_verified_at=timezone.now())
    user.refresh_from_db(fields=["email_verified_at"])
    if confirmed:
        email_verified.send(sender=User, user=user)
    return bool(confirmed)


def _unique_slug(name: str) -> str:
    base = slugify(name)[:150] or "org"
    slug, n = base, 1
    while Organization.objects.filter(slug=slug).exists():
        n += 1
        slug = f"{base}-{n}"
    return slug


@transaction.atomic
def create_organization(*, name: str, owner: User) -> Organization:
    """A new organization with ``owner`` as its owner; sends ``organization_created``."""
    name = _clean_name(Organization, name, missing="An organization needs a name.")
    for attempt in range(5):
        try:
            with transaction.atomic():
                organization = Organization.objects.create(name=name, slug=_unique_slug(name))
            break
        except IntegrityError:  # a concurrent creation took the slug
            if attempt == 4:
                raise
    Membership.objects.create(user=owner, organization=organization, role=Membership.Role.OWNER)
    organization_created.send(sender=Organization, organization=organization)
    return organization


def add_member(*, organization: Organization, user: User, role: str = Membership.Role.MEMBER) -> Membership:
    """Adds ``user`` to ``organization``, or changes the role of an existing member."""
    if role not in Membership.Role.values:
        raise InvalidInput("role", f"The role must be one of {', '.join(Membership.Role.values)}.")
    membership, created = Membership.objects.get_or_create(
        organization=organization, user=user, defaults={"role": role}
    )
    if not created and membership.role != role:
        membership.role = role
        membership.save(update_fields=["role"])
    return membership


def lock_organization(organization: Organization) -> None:
    """Serialize membership changes of ``organization`` until this transaction ends: "is this the
    last owner?" is a count, which two concurrent changes would each pass."""
    Organization.objects.select_for_update().filter(pk=organization.pk).first()


def remove_member(*, organization: Organization, user: User) -> int:
    """Removes a member and revokes the API keys they created for the organization (a key must
    not outlive its holder's access, as with OpenAI's); the last owner cannot leave (someone must
    own the organization). Returns how many keys were revoked."""
    with transaction.atomic():
        lock_organization(organization)
        membership = Membership.objects.filter(organization=organization, user=user).first()
        if membership is None:
            return 0
        refusal = leave_refusal(membership=membership)
        if refusal:
            raise InvalidInput("user", refusal)
        revoked = revoke_keys_of(user_id=user.pk, organization_id=organization.pk)
        membership.delete()  # its pre_delete receiver finds nothing left to revoke
    return revoked


def revoke_keys_of(*, user_id: int, organization_id: int | None = None) -> int:
    """Revokes the keys ``user_id`` created (in ``organization_id`` only, when given): their holder
    lost that access. ``receivers`` call it for every deletion of a membership or a user, however
    made (the admin site, a cascade), so that it cannot be skipped. Returns how many."""
    keys = ApiKey.objects.filter(created_by_id=user_id, revoked_at__isnull=True)
    if organization_id is not None:
        keys = keys.filter(organization_id=organization_id)
    revoked = keys.update(revoked_at=timezone.now())
    if revoked:
        read_cache.invalidate()
    return revoked


def validate_scopes(scopes) -> list[str]:
    if not isinstance(scopes, (list, tuple)) or not scopes:
        raise InvalidInput("scopes", f"Give at least one scope of: {', '.join(SCOPES)}.")
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown:
        raise InvalidInput("scopes", f"Unknown scope {unknown[0]!r}: choose from {', '.join(SCOPES)}.")
    return [s for s in SCOPES if s in scopes]  # canonical order, no duplicates


def _new_key() -> tuple[str, str]:
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(KEY_PREFIX_LENGTH))
    return prefix, f"{KEY_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"


def create_api_key(
    *,
    organization: Organization,
    name: str,
    scopes: list[str],
    created_by: User | None = None,
    expires_at: datetime | None = None,
    origin: str = ApiKey.Origin.MEMBER,
) -> tuple[ApiKey, str]:
    """A new key for ``organization``. Returns the row and the plaintext key, which exists only here.

    ``origin``: ``ApiKey.Origin.COMMAND_LINE`` only from the operator's command line; with no
    ``created_by`` such a key acts as the organization (any other creator-less key has no role)."""
    name = _clean_name(ApiKey, name, missing="A key needs a name.")
    scopes = validate_scopes(scopes)
    if origin not in ApiKey.Origin.values:
        raise InvalidInput("origin", f"The origin must be one of {', '.join(ApiKey.Origin.values)}.")
    if expires_at is not None and expires_at <= timezone.now():
        raise InvalidInput("expires_at", "The expiry must be in the future.")
    for attempt in range(5):
        prefix, raw = _new_key()
        try:
            with transaction.atomic():
                api_key = ApiKey.objects.create(
                    organization=organization, created_by=created_by, name=name, prefix=prefix,
                    secret_hash=hash_api_key(raw), scopes=scopes, expires_at=expires_at, origin=origin,
                )
            return api_key, raw
        except IntegrityError:  # a prefix collision: astronomically rare, draw again
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


def revoke_api_key(*, api_key: ApiKey) -> None:
    """Revokes at once; revoking twice keeps the first time."""
    now = timezone.now()
    ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=now)
    read_cache.invalidate()
    api_key.refresh_from_db(fields=["revoked_at"])


def touch_api_key(*, api_key: ApiKey) -> None:
    """Records that the key was used; writes at most once a minute per key."""
    now = timezone.now()
    if api_key.last_used_at is not None and now - api_key.last_used_at < TOUCH_INTERVAL:
        return
    ApiKey.objects.filter(pk=api_key.pk).filter(
        Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - TOUCH_INTERVAL)
    ).update(last_used_at=now)
    api_key.last_used_at = now
