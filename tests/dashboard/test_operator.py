"""The fleet page (staff): every deployment, and the workers answering on the broker."""

from __future__ import annotations

from models_catalog.services import create_deployment


def test_the_fleet_lists_every_organizations_deployments(client, acme, globex, catalog):
    model, public = catalog
    user, _ = acme
    user.is_staff = True
    user.save()
    create_deployment(organization=globex[1], model=model, name="globex-secret")
    client.force_login(user)
    page = client.get("/operator/fleet/").content.decode()
    assert "globex-secret" in page and "Globex" in page and public.name in page


def test_the_workers_fragment_answers_without_workers(client, acme, settings):
    user, _ = acme
    user.is_staff = True
    user.save()
    client.force_login(user)
    response = client.get("/operator/fleet/_workers/")
    assert response.status_code == 200


def test_the_workers_fragment_shows_each_workers_device_and_kv_capacity(client, acme):
    from django.utils import timezone

    from workers.models import Worker

    user, _ = acme
    user.is_staff = True
    user.save()
    now = timezone.now()
    engines = {"a": {"engine": {"kv_capacity_tokens": 40960}}, "b": {"engine": {"kv_capacity_tokens": 8192}}}
    Worker.objects.create(hostname="gpu0@rack1", instance="i1", device_kind="cuda", device_name="NVIDIA H100",
                          device_memory_bytes=80 << 30, started_at=now, last_heartbeat=now, engine_stats=engines)
    client.force_login(user)
    page = client.get("/operator/fleet/_workers/").content.decode()
    row = page[page.index('data-worker="gpu0@rack1"'):]
    row = row[:row.index("</tr>")]
    assert "NVIDIA H100 (80 GiB)" in row and "49,152 tokens" in row


def test_the_workers_fragment_survives_a_broker_that_fails_and_shows_the_heartbeats(client, acme, monkeypatch):
    """A connection that died with a restarted Redis (or a frozen one, after its socket timeout)
    is a notice above the heartbeats, not a 500 every ten seconds."""
    from django.utils import timezone
    from redis.exceptions import ConnectionError as RedisConnectionError

    from dashboard import selectors
    from workers.models import Worker

    def broken_pipe(timeout):
        raise RedisConnectionError("Error 32 while writing to socket. Broken pipe.")

    monkeypatch.setattr(selectors, "_answering", broken_pipe)
    user, _ = acme
    user.is_staff = True
    user.save()
    now = timezone.now()
    Worker.objects.create(hostname="gpu1@rack1", instance="i9", device_kind="cuda", device_name="NVIDIA H100",
                          started_at=now, last_heartbeat=now)
    client.force_login(user)
    response = client.get("/operator/fleet/_workers/")
    page = response.content.decode()
    assert response.status_code == 200 and 'id="broker-error"' in page and "Broken pipe" in page
    assert 'data-worker="gpu1@rack1"' in page


def test_the_workers_fragment_shows_what_each_serves_and_its_heartbeat(client, acme, catalog):
    """A worker's replicas (loading ones marked) and how long ago it beat; a silent one, gone."""
    from datetime import timedelta

    from django.utils import timezone

    from workers.models import Replica, Worker

    user, _ = acme
    user.is_staff = True
    user.save()
    _, public = catalog
    now = timezone.now()
    serving = Worker.objects.create(hostname="cpu0@rack2", instance="i2", device_kind="cpu", device_name="cpu",
                                    started_at=now, last_heartbeat=now - timedelta(minutes=3), slots=2)
    Replica.objects.create(worker=serving, deployment=public, deployment_name=public.name, status="loading",
                           trigger="initial", assigned_at=now)
    Worker.objects.create(hostname="cpu1@rack2", instance="i3", device_kind="cpu", device_name="cpu",
                          started_at=now, last_heartbeat=now - timedelta(hours=2), status=Worker.Status.GONE)
    client.force_login(user)
    page = client.get("/operator/fleet/_workers/").content.decode()

    def row(name):
        part = page[page.index(f'data-worker="{name}"'):]
        return part[:part.index("</tr>")]

    assert f"{public.name} · loading" in row("cpu0@rack2") and "3\xa0minutes ago" in row("cpu0@rack2")
    assert "2 slots" in row("cpu0@rack2")
    assert "Gone" in row("cpu1@rack2") and "Idle" in row("cpu1@rack2")


def test_the_fleet_page_warns_of_usage_events_billing_refused(client, acme):
    from billing.services import keep_refused_event

    user, _ = acme
    user.is_staff = True
    user.save()
    client.force_login(user)
    assert 'id="refused-usage-events"' not in client.get("/operator/fleet/").content.decode()
    keep_refused_event(event={"request_id": "req-1"}, error="model: is required")
    keep_refused_event(event=["not", "an", "event"], error="not an object")
    page = client.get("/operator/fleet/").content.decode()
    assert "2 usage events could not be billed." in page and "replay_usage_events" in page
