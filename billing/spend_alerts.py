"""Monthly spend emails: an organization's owners and admins are told when a calendar month's spend
(UTC) reaches the alert they set (``SpendLimit.spend_alert``), once a month. Beside the monthly
limit, which refuses requests, it is OpenAI's pair of a budget and a notification threshold.

After each charge commits, ``spend_changed`` reads the alert beside the month's spend. Reaching it
claims the month with a conditional update, so that one of any number of concurrent charges sends
the email (from the billing queue). A new month, or a new amount, arms it again.
"""

from __future__ import annotations

from datetime import date
from decimal import Decimal

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import Organization

from . import alert_mail
from .alert_mail import dollars
from .models import MonthlySpend, SpendLimit
from .totals import month_of, usd

SEND_TASK = "billing.tasks.send_spend_alert"


def after_commit(*, organization_id: int) -> None:
    """The organization was charged in this transaction: look at its alert once it commits."""
    # Robust: the charge is recorded whatever the alert's own queries meet (logged).
    transaction.on_commit(lambda: spend_changed(organization_id=organization_id), robust=True)


def spend_changed(*, organization_id: int) -> None:
    """Send this month's alert if the month's spend reached it and it was not sent this month."""
    alert = SpendLimit.objects.filter(organization_id=organization_id, spend_alert__isnull=False) \
        .values_list("spend_alert", "spend_alert_sent_for").first()
    month = month_of(timezone.now())
    if alert is None or alert[1] == month or _spend(organization_id, month) < alert[0]:
        return
    claimed = SpendLimit.objects.filter(Q(spend_alert_sent_for__isnull=True) | ~Q(spend_alert_sent_for=month),
                                        organization_id=organization_id).update(spend_alert_sent_for=month)
    if claimed and not alert_mail.queue(SEND_TASK, organization_id, month.isoformat()):
        # The broker unreachable: armed again, so the next charge tries again.
        SpendLimit.objects.filter(organization_id=organization_id, spend_alert_sent_for=month) \
            .update(spend_alert_sent_for=alert[1])


def send_email(*, organization_id: int, month: str) -> int:
    """Email the organization's owners and admins that ``month``'s spend (an ISO date, its first
    day) reached its alert, if that is still this month and still so; returns how many were
    emailed. The mail server's refusal is raised (OSError)."""
    organization = Organization.objects.filter(pk=organization_id).first()
    limits = SpendLimit.objects.filter(organization_id=organization_id).values_list("spend_alert", "monthly_limit").first()
    if organization is None or limits is None or limits[0] is None or date.fromisoformat(month) != month_of(timezone.now()):
        return 0  # removed meanwhile, or the month is over
    alert, limit = limits
    spend = _spend(organization_id, date.fromisoformat(month))
    if spend < alert:  # raised meanwhile
        return 0
    name = alert_mail.one_line(organization.name)
    return alert_mail.send(organization, subject=f"this month's spend reached {dollars(alert)}", lines=[
        f"{name} has spent {dollars(spend)} this month (UTC), reaching the {dollars(alert)} alert set for it.",
        f"Requests are refused once the month's spend reaches its {dollars(limit)} limit." if limit is not None
        else "It has no monthly limit: requests go on while its credit lasts.",
        "Change the alert or the limit on {page}. This email comes once a month at most.",
    ])


def _spend(organization_id: int, month: date) -> Decimal:
    return usd(MonthlySpend.objects.filter(organization_id=organization_id, month=month)
               .values_list("micros", flat=True).first())
