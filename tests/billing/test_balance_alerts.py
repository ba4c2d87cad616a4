"""Low-balance alerts: owners and admins are emailed once when the balance falls below the alert
the organization set (``PUT /v1/billing/limits {"balance_alert": ...}`` or the billing page), and
again only after it is back up and falls once more. Charges record whatever the alert meets."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from django.core import mail
from django.test import Client

from accounts.services import add_member, create_user
from billing import balance_alerts, selectors, services
from billing.models import SpendLimit
from tests.billing.conftest import make_catalog_model, make_key, make_organization, usage_event
from tests.conftest import WORKER_MAIL
from tests.support import wait_until

LIMITS = "/v1/billing/limits"
# usage_event's defaults at the catalog's sample prices: 800 + 200 cached + 500 out, and the request.
CHARGE = Decimal("0.000120") + Decimal("0.000015") + Decimal("0.000300") + Decimal("0.000100")


@pytest.fixture
def queued(monkeypatch):
    """The organizations whose alert email was queued (the queue itself is the e2e test's)."""
    sent: list[int] = []

    def send_task(name, args, **options):
        assert name == balance_alerts.SEND_TASK and options["queue"] == "billing"
        sent.extend(args)

    monkeypatch.setattr("inference_platform.celery.app.send_task", send_task)
    return sent


def charge(organization, times: int = 1) -> None:
    for _ in range(times):
        services.record_usage(event=usage_event(organization))


def credit(organization, amount: str) -> None:
    services.add_adjustment(organization=organization, amount=Decimal(amount), description="test credit")


@pytest.fixture
def funded(db):
    """An organization with $0.002 of credit (about three charges) and the sample model."""
    make_catalog_model()
    organization = make_organization("Acme")
    credit(organization, str(Decimal("0.002") - selectors.balance(organization=organization)))  # (a sign-up credit)
    return organization


@pytest.mark.django_db(transaction=True)
def test_falling_below_the_alert_queues_one_email_until_the_balance_is_back_up(funded, queued):
    services.set_balance_alert(organization=funded, amount=Decimal("0.001"))
    charge(funded)  # 0.002 - 0.000535: still above
    assert queued == []
    charge(funded, times=3)  # below after the second, and on below
    assert queued == [funded.pk]
    assert SpendLimit.objects.get(organization=funded).balance_alert_sent_at is not None
    credit(funded, "0.01")  # back up: armed again
    assert SpendLimit.objects.get(organization=funded).balance_alert_sent_at is None
    charge(funded)
    assert queued == [funded.pk]
    credit(funded, "-0.0105")  # an operator's debit takes it below again
    assert queued == [funded.pk, funded.pk]


@pytest.mark.django_db(transaction=True)
def test_an_alert_set_below_the_balance_is_sent_at_once_and_removing_it_sends_nothing(funded, queued):
    services.set_balance_alert(organization=funded, amount=Decimal("5"))
    assert queued == [funded.pk]
    services.set_balance_alert(organization=funded, amount=Decimal("5.000"))  # saved again: the same alert
    assert queued == [funded.pk]
    services.set_balance_alert(organization=funded, amount=None)
    charge(funded, times=2)
    assert queued == [funded.pk]
    assert selectors.organization_limits(organization=funded)["balance_alert"] is None


@pytest.mark.django_db(transaction=True)
def test_a_stale_read_never_rearms_an_alert_claimed_since(funded, queued, monkeypatch):
    """A top-up's look at the alert reads the balance above it, while a charge takes it below and
    claims the alert again: the top-up's re-arm must not undo that claim (the next charge would
    send a second email for one fall)."""
    from datetime import timedelta

    from django.utils import timezone

    services.set_balance_alert(organization=funded, amount=Decimal("0.001"))
    earlier = timezone.now() - timedelta(hours=1)
    SpendLimit.objects.filter(organization=funded).update(balance_alert_sent_at=earlier)  # sent for a past fall
    claimed_now = timezone.now()

    def balance_read_while_a_charge_claims(organization_id):
        SpendLimit.objects.filter(organization=funded).update(balance_alert_sent_at=claimed_now)
        return Decimal("25")  # what the top-up's hook read, before that charge

    monkeypatch.setattr(balance_alerts, "_balance", balance_read_while_a_charge_claims)
    balance_alerts.balance_changed(organization_id=funded.pk)
    assert SpendLimit.objects.get(organization=funded).balance_alert_sent_at == claimed_now


@pytest.mark.django_db(transaction=True)
def test_a_broker_down_rearms_the_alert_and_the_charge_is_recorded(funded, monkeypatch):
    def down(*args, **kwargs):
        raise ConnectionError("the broker is down")

    monkeypatch.setattr("inference_platform.celery.app.send_task", down)
    services.set_balance_alert(organization=funded, amount=Decimal("0.0019"))
    record = services.record_usage(event=usage_event(funded))
    assert record.pk and selectors.balance(organization=funded) == Decimal("0.002") - CHARGE
    assert SpendLimit.objects.get(organization=funded).balance_alert_sent_at is None  # the next charge tries again


@pytest.mark.django_db
def test_the_email_goes_to_active_owners_and_admins_with_the_figures(settings, funded):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.SITE_URL = "https://llm.example.com"
    admin = create_user(email="admin@example.com", password=None, validate=False)
    member = create_user(email="member@example.com", password=None, validate=False)
    gone = create_user(email="gone@example.com", password=None, validate=False)
    add_member(organization=funded, user=admin, role="admin")
    add_member(organization=funded, user=member, role="member")
    add_member(organization=funded, user=gone, role="admin")
    gone.is_active = False
    gone.save()
    SpendLimit.objects.create(organization=funded, balance_alert=Decimal("10"))
    assert balance_alerts.send_email(organization_id=funded.pk) == 2
    [email] = mail.outbox
    owner = funded.memberships.get(role="owner").user.email
    assert sorted(email.to) == sorted(["admin@example.com", owner])
    assert email.subject == "Acme: credit balance below $10.00"
    assert "is $0.002, below the $10.00 alert" in email.body and "https://llm.example.com/billing/" in email.body
    # Topped up before the queue got to it: nothing to say.
    credit(funded, "20")
    assert balance_alerts.send_email(organization_id=funded.pk) == 0 and len(mail.outbox) == 1
    # Without SITE_URL, the link goes to `up`'s own address (OWN_SITE_URL).
    settings.SITE_URL, settings.OWN_SITE_URL = "", "http://127.0.0.1:8000"
    SpendLimit.objects.filter(organization=funded).update(balance_alert=Decimal("100"), balance_alert_sent_at=None)
    assert balance_alerts.send_email(organization_id=funded.pk) == 2
    assert "http://127.0.0.1:8000/billing/" in mail.outbox[-1].body


@pytest.mark.parametrize("amount, text", [
    (Decimal("10"), "$10.00"), (Decimal("1234.5"), "$1,234.50"), (Decimal("-0.31"), "-$0.31"),
    (Decimal("0.000125"), "$0.000125"), (Decimal("0"), "$0.00"),
])
def test_dollars_are_written_exactly(amount, text):
    assert balance_alerts.dollars(amount) == text


# --- the API and the billing page ---------------------------------------------------------------------


@pytest.mark.django_db
def test_the_api_sets_reads_and_removes_the_alert_beside_the_limit(client, queued):
    organization = make_organization("Acme")
    _, manager = make_key(organization, scopes=["manage"])
    _, reader = make_key(organization, scopes=["read_usage"])

    def put(body, key=manager):
        return client.generic("PUT", LIMITS, json.dumps(body), content_type="application/json",
                              headers={"Authorization": f"Bearer {key}"})

    response = put({"balance_alert": "10.50"})
    assert response.status_code == 200, response.content
    assert response.json()["balance_alert"] == "10.500000" and response.json()["monthly_limit"] is None
    put({"monthly_limit": "100"})  # one left out stays as it is
    read = client.get(LIMITS, headers={"Authorization": f"Bearer {reader}"}).json()
    assert (read["balance_alert"], read["monthly_limit"]) == ("10.500000", "100.000000")
    assert put({"balance_alert": None}).json()["balance_alert"] is None
    for bad in ({"balance_alert": 5}, {"balance_alert": "-1"}, {"balance_alert": "1.0000001"}):
        error = put(bad).json()["error"]
        assert error["param"] == "balance_alert", error
    assert put({"balance_alert": "1"}, key=reader).status_code == 403
    # Both or neither: a refused alert leaves the limit as it was (the limit is set first).
    response = put({"monthly_limit": "5", "balance_alert": "1.0000001"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "balance_alert"
    assert selectors.organization_monthly_limit(organization=organization) == Decimal("100")


@pytest.mark.django_db
def test_the_billing_page_sets_the_alert_for_owners_and_admins_only(queued):
    organization = make_organization("Acme")
    owner = organization.memberships.get(role="owner").user
    browser = Client()
    browser.force_login(owner)
    page = browser.get("/billing/")
    assert b'id="balance-alert-form"' in page.content
    response = browser.post("/billing/alert/", {"balance_alert": "2.5", "action": "save"}, follow=True)
    assert b"The low-balance alert is now $2.50." in response.content
    assert selectors.organization_limits(organization=organization)["balance_alert"] == Decimal("2.5")
    response = browser.post("/billing/alert/", {"balance_alert": "two"})
    assert response.status_code == 400 and b"Enter the alert in US dollars" in response.content
    browser.post("/billing/alert/", {"balance_alert": "2.5", "action": "remove"})
    assert selectors.organization_limits(organization=organization)["balance_alert"] is None

    member = create_user(email="member@example.com", password=None, validate=False)
    add_member(organization=organization, user=member, role="member")
    browser.force_login(member)
    assert b'id="balance-alert-form"' not in browser.get("/billing/").content
    assert browser.post("/billing/alert/", {"balance_alert": "1"}).status_code == 403
    assert selectors.organization_limits(organization=organization)["balance_alert"] is None


# --- through the queue --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_billing_worker_emails_the_alert(funded, celery_worker):
    """The real path: a charge below the alert, the task on the billing queue, the worker's email."""
    before = set(WORKER_MAIL.glob("*")) if WORKER_MAIL.exists() else set()
    services.set_balance_alert(organization=funded, amount=Decimal("0.0019"))
    charge(funded)

    def sent() -> list[str]:
        return [path.read_text() for path in set(WORKER_MAIL.glob("*")) - before] if WORKER_MAIL.exists() else []

    wait_until(lambda: any("Acme: credit balance below $0.0019" in text for text in sent()), timeout=30,
               message="the worker to email the alert")
