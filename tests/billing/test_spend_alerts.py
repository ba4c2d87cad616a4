"""Monthly spend alerts: owners and admins are emailed once a month when the calendar month's
spend (UTC) reaches the alert the organization set (``PUT /v1/billing/limits {"spend_alert": ...}``
or the billing page), beside the monthly limit that refuses requests."""

from __future__ import annotations

import json
from datetime import date, datetime, timedelta
from datetime import timezone as dt_timezone
from decimal import Decimal

import pytest
from django.core import mail
from django.test import Client

from billing import selectors, services, spend_alerts
from billing.models import SpendLimit
from billing.totals import month_of
from django.utils import timezone
from tests.billing.conftest import make_catalog_model, make_key, make_organization, usage_event

# usage_event's defaults at the catalog's sample prices (see test_balance_alerts).
CHARGE = Decimal("0.000535")


@pytest.fixture
def queued(monkeypatch):
    """The (organization, month) of each spend alert queued (the queue is test_balance_alerts' e2e)."""
    sent: list[tuple] = []

    def send_task(name, args, **options):
        assert name == spend_alerts.SEND_TASK and options["queue"] == "billing"
        sent.append(tuple(args))

    monkeypatch.setattr("inference_platform.celery.app.send_task", send_task)
    return sent


@pytest.fixture
def acme(db):
    make_catalog_model()
    return make_organization("Acme")


def charge(organization, times: int = 1) -> None:
    for _ in range(times):
        services.record_usage(event=usage_event(organization))


def this_month() -> str:
    return month_of(timezone.now()).isoformat()


@pytest.mark.django_db(transaction=True)
def test_reaching_the_alert_queues_one_email_a_month(acme, queued):
    services.set_spend_alert(organization=acme, amount=CHARGE * 2)
    charge(acme)
    assert queued == []
    charge(acme, times=3)  # reached at the second, and beyond
    assert queued == [(acme.pk, this_month())]
    # Last month's email does not count for this one: a new month arms it again.
    SpendLimit.objects.filter(organization=acme).update(spend_alert_sent_for=date(2000, 1, 1))
    charge(acme)
    assert queued == [(acme.pk, this_month())] * 2
    # A new amount arms it too (already reached: sent at once); the same one saved again does not.
    services.set_spend_alert(organization=acme, amount=CHARGE * 3)
    services.set_spend_alert(organization=acme, amount=CHARGE * 3)
    assert len(queued) == 3


@pytest.mark.django_db(transaction=True)
def test_free_requests_look_at_nothing_and_an_alert_of_zero_waits_for_a_charge(acme, queued):
    services.set_spend_alert(organization=acme, amount=Decimal("0"))
    assert queued == []  # nothing spent: nothing reached
    charge(acme, times=2)
    assert queued == [(acme.pk, this_month())]
    SpendLimit.objects.filter(organization=acme).update(spend_alert=CHARGE, spend_alert_sent_for=None)  # no hook
    services.record_usage(event=usage_event(acme, status="cancelled", completion_tokens=0))  # free: no charge
    assert queued == [(acme.pk, this_month())]


@pytest.mark.django_db(transaction=True)
def test_a_late_event_counts_for_the_month_it_ran_in(acme, queued):
    """Recorded after midnight on the first (a backlog, a replay), it is last month's spend."""
    last_month = (month_of(timezone.now()) - timedelta(days=1)).replace(day=1)
    SpendLimit.objects.create(organization=acme, spend_alert=CHARGE)
    late = datetime.combine(last_month + timedelta(days=27), datetime.min.time(), tzinfo=dt_timezone.utc)
    services.record_usage(event=usage_event(acme, finished_at=late))
    assert queued == [(acme.pk, last_month.isoformat())]
    charge(acme)  # this month's own spend reaches it too: its own email
    assert queued == [(acme.pk, last_month.isoformat()), (acme.pk, this_month())]


@pytest.mark.django_db(transaction=True)
def test_a_claim_for_an_amount_changed_meanwhile_marks_nothing(acme, queued, monkeypatch):
    """A charge read the $X alert; the owner raised it before the charge's claim: the claim must
    not mark the month sent for the new amount, which would then never be sent this month."""
    charge(acme, times=2)
    SpendLimit.objects.create(organization=acme, spend_alert=CHARGE)
    real = spend_alerts._spend

    def spend_read_while_the_owner_raises_it(organization_id, month):
        SpendLimit.objects.filter(organization=acme).update(spend_alert=Decimal("1"), spend_alert_sent_for=None)
        return real(organization_id, month)

    monkeypatch.setattr(spend_alerts, "_spend", spend_read_while_the_owner_raises_it)
    spend_alerts.spend_changed(organization_id=acme.pk, month=month_of(timezone.now()))
    assert queued == [] and SpendLimit.objects.get(organization=acme).spend_alert_sent_for is None


@pytest.mark.django_db
def test_the_email_names_the_spend_the_alert_and_the_limit(settings, acme):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.SITE_URL = "https://llm.example.com"
    charge(acme, times=2)
    SpendLimit.objects.create(organization=acme, spend_alert=CHARGE, monthly_limit=Decimal("50"))
    assert spend_alerts.send_email(organization_id=acme.pk, month=this_month()) == 1
    [email] = mail.outbox
    called = timezone.now().strftime("%B %Y")
    assert email.subject == f"Acme: {called}'s spend reached $0.000535"
    assert f"Acme has spent $0.00107 in {called} (UTC), reaching the $0.000535 alert" in email.body
    assert "its $50.00 limit" in email.body and "https://llm.example.com/billing/" in email.body
    # A month that spent nothing, or the alert raised meanwhile: nothing to say.
    assert spend_alerts.send_email(organization_id=acme.pk, month="2000-01-01") == 0
    SpendLimit.objects.filter(organization=acme).update(spend_alert=Decimal("1"))
    assert spend_alerts.send_email(organization_id=acme.pk, month=this_month()) == 0 and len(mail.outbox) == 1


@pytest.mark.django_db
def test_the_api_and_the_page_set_the_spend_alert(client, queued):
    organization = make_organization("Acme")
    _, manager = make_key(organization, scopes=["manage"])
    response = client.generic("PUT", "/v1/billing/limits", json.dumps({"spend_alert": "80.00"}),
                              content_type="application/json", headers={"Authorization": f"Bearer {manager}"})
    assert response.status_code == 200 and response.json()["spend_alert"] == "80.000000", response.content
    assert response.json()["balance_alert"] is None and response.json()["monthly_limit"] is None

    browser = Client()
    browser.force_login(organization.memberships.get(role="owner").user)
    assert b'id="spend-alert-form"' in browser.get("/billing/").content
    page = browser.post("/billing/spend-alert/", {"spend_alert": "120", "action": "save"}, follow=True)
    assert b"The monthly spend alert is now $120.00." in page.content
    assert selectors.organization_limits(organization=organization)["spend_alert"] == Decimal("120")
    browser.post("/billing/spend-alert/", {"spend_alert": "120", "action": "remove"})
    assert selectors.organization_limits(organization=organization)["spend_alert"] is None
