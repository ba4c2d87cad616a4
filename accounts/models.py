"""Users (email login), organizations and their members, and API keys.

An API key belongs to an organization. Only a SHA-256 hash of the full key is stored: the key is a
high-entropy random secret, so a fast hash is enough and nothing in the row lets anyone rebuild it.
The visible ``prefix`` finds the row; the hash is then compared in constant time.
"""

from __future__ import annotations

import hashlib
import re

from django.contrib.auth.base_user import AbstractBaseUser, BaseUserManager
from django.contrib.auth.models import PermissionsMixin
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models.functions import Lower
from django.utils import timezone

# What an API key may be allowed to do.
SCOPE_INFERENCE = "inference"
SCOPE_READ_USAGE = "read_usage"
SCOPE_MANAGE = "manage"
SCOPES = (SCOPE_INFERENCE, SCOPE_READ_USAGE, SCOPE_MANAGE)

KEY_PREFIX = "sk-"
KEY_PREFIX_LENGTH = 12  # the visible part after "sk-"


# Control characters (C0, DEL, C1) and Unicode's line and paragraph separators. A name holding one
# breaks what it is written into: an email subject (a header: CR/LF there is a 500), a log line.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
NO_CONTROL_CHARACTERS = "The name cannot contain line breaks, tabs or other control characters."


def validate_no_control_characters(value: str) -> None:
    """A model field validator (the admin site's forms run it); the services check the same."""
    if CONTROL_CHARACTERS.search(value or ""):
        raise ValidationError(NO_CONTROL_CHARACTERS, code="control_characters")


def hash_api_key(raw: str) -> str:
    """The stored form of a key: SHA-256 hex of the whole key (a random secret, so no slow hash)."""
    return hashlib.sha256(raw.encode()).hexdigest()


class UserManager(BaseUserManager):
    use_in_migrations = True

    def _create(self, email: str, password: str | None, **extra) -> "User":
        if not email:
            raise ValueError("a user needs an email address")
        user = self.model(email=self.normalize_email(email).lower(), **extra)
        if password:
            user.set_password(password)
        else:
            user.set_unusable_password()
        user.save(using=self._db)
        return user

    def create_user(self, email: str, password: str | None = None, **extra) -> "User":
        extra.setdefault("is_staff", False)
        extra.setdefault("is_superuser", False)
        return self._create(email, password, **extra)

    def create_superuser(self, email: str, password: str | None = None, **extra) -> "User":
        extra["is_staff"] = True
        extra["is_superuser"] = True
        return self._create(email, password, **extra)

    def get_by_natural_key(self, email):
        return self.get(email__iexact=email)


class User(AbstractBaseUser, PermissionsMixin):
    """A person who logs in with an email address and a password."""

    email = models.EmailField("email address", max_length=254, unique=True)
    name = models.CharField(max_length=150, blank=True, validators=[validate_no_control_characters])
    is_staff = models.BooleanField(default=False, help_text="May log in to the operator's admin site.")
    is_active = models.BooleanField(default=True)
    date_joined = models.DateTimeField(default=timezone.now)
    # When the user showed the address is theirs (its link clicked); None: not yet. Only an open
    # sign-up leaves it empty (SIGNUP_VERIFY_EMAIL): an operator's accounts and invitations' need no link.
    email_verified_at = models.DateTimeField(null=True, blank=True, default=timezone.now)

    objects = UserManager()

    USERNAME_FIELD = "email"
    EMAIL_FIELD = "email"
    REQUIRED_FIELDS: list[str] = []

    class Meta:
        constraints = [models.UniqueConstraint(Lower("email"), name="accounts_user_email_ci_unique")]

    def __str__(self) -> str:
        return self.email

    @property
    def email_verified(self) -> bool:
        return self.email_verified_at is not None

    def get_full_name(self) -> str:
        return self.name or self.email

    def get_short_name(self) -> str:
        return self.name or self.email.split("@")[0]


class Organization(models.Model):
    """The unit that owns deployments, API keys, credits and usage."""

    name = models.CharField(max_length=150, validators=[validate_no_control_characters])
    slug = models.SlugField(max_length=160, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "id"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        ADMIN = "admin", "Admin"
        MEMBER = "member", "Member"

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="memberships")
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(fields=["user", "organization"], name="accounts_membership_unique_pair"),
            models.CheckConstraint(condition=models.Q(role__in=["owner", "admin", "member"]),
                                   name="accounts_membership_role_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.organization} ({self.role})"


# The roles that manage an organization: its members, every API key and deployment, its spend
# limit (a member manages only the keys and deployments they created).
MANAGER_ROLES = (Membership.Role.OWNER, Membership.Role.ADMIN)


class ApiKey(models.Model):
    """An organization's API key. The secret itself is never stored, only its SHA-256 hex digest.

    A key acts with the role of the member who created it. A key without a creator acts as the
    organization itself only when ``origin`` says the operator's command line made it: a creator
    can also go missing (a deleted user), and that must never turn a member's key into a manager's."""

    class Origin(models.TextChoices):
        MEMBER = "member", "A member (dashboard or code)"
        COMMAND_LINE = "command_line", "The operator's command line"

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="api_keys")
    created_by = models.ForeignKey(User, null=True, blank=True, on_delete=models.SET_NULL, related_name="api_keys")
    # db_default too: code older than this field, still running during an upgrade, inserts keys without it.
    origin = models.CharField(max_length=16, choices=Origin.choices, default=Origin.MEMBER,
                              db_default=Origin.MEMBER, editable=False)
    name = models.CharField(max_length=100, validators=[validate_no_control_characters])
    prefix = models.CharField(max_length=KEY_PREFIX_LENGTH, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, unique=True, editable=False)
    scopes = models.JSONField(default=list)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=~models.Q(secret_hash=""), name="accounts_apikey_hash_not_empty"),
            models.CheckConstraint(condition=~models.Q(prefix=""), name="accounts_apikey_prefix_not_empty"),
            models.CheckConstraint(condition=models.Q(origin__in=["member", "command_line"]),
                                   name="accounts_apikey_origin_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.display_prefix})"

    @property
    def display_prefix(self) -> str:
        """What the dashboard shows so a user recognises a key: ``sk-abcd1234wxyz…``."""
        return f"{KEY_PREFIX}{self.prefix}…"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    def is_expired(self, now=None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())

    def has_scope(self, scope: str) -> bool:
        return scope in (self.scopes or [])

    @property
    def acts_as_organization(self) -> bool:
        """No member's role limits this key: the command line made it for no user."""
        return self.created_by_id is None and self.origin == self.Origin.COMMAND_LINE
