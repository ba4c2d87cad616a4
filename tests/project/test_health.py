"""/healthz and /readyz against the real database, Redis and a real Celery worker."""

from __future__ import annotations

import pytest
from django.test import override_settings

from tests.support import free_port

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_dependencies(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert client.head("/healthz").status_code == 200  # load balancers probe with HEAD too
    assert client.post("/healthz").status_code == 405


def test_readyz_is_ok_with_database_redis_and_a_worker(client, celery_worker, monkeypatch):
    from inference_platform.celery import app

    pings, ping = [], app.control.ping

    def recorded(*args, **kwargs):  # the real ping, its arguments noted
        pings.append(kwargs)
        return ping(*args, **kwargs)

    monkeypatch.setattr(app.control, "ping", recorded)
    response = client.get("/readyz")
    body = response.json()
    assert response.status_code == 200, body
    assert body["down"] == []
    assert body["checks"]["database"]["ok"] and body["checks"]["redis"]["ok"]
    assert body["checks"]["worker"]["workers"]  # the first to answer (other test workers may share the broker)
    # It stops at the first answer: without a limit a ping waits out its whole timeout, and
    # /readyz took longer than a Kubernetes probe waits by default.
    assert [p.get("limit") for p in pings] == [1]


def test_readyz_names_redis_when_it_is_down(client):
    closed = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    with override_settings(REDIS_URL=closed, CELERY_BROKER_URL=closed):
        response = client.get("/readyz")
    body = response.json()
    assert response.status_code == 503
    assert "redis" in body["down"] and "database" not in body["down"]
    assert "s3cret" not in response.content.decode()


def test_readyz_names_the_worker_when_none_runs(client, settings):
    # A Redis database no worker listens on: Redis answers, nobody answers the ping.
    empty = settings.REDIS_URL.rsplit("/", 1)[0] + "/13"
    with override_settings(CELERY_BROKER_URL=empty, READYZ_WORKER_TIMEOUT=0.3):
        response = client.get("/readyz")
    body = response.json()
    assert response.status_code == 503
    assert body["down"] == ["worker"]
    assert "no Celery worker" in body["checks"]["worker"]["error"]


def test_database_check_reports_a_closed_port_with_a_real_driver_error():
    from django.db.utils import ConnectionHandler

    from inference_platform.readiness import check_database

    handler = ConnectionHandler(
        {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "x", "USER": "postgres",
                     "HOST": "127.0.0.1", "PORT": str(free_port()), "OPTIONS": {"connect_timeout": 2}}}
    )
    result = check_database(handler["default"])
    assert result["ok"] is False
    assert "OperationalError" in result["error"]


def test_readyz_says_whether_an_inference_worker_is_alive_without_failing_on_none(client, celery_worker):
    """A billing worker answers the ping; only the fleet's heartbeats say a model can be served."""
    from django.utils import timezone

    from workers.models import Worker

    Worker.objects.all().delete()
    body = client.get("/readyz").json()
    assert body["down"] == [] and body["inference"]["ok"] is False and "503" in body["inference"]["error"]
    now = timezone.now()
    Worker.objects.create(hostname="gpu0@rack1", instance="i1", device_kind="cuda", started_at=now,
                          last_heartbeat=now)
    Worker.objects.create(hostname="gpu1@rack1", instance="i2", device_kind="cuda", started_at=now,
                          last_heartbeat=now, status=Worker.Status.GONE)
    body = client.get("/readyz").json()
    assert body["inference"] == {"ok": True, "workers": ["gpu0@rack1"]}
