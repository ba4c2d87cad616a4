"""Dashboard data: invitations to join an organization.

An invitation is a secret link mailed to an address. Like API keys, only a SHA-256 hash of the
link's token is stored; the token itself exists in the email only.
"""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.db.models.functions import Lower
from django.utils import timezone

ROLES = ("owner", "admin", "member")
ROLE_LABELS = {"owner": "Owner", "admin": "Admin", "member": "Member"}


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class Invitation(models.Model):
    """An invitation for ``email`` to join ``organization`` with ``role``; pending until accepted,
    revoked or expired."""

    organization = models.ForeignKey("accounts.Organization", on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField(max_length=254)
    role = models.CharField(max_length=16, default="member")
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    invited_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="+")
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=Q(role__in=ROLES), name="dashboard_invitation_role_valid"),
            models.CheckConstraint(condition=~Q(token_hash=""), name="dashboard_invitation_token_not_empty"),
            models.CheckConstraint(condition=Q(expires_at__gt=models.F("created_at")),
                                   name="dashboard_invitation_expires_after_creation"),
            # One open invitation per address and organization.
            models.UniqueConstraint(Lower("email"), "organization",
                                    condition=Q(accepted_at__isnull=True, revoked_at__isnull=True),
                                    name="dashboard_invitation_one_open_per_email"),
        ]

    def __str__(self) -> str:
        return f"{self.email} → {self.organization} ({self.role})"

    @property
    def role_label(self) -> str:
        return ROLE_LABELS.get(self.role, self.role)

    @property
    def is_open(self) -> bool:
        return self.accepted_at is None and self.revoked_at is None and self.expires_at > timezone.now()

    @property
    def status(self) -> str:
        if self.accepted_at is not None:
            return "accepted"
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at <= timezone.now():
            return "expired"
        return "pending"
