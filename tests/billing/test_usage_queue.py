"""Usage events through Redis and a real Celery billing worker: an event published by a producer
that dies before any billing worker runs is recorded exactly once when one starts; the same event
published again is not recorded twice.

The test uses its own Redis database as the broker so that no other worker (the suite's shared one
included) consumes its queue before it wants one to.
"""

from __future__ import annotations

import json
import os
import subprocess
import io
import sys

import pytest
import redis
from django.conf import settings

from celery import Celery

from billing import selectors
from billing.recovery import pending_events
from billing.dispatch import emit_usage_event, usage_task_id
from billing.errors import InvalidUsageEvent
from billing.models import LedgerEntry, UsageRecord
from tests.billing.conftest import make_catalog_model, make_organization, usage_event
from tests.e2e.conftest import _stop
from tests.conftest import child_env
from tests.support import REPO_ROOT, wait_until

PRODUCER = (
    "import json, sys, time\n"
    "from billing.dispatch import emit_usage_event\n"
    "emit_usage_event(json.loads(sys.argv[1]))\n"
    "print('published', flush=True)\n"
    "time.sleep(3600 if sys.argv[2] == 'hang' else 0)\n"
)


def broker_url() -> str:
    """A Redis database of its own, next but one to the suite's: two suites run at once on one Redis
    (each with its own database) do not share it."""
    base, db = settings.REDIS_URL.rsplit("/", 1)
    return f"{base}/{(int(db or 0) + 2) % 16}"


@pytest.fixture
def broker():
    url = broker_url()
    client = redis.Redis.from_url(url)
    keys = ["billing", "unacked", "unacked_index", "unacked_mutex", "_kombu.binding.billing"]
    client.delete(*keys)
    yield client
    client.delete(*keys)
    client.close()


def produce(event: dict, *, die: bool) -> None:
    """Publish from another process; with ``die`` the process is SIGKILLed right after publishing."""
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, json.dumps(event), "hang" if die else "exit"],
                            cwd=REPO_ROOT, env=child_env(REDIS_URL=broker_url()), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "published"
        if die:
            proc.kill()
        assert proc.wait(timeout=30) == (-9 if die else 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_billing_worker(**env) -> subprocess.Popen:
    # One thread: tasks run in the order they were published.
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "inference_platform", "worker", "--pool", "threads",
         "--concurrency", "1", "--prefetch-multiplier", "1", "--queues", "billing",
         "--hostname", f"billing-test-{os.getpid()}@localhost", "--loglevel", "WARNING",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=REPO_ROOT, env=child_env(REDIS_URL=broker_url(), **env),
    )


@pytest.mark.django_db(transaction=True)
def test_an_event_left_in_redis_by_a_dead_producer_is_recorded_exactly_once(broker):
    organization = make_organization("Queued")
    make_catalog_model()
    event = usage_event(organization, request_id="req-survives-its-worker")

    produce(event, die=True)
    assert broker.llen("billing") == 1  # the event waits in Redis; nobody consumes it yet
    assert pending_events(Celery(broker=broker_url())) == 1
    message = json.loads(broker.lindex("billing", 0))
    assert message["headers"]["id"] == usage_task_id(event["request_id"])
    assert not UsageRecord.objects.exists()

    worker = start_billing_worker()
    try:
        wait_until(lambda: UsageRecord.objects.filter(request_id=event["request_id"]).exists(), timeout=60,
                   message="the billing worker to record the event")
        # The same event again, then a sentinel: once the sentinel is recorded, the duplicate was handled.
        produce(event, die=False)
        sentinel = usage_event(organization, request_id="req-sentinel")
        produce(sentinel, die=False)
        wait_until(lambda: UsageRecord.objects.filter(request_id="req-sentinel").exists(), timeout=60,
                   message="the sentinel event")
    finally:
        _stop(worker)

    assert UsageRecord.objects.filter(request_id=event["request_id"]).count() == 1
    assert LedgerEntry.objects.filter(kind="usage", reference=event["request_id"]).count() == 1
    record = UsageRecord.objects.get(request_id=event["request_id"])
    sentinel_record = UsageRecord.objects.get(request_id="req-sentinel")
    assert selectors.balance(organization=organization) == \
        settings.BILLING_SIGNUP_CREDIT - record.cost - sentinel_record.cost
    assert broker.llen("billing") == 0


