"""Low-balance emails: an organization's owners and admins are told when its credit balance falls
below the alert they set (``SpendLimit.balance_alert``), once, and again only after the balance
has come back up to it (a top-up, a credit) and fallen once more.

Every change of a balance is followed, once its transaction commits, by ``balance_changed``: the
alert read beside the balance. Falling below claims the alert with a conditional update, so that
one of any number of concurrent charges sends it; the email goes from the billing queue, retried
while the mail server refuses it. Coming back up re-arms it.
"""

from __future__ import annotations

from decimal import Decimal

from django.db import transaction
from django.utils import timezone

from accounts.models import Organization

from . import alert_mail
from .alert_mail import dollars
from .models import OrganizationBalance, SpendLimit
from .totals import usd

SEND_TASK = "billing.tasks.send_balance_alert"


def after_commit(*, organization_id: int) -> None:
    """The organization's balance changes in this transaction: look at its alert once it commits."""
    # Robust: the charge is recorded whatever the alert's own queries meet (logged).
    transaction.on_commit(lambda: balance_changed(organization_id=organization_id), robust=True)


def balance_changed(*, organization_id: int) -> None:
    """Send the alert if the balance is below it and it was not sent since it was last above;
    re-arm it if the balance is back at or above it."""
    alert = SpendLimit.objects.filter(organization_id=organization_id, balance_alert__isnull=False) \
        .values_list("balance_alert", "balance_alert_sent_at").first()
    if alert is None:
        return
    threshold, sent_at = alert
    below = _balance(organization_id) < threshold
    if below and sent_at is None:
        claimed = SpendLimit.objects.filter(organization_id=organization_id, balance_alert_sent_at__isnull=True) \
            .update(balance_alert_sent_at=timezone.now())
        if claimed:
            _queue_email(organization_id)
    elif not below and sent_at is not None:  # only the sending read here: a newer one may have claimed it since
        SpendLimit.objects.filter(organization_id=organization_id, balance_alert_sent_at=sent_at) \
            .update(balance_alert_sent_at=None)


def _queue_email(organization_id: int) -> None:
    if not alert_mail.queue(SEND_TASK, organization_id):  # re-armed: the next charge tries again
        SpendLimit.objects.filter(organization_id=organization_id).update(balance_alert_sent_at=None)


def send_email(*, organization_id: int) -> int:
    """Email the organization's owners and admins that its balance is below its alert, if it still
    is; returns how many were emailed. The mail server's refusal is raised (OSError)."""
    organization = Organization.objects.filter(pk=organization_id).first()
    alert = SpendLimit.objects.filter(organization_id=organization_id).values_list("balance_alert", flat=True).first()
    balance = _balance(organization_id)
    if organization is None or alert is None or balance >= alert:  # removed, or topped up, meanwhile
        return 0
    name = alert_mail.one_line(organization.name)
    return alert_mail.send(organization, subject=f"credit balance below {dollars(alert)}", lines=[
        f"The credit balance of {name} is {dollars(balance)}, below the {dollars(alert)} alert set for it.",
        "Requests are refused once it reaches zero. Add credit on {page}.",
        "This email comes once each time the balance falls below the alert; change or remove the alert on that page.",
    ])


def _balance(organization_id: int) -> Decimal:
    return usd(OrganizationBalance.objects.filter(organization_id=organization_id)
               .values_list("micros", flat=True).first())
