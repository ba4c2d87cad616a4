"""What billing's alert emails share: who gets them (an organization's active owners and admins),
how they leave (a task on the billing queue, retried while the mail server refuses), the link to
the billing page, and amounts written exactly."""

from __future__ import annotations

import logging
from decimal import Decimal

from django.conf import settings
from django.core.mail import send_mail
from django.urls import reverse

from accounts.models import MANAGER_ROLES, Membership, Organization

from .dispatch import BILLING_QUEUE

log = logging.getLogger(__name__)


def queue(task: str, *args) -> bool:
    """Put an email's task on the billing queue; False if the broker cannot be reached (logged)."""
    from inference_platform.celery import app  # the project's app, whichever one is current

    try:
        app.send_task(task, args=list(args), queue=BILLING_QUEUE, retry=True,
                      retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2})
    except Exception:
        log.exception("could not queue %s%r", task, args)
        return False
    return True


def send(organization: Organization, *, subject: str, lines: list[str]) -> int:
    """Email ``organization``'s active owners and admins; returns how many. ``lines``: paragraphs,
    where ``{page}`` stands for the billing page. The mail server's refusal is raised (OSError)."""
    recipients = sorted(set(Membership.objects.filter(
        organization=organization, role__in=MANAGER_ROLES, user__is_active=True)
        .exclude(user__email="").values_list("user__email", flat=True)))
    if not recipients:
        return 0
    site = settings.SITE_URL or settings.OWN_SITE_URL
    page = f"{site}{reverse('billing')}" if site else "the dashboard's Billing page"
    send_mail(subject=f"{one_line(organization.name)}: {subject}",
              message="\n\n".join(line.replace("{page}", page) for line in lines),
              from_email=None, recipient_list=recipients)
    return len(recipients)


def one_line(text: str) -> str:
    """A name fit for a header, which takes no line break."""
    return " ".join(text.split())


def dollars(amount: Decimal) -> str:
    """$1,234.50; -$0.31; $0.000125 (a cent's fraction shown, never rounded away)."""
    text = format(abs(amount).normalize(), ",f")
    whole, _, fraction = text.partition(".")
    return f"{'-' if amount < 0 else ''}${whole}.{fraction.ljust(2, '0')}"