TAKER = (  # a billing worker's part up to its death: the event taken, not acknowledged
    "import sys, time\n"
    "from kombu import Connection\n"
    "with Connection(sys.argv[1]) as connection:\n"
    "    taken = connection.default_channel.basic_get('billing', no_ack=False)\n"
    "    print('taken' if taken else 'empty', flush=True)\n"
    "    time.sleep(3600)\n"
)


@pytest.mark.django_db(transaction=True)
def test_an_event_a_billing_worker_died_holding_is_recorded_when_the_next_one_starts(broker):
    """Not after the broker's visibility timeout (an hour here): at the next billing worker's start."""
    organization = make_organization("Orphaned")
    make_catalog_model()
    event = usage_event(organization, request_id="req-held-by-a-dead-worker")
    produce(event, die=False)
    taker = subprocess.Popen([sys.executable, "-c", TAKER, broker_url()], cwd=REPO_ROOT, env=child_env(),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert taker.stdout.readline().strip() == "taken"
    finally:
        taker.kill()
        taker.wait()
    assert broker.llen("billing") == 0 and broker.hlen("unacked") == 1

    app = Celery(broker=broker_url())
    assert pending_events(app) == 1  # held, not waiting: `up` still waits for it before stopping billing

    worker = start_billing_worker(CELERY_VISIBILITY_TIMEOUT="3600")
    try:
        wait_until(lambda: UsageRecord.objects.filter(request_id=event["request_id"]).exists(), timeout=60,
                   message="the new billing worker to record the event the dead one held")
        wait_until(lambda: pending_events(app) == 0, timeout=30, message="the redelivered copy's acknowledgement")
    finally:
        _stop(worker)
    assert UsageRecord.objects.filter(request_id=event["request_id"]).count() == 1


def test_a_malformed_event_is_refused_before_publishing():
    with pytest.raises(InvalidUsageEvent) as caught:
        emit_usage_event({"request_id": "req-bad"})
    assert caught.value.field == "organization_id"


def test_the_task_acks_late_and_retries_database_errors_with_backoff():
    from django.db import InterfaceError, OperationalError

    from billing.tasks import record_usage_event

    assert record_usage_event.acks_late and record_usage_event.reject_on_worker_lost
    assert {OperationalError, InterfaceError} <= set(record_usage_event.autoretry_for)
    assert record_usage_event.retry_backoff and record_usage_event.max_retries is None
    assert record_usage_event.name == "billing.tasks.record_usage_event"


@pytest.mark.django_db
def test_a_database_error_is_retried_and_then_recorded_once(monkeypatch):
    from django.db import OperationalError

    from billing import services
    from billing.tasks import record_usage_event

    organization = make_organization("Flaky")
    make_catalog_model()
    event = usage_event(organization)
    real, calls = services.record_usage, []

    def database_down_once(*, event):
        calls.append(event["request_id"])
        if len(calls) == 1:
            raise OperationalError("the database restarted")
        return real(event=event)

    monkeypatch.setattr(services, "record_usage", database_down_once)
    result = record_usage_event.apply(args=[event], task_id=usage_task_id(event["request_id"]))
    assert result.successful(), result.traceback
    assert len(calls) == 2
    assert UsageRecord.objects.filter(request_id=event["request_id"]).count() == 1


@pytest.mark.django_db
def test_a_permanently_bad_event_is_logged_not_retried(caplog):
    from billing.tasks import record_usage_event

    organization = make_organization("Unknown model")
    result = record_usage_event.apply(args=[usage_event(organization, model="no-such-model")])
    assert result.successful() and result.result is None
    assert "usage event refused" in caplog.text
    assert not UsageRecord.objects.exists()


@pytest.mark.django_db
def test_a_refused_event_is_kept_and_recorded_once_by_a_replay_after_its_cause_is_fixed():
    """It is money: an event naming a model the catalog lost is kept, and the operator's replay
    records it once the model is back, without charging twice when run again."""
    from django.core.management import call_command

    from billing.models import RefusedUsageEvent
    from billing.tasks import record_usage_event

    organization = make_organization("Lost model")
    event = usage_event(organization, model="tiny-llama")
    garbage = {"request_id": "req-garbage", "organization_id": "not a number", "queue_ms": float("nan")}
    for refused in (event, garbage):
        assert record_usage_event.apply(args=[refused]).result is None
    assert [(kept.request_id, "tiny-llama" in kept.error) for kept in RefusedUsageEvent.objects.all()] == [
        (event["request_id"], True), ("req-garbage", False)]

    make_catalog_model()  # the cause fixed: the model is back in the catalog
    said = io.StringIO()
    call_command("replay_usage_events", stdout=said)
    assert said.getvalue() == "1 recorded, 1 refused again (see --list for why; fix the cause and run this again).\n"
    assert UsageRecord.objects.get(request_id=event["request_id"]).cost > 0
    charged = LedgerEntry.objects.filter(reference=event["request_id"]).count()

    RefusedUsageEvent.objects.filter(request_id=event["request_id"]).update(replayed_at=None)  # replayed again
    call_command("replay_usage_events", stdout=io.StringIO())
    assert LedgerEntry.objects.filter(reference=event["request_id"]).count() == charged == 1
    listed = io.StringIO()
    call_command("replay_usage_events", "--list", stdout=listed)
    assert "req-garbage: model: is required" in listed.getvalue() and listed.getvalue().endswith("1 refused usage events waiting.\n")


@pytest.mark.django_db
def test_the_metrics_count_the_events_billing_has_not_recorded_and_those_it_refused(broker):
    """What an operator alerts on: a billing backlog, and events kept for a replay."""
    from billing.metrics import BillingCollector
    from billing.services import keep_refused_event

    def figures(collector) -> dict:
        return {family.name: [sample.value for sample in family.samples] for family in collector.collect()}

    collector = BillingCollector(celery_app=Celery(broker=broker_url()), redis_url=broker_url())
    assert figures(collector) == {"inference_billing_pending_events": [0], "inference_billing_refused_events": [0]}
    produce(usage_event(make_organization("Backlog")), die=False)
    keep_refused_event(event={"request_id": "req-x"}, error="model: is required")
    assert figures(collector) == {"inference_billing_pending_events": [1], "inference_billing_refused_events": [1]}
    unreachable = BillingCollector(celery_app=Celery(broker="redis://127.0.0.1:9/0"), redis_url="redis://127.0.0.1:9/0")
    assert figures(unreachable)["inference_billing_pending_events"] == []  # unknown, not 0


@pytest.mark.django_db
def test_the_metrics_count_the_billing_queue_on_a_unix_socket_redis():
    """The embedded Redis `up` starts: kombu spells its URL redis+socket://, a Redis client unix://."""
    import tempfile
    from pathlib import Path

    from billing.metrics import BillingCollector
    from inference_platform.env import celery_broker_url
    from inference_platform.processes import start_embedded_redis, stop_all

    with tempfile.TemporaryDirectory(prefix="ip-") as short:  # a unix socket path must stay short
        socket_path = Path(short) / "redis.sock"
        redis_proc = start_embedded_redis(socket_path, data_dir=Path(short))
        try:
            url = f"unix://{socket_path}"
            collector = BillingCollector(celery_app=Celery(broker=celery_broker_url(url)), redis_url=url)
            [pending] = [family for family in collector.collect() if family.name == "inference_billing_pending_events"]
            assert [sample.value for sample in pending.samples] == [0]
        finally:
            stop_all([redis_proc])
