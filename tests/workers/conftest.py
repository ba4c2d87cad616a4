"""A real fleet for the fleet tests: uvicorn, Celery beat (the placement loop) and Celery fleet
workers hosting the bundled model, all child processes on the test database and the test Redis,
with short heartbeats, ticks and visibility timeout so that a dead worker is noticed in seconds.

The fleet is module-scoped: the tests that need it live in one module, and the in-process tests of
this folder never run beside a live placement loop. Rows the servers must see are committed
outside pytest-django's per-test transactions (``django_db_blocker.unblock()``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import child_env
from tests.e2e.conftest import _answers, _stop
from tests.support import REPO_ROOT, free_port, wait_until

BUNDLED = "smollm2-135m-instruct"
for _noisy in ("httpx", "httpx2", "openai"):
    logging.getLogger(_noisy).setLevel(logging.WARNING)
FLEET_SETTINGS = {
    "FLEET_HEARTBEAT_SECONDS": "1",
    "FLEET_MISSED_HEARTBEATS": "4",
    "FLEET_TICK_SECONDS": "1",
    "FLEET_COLD_START_TIMEOUT": "150",
    "FLEET_SCALE_UP_QUEUE_DEPTH": "4",
    "OMP_NUM_THREADS": "1",  # two workers share the machine's cores: more threads spin against each other
    "CELERY_VISIBILITY_TIMEOUT": "20",
    "CELERY_UNACKED_RESTORE_INTERVAL": "1",
    "CELERY_UNACKED_RESTORE_THROTTLE": "1",
    "GATEWAY_QUEUE_TIMEOUT": "20",
    "GATEWAY_STALL_TIMEOUT": "150",
    "RATE_LIMIT_KEY_RPM": "100000",
    "RATE_LIMIT_ORG_RPM": "100000",
    "LOG_LEVEL": "WARNING",
}


@dataclass
class Fleet:
    env: dict
    base_url: str
    data_dir: Path
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    others: list[subprocess.Popen] = field(default_factory=list)

    def start_worker(self, label: str, *, slots: int = 2, queues: str = "default,billing") -> str:
        hostname = f"fleet-{label}-{uuid.uuid4().hex[:6]}@localhost"
        log = open(self.data_dir / f"{label}.log", "ab")
        self.workers[hostname] = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "inference_platform", "worker", "--pool", "threads",
             "--concurrency", "16", "--prefetch-multiplier", "1", "--queues", queues, "--hostname", hostname,
             "--loglevel", "WARNING", "--without-gossip", "--without-mingle"],
            cwd=REPO_ROOT, env={**self.env, "WORKER_SLOTS": str(slots)}, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        return hostname

    def kill(self, hostname: str) -> None:
        """SIGKILL: no shutdown handler runs, nothing is acknowledged or handed back."""
        proc = self.workers.pop(hostname)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in [*self.workers.values(), *self.others]:
            if proc.poll() is None:
                _stop(proc)


@pytest.fixture
def db_read(django_db_blocker):
    """Run a read (or a setup write) against the committed database, as the servers see it."""

    def read(fn):
        with django_db_blocker.unblock():
            return fn()

    return read


def _registered(db_read, hostname: str) -> bool:
    from workers.models import Worker

    return db_read(lambda: Worker.objects.filter(hostname=hostname, status="alive").exists())


@pytest.fixture(scope="module")
def fleet(django_db_setup, django_db_blocker, tmp_path_factory):
    """uvicorn + Celery beat + two fleet workers (2 slots each, both consuming default and billing)."""
    data_dir = tmp_path_factory.mktemp("fleet")
    models_root = data_dir / "models"
    models_root.mkdir()
    (models_root / "broken.gguf").write_bytes(b"GGUF but not really a model file")
    with django_db_blocker.unblock():
        from django.core.management import call_command

        from inference_platform import read_cache
        from models_catalog.models import Deployment
        from workers.models import Worker

        call_command("seed_catalog", verbosity=0)
        # The seeded public deployment is not what these tests place: keep it out of the slots.
        seeded = Deployment.objects.filter(name=BUNDLED).values("status", "min_replicas").first()
        Deployment.objects.filter(name=BUNDLED).update(status="scaled_to_zero", min_replicas=0)
        # Deployments other suites left in the database (a full run) would take the fleet's slots.
        leftovers = dict(Deployment.objects.exclude(name=BUNDLED).values_list("pk", "status"))
        Deployment.objects.filter(pk__in=leftovers).update(status="stopped")
        read_cache.invalidate()  # the gateway caches deployments; a queryset update sends no signal
        Worker.objects.all().delete()
    env = child_env(DATA_DIR=str(data_dir), MODELS_ROOT=str(models_root), **FLEET_SETTINGS)
    port = free_port()
    fleet = Fleet(env=env, base_url=f"http://127.0.0.1:{port}", data_dir=data_dir)
    with open(data_dir / "web.log", "ab") as log:
        fleet.others.append(subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "inference_platform.asgi:application", "--host", "127.0.0.1",
             "--port", str(port), "--no-access-log", "--lifespan", "off"],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    with open(data_dir / "beat.log", "ab") as log:
        fleet.others.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "inference_platform", "beat", "--loglevel", "WARNING",
             "--schedule", str(data_dir / "celerybeat-schedule")],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        names = [fleet.start_worker("alpha"), fleet.start_worker("beta")]

        def read(fn):
            with django_db_blocker.unblock():
                return fn()

        wait_until(lambda: _answers(f"{fleet.base_url}/healthz"), timeout=60, message="the ASGI server")
        for name in names:
            wait_until(lambda: _registered(read, name), timeout=90, message=f"{name} to register")
        yield fleet
    finally:
        fleet.stop()
        with django_db_blocker.unblock():
            Deployment.objects.filter(name=BUNDLED).update(**seeded)
            for pk, status in leftovers.items():
                Deployment.objects.filter(pk=pk).update(status=status)
            read_cache.invalidate()


@dataclass
class Tenant:
    organization_id: int
    api_key: str
    base_url: str

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {self.api_key}"}, timeout=60)


@pytest.fixture
def tenant(fleet, django_db_blocker) -> Tenant:
    from accounts import services

    tag = uuid.uuid4().hex[:10]
    with django_db_blocker.unblock():
        user = services.create_user(email=f"{tag}@example.com", password=None)
        org = services.create_organization(name=f"org-{tag}", owner=user)
        _, plaintext = services.create_api_key(organization=org, name="fleet", scopes=["inference", "manage", "read_usage"],
                                               created_by=user)
    return Tenant(organization_id=org.pk, api_key=plaintext, base_url=fleet.base_url)


@pytest.fixture
def deploy(tenant):
    """Create deployments through the API; each is deleted again at the end of the test."""
    created: list[str] = []
    client = tenant.api()

    def make(**settings) -> dict:
        name = settings.pop("name", f"fleet-{uuid.uuid4().hex[:8]}")
        body = {"name": name, "model": BUNDLED, "max_batch_size": 2, **settings}
        response = client.post("/v1/deployments", json=body)
        assert response.status_code == 201, response.text
        created.append(name)
        return response.json()

    yield make
    for name in created:
        client.delete(f"/v1/deployments/{name}")
    client.close()


def status_of(tenant: Tenant, name: str) -> str:
    with tenant.api() as client:
        return client.get(f"/v1/deployments/{name}").json()["status"]
