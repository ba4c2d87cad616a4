"""Billing's receivers of other apps' signals (connected in BillingConfig.ready)."""

from __future__ import annotations

from . import services


def grant_signup_credit(sender, organization, **kwargs) -> None:
    """accounts.signals.organization_created: the free sign-up credit, for the first organization
    its owner creates only (the service checks). It runs inside the organization's creation
    transaction, so both commit or neither does."""
    services.grant_signup_credit(organization=organization)


def grant_signup_credit_on_verification(sender, user, **kwargs) -> None:
    """accounts.signals.email_verified: the sign-up credit held back until the founder of an
    organization confirmed their address (in the same transaction)."""
    services.grant_signup_credit_on_verification(user=user)
