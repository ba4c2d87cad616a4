"""Reserved capacity billed by the replica-minute: the meter reads the fleet's replicas (workers
registered and replicas loaded through the services, as worker processes would), keeps its place in
the real Redis, and hands its events to billing's own service, which records and charges them."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from billing import selectors as billing_selectors
from billing.models import LedgerEntry, UsageRecord
from billing.services import add_adjustment, record_usage
from models_catalog.models import CatalogModel, Deployment
from models_catalog.services import create_deployment
from tests.billing.conftest import make_key, make_organization
from workers import fleet, metering, services
from workers.models import Replica, Worker

pytestmark = pytest.mark.django_db

HOUR_PRICE = Decimal("1.800000")  # $0.0005 a replica-second
NOW = datetime(2026, 11, 29, 12, 0, 30, tzinfo=timezone.utc)
MINUTE_START = datetime(2026, 11, 29, 11, 59, tzinfo=timezone.utc)


@pytest.fixture(autouse=True)
def fresh_meter():
    fleet.client().delete(metering.METERED_UNTIL_KEY)
    Worker.objects.all().delete()
    yield
    fleet.client().delete(metering.METERED_UNTIL_KEY)


@pytest.fixture
def model():
    return CatalogModel.objects.create(slug=f"m-{uuid.uuid4().hex[:6]}", display_name="M", architecture="llama",
                                       weights_path="bundled:smollm2-135m-instruct", price_input_per_mtok=Decimal("0.1"),
                                       price_output_per_mtok=Decimal("0.2"), price_per_replica_hour=HOUR_PRICE)


@pytest.fixture
def organization():
    org = make_organization("Reserving")
    add_adjustment(organization=org, amount=Decimal("10"), description="credit")
    return org


def ready_replicas(deployment: Deployment, *ready_at: datetime) -> None:
    """One worker per replica, beating through the minutes metered, its replica of ``deployment``
    ready since the time given."""
    for at in ready_at:
        worker = services.register_worker(
            hostname=f"meter-{uuid.uuid4().hex[:8]}@nowhere", instance=uuid.uuid4().hex[:16], pid=1,
            device_kind="cuda", device_name="H100", device_memory_bytes=80 << 30, slots=1, queues=["default"])
        replica = services.place_replica(worker=worker, deployment=deployment, trigger=Replica.Trigger.MIN_REPLICAS,
                                         spec_hash="")
        Replica.objects.filter(pk=replica.pk).update(status=Replica.Status.READY, ready_at=at)
        Worker.objects.filter(pk=worker.pk).update(last_heartbeat=NOW + timedelta(hours=2))


def billed(deployment: Deployment) -> list[tuple[int, Decimal]]:
    return list(UsageRecord.objects.filter(deployment=deployment).order_by("created_at")
                .values_list("replica_seconds", "cost"))


def test_a_dedicated_deployment_pays_each_ready_replica_by_the_second_and_a_minute_once(organization, model):
    deployment = create_deployment(organization=organization, model=model, name=f"ded-{uuid.uuid4().hex[:6]}",
                                   kind="dedicated", min_replicas=1, max_replicas=3)
    # Two replicas up the whole minute, a third ready 45 s before its end; a fourth (still busy
    # after max_replicas came down from 4, say) is not billed: the longest up are.
    ready_replicas(deployment, NOW - timedelta(hours=1), NOW - timedelta(hours=1), MINUTE_START + timedelta(seconds=15),
                   MINUTE_START + timedelta(seconds=30))
    balance = billing_selectors.balance(organization=organization)

    minutes = metering.meter(now=NOW, emit=lambda event: record_usage(event=event))
    assert [(m.start, m.replica_seconds) for m in minutes] == [(MINUTE_START, 60 + 60 + 45)]
    record = UsageRecord.objects.get(deployment=deployment)
    assert (record.replica_seconds, record.cost, record.price_per_replica_hour) == (165, Decimal("0.082500"), HOUR_PRICE)
    assert (record.prompt_tokens, record.completion_tokens, record.endpoint) == (0, 0, "reserved capacity")
    assert LedgerEntry.objects.get(reference=record.request_id).amount == Decimal("-0.082500")

    # The same minute again (beat twice, or a second meter): nothing more, however it comes.
    assert metering.meter(now=NOW + timedelta(seconds=20), emit=lambda event: record_usage(event=event)) == []
    fleet.client().delete(metering.METERED_UNTIL_KEY)
    metering.meter(now=NOW, emit=lambda event: record_usage(event=event))
    assert billed(deployment) == [(165, Decimal("0.082500"))]
    assert billing_selectors.balance(organization=organization) == balance - Decimal("0.082500")


def test_a_minute_is_metered_once_it_has_settled_and_a_silent_worker_only_until_its_last_heartbeat(
        organization, model):
    deployment = create_deployment(organization=organization, model=model, name=f"ded-{uuid.uuid4().hex[:6]}",
                                   kind="dedicated", min_replicas=2, max_replicas=2)
    ready_replicas(deployment, NOW - timedelta(hours=1), NOW - timedelta(hours=1))
    silent = Replica.objects.filter(deployment=deployment).first()
    # Its worker's last heartbeat 20 s into the minute: held 5 s more (one interval), then no longer.
    Worker.objects.filter(pk=silent.worker_id).update(last_heartbeat=MINUTE_START + timedelta(seconds=20))
    # 10 s after the minute's end, a clock a little ahead could be early: the minute before it only.
    metering.meter(now=MINUTE_START + timedelta(seconds=70), emit=lambda event: record_usage(event=event))
    assert billed(deployment) == [(60 + 60, Decimal("0.060000"))]
    metering.meter(now=NOW, emit=lambda event: record_usage(event=event))
    assert billed(deployment)[1] == (60 + 25, Decimal("0.042500"))


def test_minutes_the_meter_missed_are_billed_when_it_runs_again(organization, model):
    deployment = create_deployment(organization=organization, model=model, name=f"ded-{uuid.uuid4().hex[:6]}",
                                   kind="dedicated", min_replicas=1)
    ready_replicas(deployment, MINUTE_START - timedelta(seconds=150))
    metering.meter(now=NOW - timedelta(minutes=3), emit=lambda event: record_usage(event=event))
    # Beat was down for three minutes: the next run bills them all, each minute once.
    metering.meter(now=NOW, emit=lambda event: record_usage(event=event))
    assert billed(deployment) == [(30, Decimal("0.015000")), (60, Decimal("0.030000")), (60, Decimal("0.030000")),
                                  (60, Decimal("0.030000"))]


def test_a_serverless_deployment_pays_for_its_minimum_replicas_only_and_its_tokens_as_always(organization, model):
    from gateway import calls
    from inference_platform import read_cache

    serverless = create_deployment(organization=organization, model=model, name=f"warm-{uuid.uuid4().hex[:6]}",
                                   min_replicas=1, max_replicas=3)
    dedicated = create_deployment(organization=organization, model=model, name=f"ded-{uuid.uuid4().hex[:6]}",
                                  kind="dedicated", min_replicas=1)
    ready_replicas(serverless, NOW - timedelta(hours=1), NOW - timedelta(hours=1), NOW - timedelta(hours=1))
    metering.meter(now=NOW, emit=lambda event: record_usage(event=event))
    assert billed(serverless) == [(60, Decimal("0.030000"))]  # the two above its minimum are paid by their tokens

    caller = calls.Caller(api_key=None, organization=organization)
    with read_cache.pinned():
        assert calls._deployment_spec(caller, serverless.name).prices["output_per_mtok"] == "0.200000"
        # A dedicated endpoint billed by the hour: its requests cost nothing more.
        assert set(calls._deployment_spec(caller, dedicated.name).prices.values()) == {"0"}


def test_the_operators_deployments_and_free_capacity_are_not_metered(organization, model):
    operators = create_deployment(organization=None, model=model, name=f"op-{uuid.uuid4().hex[:6]}",
                                  kind="dedicated", min_replicas=1)
    free_model = CatalogModel.objects.create(slug=f"free-{uuid.uuid4().hex[:6]}", display_name="F",
                                             architecture="llama", weights_path="bundled:f")
    free = create_deployment(organization=organization, model=free_model, name=f"free-{uuid.uuid4().hex[:6]}",
                             kind="dedicated", min_replicas=1)
    ready_replicas(operators, NOW - timedelta(hours=1))
    ready_replicas(free, NOW - timedelta(hours=1))
    assert metering.meter(now=NOW, emit=lambda event: record_usage(event=event)) == []
    # A replica still loading, or on a worker that went silent, holds nothing billable either.
    paid = create_deployment(organization=organization, model=model, name=f"ded-{uuid.uuid4().hex[:6]}",
                             kind="dedicated", min_replicas=2, max_replicas=2)
    ready_replicas(paid, NOW - timedelta(hours=1), NOW - timedelta(hours=1))
    first, second = Replica.objects.filter(deployment=paid)
    Replica.objects.filter(pk=first.pk).update(status=Replica.Status.LOADING, ready_at=None)
    Worker.objects.filter(pk=second.worker_id).update(status=Worker.Status.GONE)
    assert metering.meter(now=NOW + timedelta(minutes=1), emit=lambda event: record_usage(event=event)) == []


def test_reserved_capacity_stops_when_the_credit_is_gone_and_says_why(organization, model, monkeypatch, mailoutbox):
    from billing import alert_mail, reserved_capacity

    queued = []
    monkeypatch.setattr(alert_mail, "queue", lambda task, *args: queued.append((task, args)) or True)
    deployment = create_deployment(organization=organization, model=model, name=f"ded-{uuid.uuid4().hex[:6]}",
                                   kind="dedicated", min_replicas=1)
    ready_replicas(deployment, NOW - timedelta(hours=1))
    left = billing_selectors.balance(organization=organization)
    add_adjustment(organization=organization, amount=Decimal("0.05") - left, description="spent")  # 5 cents left
    metering.meter(now=NOW, emit=lambda event: record_usage(event=event))  # a minute: 3 cents
    deployment.refresh_from_db()
    assert deployment.status != Deployment.Status.STOPPED
    metering.meter(now=NOW + timedelta(minutes=1), emit=lambda event: record_usage(event=event))
    deployment.refresh_from_db()
    assert billing_selectors.balance(organization=organization) < 0
    assert deployment.status == Deployment.Status.STOPPED
    assert "billed by the hour" in deployment.status_reason and "credit balance" in deployment.status_reason
    # Its owners hear of it once, by email from the billing queue's task.
    [(task, (organization_id, names, refusal))] = queued
    assert task == reserved_capacity.SEND_TASK and names == [deployment.name]
    assert reserved_capacity.send_email(organization_id=organization_id, names=names, refusal=refusal) == 1
    [email] = mailoutbox
    assert deployment.name in email.subject and "credit balance" in email.body and "starts them again" in email.body
    metering.meter(now=NOW + timedelta(minutes=2), emit=lambda event: record_usage(event=event))
    assert len(queued) == 1


def test_the_usage_report_counts_reserved_capacity_apart_from_requests(organization, model):
    from dashboard import selectors as dashboard_selectors

    deployment = create_deployment(organization=organization, model=model, name=f"ded-{uuid.uuid4().hex[:6]}",
                                   kind="dedicated", min_replicas=1)
    ready_replicas(deployment, NOW - timedelta(hours=1))
    metering.meter(now=NOW, emit=lambda event: record_usage(event=event))
    # Not a request: the deployments list counts none, the getting-started list still waits for one.
    assert dashboard_selectors.deployments_page(organization=organization)["own"][0].requests_24h == 0
    assert dashboard_selectors.overview(organization=organization)["has_usage"] is False
    entry = LedgerEntry.objects.get(organization=organization, kind=LedgerEntry.Kind.USAGE)
    assert entry.description == f"Reserved capacity: {deployment.name}, 60 replica-seconds"
    day = MINUTE_START.date()
    report = billing_selectors.usage_report(organization=organization, start=day, end=day, group_by="endpoint")
    assert report["totals"]["requests"] == 0 and report["totals"]["replica_seconds"] == 60
    assert [(b["key"], b["replica_seconds"], b["cost"]) for b in report["buckets"]] == [
        ("reserved capacity", 60, Decimal("0.030000"))]
    # No key reserved it: the by-key report (whose keyless bucket is the dashboard's) leaves it out.
    by_key = billing_selectors.usage_report(organization=organization, start=day, end=day, group_by="api_key")
    assert by_key["buckets"] == []


def test_an_organization_that_cannot_pay_reserves_no_billed_replica(organization, model, client):
    from models_catalog.errors import InvalidDeployment
    from models_catalog.services import (change_deployment_settings, set_deployment_status, start_deployment,
                                         stop_deployment, update_deployment)

    serverless = create_deployment(organization=organization, model=model, name=f"warm-{uuid.uuid4().hex[:6]}")
    dedicated = create_deployment(organization=organization, model=model, name=f"ded-{uuid.uuid4().hex[:6]}",
                                  kind="dedicated", min_replicas=1)
    stop_deployment(deployment=dedicated, reason="paused")
    failed = create_deployment(organization=organization, model=model, name=f"f-{uuid.uuid4().hex[:6]}",
                               kind="dedicated")
    set_deployment_status(deployment=failed, status=Deployment.Status.FAILED, reason="the load failed")
    left = billing_selectors.balance(organization=organization)
    add_adjustment(organization=organization, amount=-left, description="spent")  # nothing left
    for attempt in (
        lambda: create_deployment(organization=organization, model=model, name="more", kind="dedicated"),
        lambda: update_deployment(deployment=serverless, min_replicas=1),
        lambda: start_deployment(deployment=dedicated, reason="again"),
        # A failed one is tried again when its settings change: not while nothing pays for it.
        lambda: change_deployment_settings(deployment=failed, batch_window_ms=5),
    ):
        with pytest.raises(InvalidDeployment, match="billed by the hour.*cannot pay for them now"):
            attempt()
    # What reserves nothing billed goes on: a serverless deployment that scales to zero, a change
    # to a stopped one, a model without an hourly price.
    update_deployment(deployment=serverless, max_replicas=2)
    update_deployment(deployment=dedicated, max_replicas=2)
    free_model = CatalogModel.objects.create(slug=f"free-{uuid.uuid4().hex[:6]}", display_name="F",
                                             architecture="llama", weights_path="bundled:f")
    create_deployment(organization=organization, model=free_model, name=f"free-{uuid.uuid4().hex[:6]}",
                      kind="dedicated")
    # Through the API: a 400 naming the setting, in OpenAI's shape.
    _, key = make_key(organization, scopes=("manage",))
    response = client.post(f"/v1/deployments/{dedicated.name}/start", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "kind" and "cannot pay" in response.json()["error"]["message"]
    # In the dashboard: the deployment's page says why.
    from accounts.models import Membership

    client.force_login(Membership.objects.get(organization=organization, role="owner").user)
    page = client.post(f"/deployments/{dedicated.name}/start/", follow=True).content.decode()
    assert "cannot pay for them now" in page
    dedicated.refresh_from_db()
    failed.refresh_from_db()
    assert (dedicated.status, failed.status) == (Deployment.Status.STOPPED, Deployment.Status.FAILED)
