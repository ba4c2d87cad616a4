"""Reserved capacity stops when its organization can no longer pay for it.

Replicas an organization reserves are billed by the minute (``workers.metering``) whether or not
anyone calls them; a request is refused once the credit is gone or the monthly limit is reached,
but reserved replicas would go on costing. So once a minute of reserved capacity leaves the
organization refused (``selectors.quota_refusal``), its deployments that reserve billed replicas
are stopped, saying why, and its owners and admins are emailed (from the billing queue); an owner
starts them again after a top-up or a higher limit.
"""

from __future__ import annotations

import logging

from accounts.models import Organization
from models_catalog.models import Deployment
from models_catalog.services import stop_deployment

from . import alert_mail, selectors

log = logging.getLogger(__name__)
SEND_TASK = "billing.tasks.send_capacity_stopped"


def stop_if_unpaid(*, organization_id: int) -> list[str]:
    """Stop the organization's deployments whose replicas are billed by the hour when it can no
    longer pay; the names of those stopped."""
    organization = Organization.objects.filter(pk=organization_id).first()
    if organization is None:
        return []
    refusal = selectors.quota_refusal(organization=organization)
    if refusal is None:
        return []
    reason = (f"Stopped because reserved replicas are billed by the hour and your organization cannot pay for more: "
              f"{refusal} Then start it again.")
    stopped = []
    running = (Deployment.objects.filter(organization_id=organization_id, model__price_per_replica_hour__gt=0)
               .exclude(status=Deployment.Status.STOPPED).select_related("model"))
    for deployment in running:
        if deployment.bills_replica_hours and \
                stop_deployment(deployment=deployment, reason=reason):
            stopped.append(deployment.name)
    if stopped:
        log.warning("stopped %s of organization %s: %s", ", ".join(stopped), organization_id, refusal)
        alert_mail.queue(SEND_TASK, organization_id, stopped, refusal)
    return stopped


def send_email(*, organization_id: int, names: list[str], refusal: str) -> int:
    """Email the organization's owners and admins that these deployments were stopped, and why;
    returns how many were emailed. The mail server's refusal is raised (OSError)."""
    organization = Organization.objects.filter(pk=organization_id).first()
    if organization is None:
        return 0
    listed = ", ".join(names)
    return alert_mail.send(organization, subject=f"{listed} stopped: reserved replicas unpaid", lines=[
        f"These deployments were stopped because their reserved replicas are billed by the hour and your "
        f"organization cannot pay for more: {listed}.",
        refusal,
        "Requests to them are answered 503 until an owner or admin starts them again, after a top-up or a higher "
        "monthly limit: {page}",
    ])
