"""Monthly spend emails: an organization's owners and admins are told when a calendar month's spend
(UTC) reaches the alert they set (``SpendLimit.spend_alert``), once a month. Beside the monthly
limit, which refuses requests, it is OpenAI's pair of a budget and a notification threshold.

After each charge commits, ``spend_changed`` reads the alert beside the spend of the charge's month
(its usage record's: a late event counts for the month it ran in). Reaching it claims that month
with a conditional update, so that one of any number of concurrent charges sends the email (from
the billing queue). A new month, or a new amount, arms it again.
"""

from __future__ import annotations

from datetime import date
from decimal import Decimal

from django.db import transaction
from django.db.models import Q

from accounts.models import Organization

from . import alert_mail
from .alert_mail import dollars
from .models import MonthlySpend, SpendLimit
from .totals import usd

SEND_TASK = "billing.tasks.send_spend_alert"


def after_commit(*, organization_id: int, month: date) -> None:
    """The organization was charged in this transaction, for ``month`` (its usage record's): look at
    that month's alert once it commits."""
    # Robust: the charge is recorded whatever the alert's own queries meet (logged).
    transaction.on_commit(lambda: spend_changed(organization_id=organization_id, month=month), robust=True)


def spend_changed(*, organization_id: int, month: date) -> None:
    """Send ``month``'s alert if its spend reached it (more than nothing: an alert of 0 waits for a
    charge) and it was not sent for this month or a later one."""
    alert = SpendLimit.objects.filter(organization_id=organization_id, spend_alert__isnull=False) \
        .values_list("spend_alert", "spend_alert_sent_for").first()
    if alert is None or (alert[1] is not None and alert[1] >= month):
        return
    threshold, sent_for = alert
    spend = _spend(organization_id, month)
    if spend < threshold or spend <= 0:
        return
    # Only the alert read here: an amount changed since arms its own (and was looked at then).
    claimed = SpendLimit.objects.filter(Q(spend_alert_sent_for__isnull=True) | Q(spend_alert_sent_for__lt=month),
                                        organization_id=organization_id, spend_alert=threshold) \
        .update(spend_alert_sent_for=month)
    if claimed and not alert_mail.queue(SEND_TASK, organization_id, month.isoformat()):
        # The broker unreachable: armed again, so the next charge tries again.
        SpendLimit.objects.filter(organization_id=organization_id, spend_alert=threshold, spend_alert_sent_for=month) \
            .update(spend_alert_sent_for=sent_for)


def send_email(*, organization_id: int, month: str) -> int:
    """Email the organization's owners and admins that ``month``'s spend (an ISO date, its first
    day) reached its alert, if it still does; returns how many were emailed. The mail server's
    refusal is raised (OSError)."""
    organization = Organization.objects.filter(pk=organization_id).first()
    limits = SpendLimit.objects.filter(organization_id=organization_id).values_list("spend_alert", "monthly_limit").first()
    if organization is None or limits is None or limits[0] is None:
        return 0  # removed meanwhile
    alert, limit = limits
    first_day = date.fromisoformat(month)
    spend = _spend(organization_id, first_day)
    if spend < alert or spend <= 0:  # raised meanwhile
        return 0
    name, called = alert_mail.one_line(organization.name), first_day.strftime("%B %Y")
    return alert_mail.send(organization, subject=f"{called}'s spend reached {dollars(alert)}", lines=[
        f"{name} has spent {dollars(spend)} in {called} (UTC), reaching the {dollars(alert)} alert set for it.",
        f"Requests are refused once a month's spend reaches its {dollars(limit)} limit." if limit is not None
        else "It has no monthly limit: requests go on while its credit lasts.",
        "Change the alert or the limit on {page}. This email comes once a month, and again if the alert is changed.",
    ])


def _spend(organization_id: int, month: date) -> Decimal:
    return usd(MonthlySpend.objects.filter(organization_id=organization_id, month=month)
               .values_list("micros", flat=True).first())
