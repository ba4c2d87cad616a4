"""Billing's receivers of other apps' signals (connected in BillingConfig.ready)."""

from __future__ import annotations

from models_catalog.errors import InvalidDeployment

from . import selectors, services


def grant_signup_credit(sender, organization, **kwargs) -> None:
    """accounts.signals.organization_created: the free sign-up credit, for the first organization
    its owner creates only (the service checks). It runs inside the organization's creation
    transaction, so both commit or neither does."""
    services.grant_signup_credit(organization=organization)


def grant_signup_credit_on_verification(sender, user, **kwargs) -> None:
    """accounts.signals.email_verified: the sign-up credit held back until the founder of an
    organization confirmed their address (in the same transaction)."""
    services.grant_signup_credit_on_verification(user=user)


def refuse_capacity_unpaid(sender, deployment, **kwargs) -> None:
    """models_catalog.signals.reserving_capacity: replicas billed by the hour are not reserved for
    an organization that cannot pay now (they would be stopped a minute later, ``reserved_capacity``)."""
    refusal = selectors.quota_refusal(organization=deployment.organization)
    if refusal is not None:
        field = "kind" if deployment.is_billed_by_the_hour else "min_replicas"
        raise InvalidDeployment(field, f"Reserved replicas of {deployment.model.slug} are billed by the hour "
                                       f"({deployment.model.price_per_replica_hour} USD per replica-hour), and your "
                                       f"organization cannot pay for them now. {refusal}")
