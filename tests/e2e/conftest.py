"""The real stack for end-to-end tests: an ASGI server (uvicorn) and a Celery GPU-style worker
hosting the bundled model, both child processes on the test database and the test Redis.

Rows the servers must see are committed outside pytest-django's per-test transactions
(``django_db_blocker.unblock()``), and re-made per test, since transactional tests elsewhere
empty the tables between tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
import uuid
from dataclasses import dataclass

import pytest

from tests.conftest import child_env
from tests.support import REPO_ROOT, free_port, wait_until

DEPLOYMENT = "smollm2-135m-instruct"


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def server_env(django_db_setup, django_db_blocker, tmp_path_factory):
    """Settings both child processes share: the test database, short gateway timeouts."""
    with django_db_blocker.unblock():
        from django.core.management import call_command

        call_command("seed_catalog", verbosity=0)
    return child_env(
        GATEWAY_QUEUE_TIMEOUT="6", DATA_DIR=str(tmp_path_factory.mktemp("data")),
        RATE_LIMIT_KEY_RPM="100000", RATE_LIMIT_ORG_RPM="100000",
    )


@pytest.fixture(scope="session")
def asgi_server(server_env):
    """uvicorn serving inference_platform.asgi on a free port; yields its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "inference_platform.asgi:application", "--host", "127.0.0.1",
         "--port", str(port), "--no-access-log", "--lifespan", "off"],
        cwd=REPO_ROOT, env=server_env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or _answers(f"{base}/healthz"), timeout=60,
                   message="the ASGI server")
        assert proc.poll() is None, "the ASGI server exited"
        yield base
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def inference_worker(server_env, django_db_blocker):
    """One Celery worker serving the bundled model's deployment in float32 (exact comparisons).
    It does not consume the `default` queue: the fleet's placement task travels there, and it must
    run only on the fleet tests' own processes (their settings), not on this one."""
    with django_db_blocker.unblock():
        from inference_platform import read_cache
        from models_catalog.models import Deployment

        Deployment.objects.filter(name=DEPLOYMENT).update(dtype="float32")
        read_cache.invalidate()  # the gateway caches deployments; a queryset update sends no signal
    name = f"e2e-{uuid.uuid4().hex[:8]}@localhost"
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "inference_platform", "worker", "--pool", "threads",
         "--concurrency", "48", "--prefetch-multiplier", "1", "--queues", f"billing,batches,deployment.{DEPLOYMENT}",
         "--hostname", name, "--loglevel", "WARNING", "--without-gossip", "--without-mingle"],
        cwd=REPO_ROOT, env={**server_env, "INFERENCE_PRELOAD": DEPLOYMENT},
    )
    try:
        from django.conf import settings

        from inference_platform.readiness import check_workers

        wait_until(lambda: name in check_workers(settings.CELERY_BROKER_URL, timeout=0.5).get("workers", []),
                   timeout=90, message="the inference worker to answer a ping")
        yield name
    finally:
        _stop(proc)


@dataclass
class Tenant:
    organization_id: int
    api_key: str
    api_key_id: int
    base_url: str


@pytest.fixture
def make_tenant(asgi_server, django_db_blocker):
    """A new organization with an API key (committed, so the servers see it)."""

    def make(scopes=("inference", "read_usage", "manage")) -> Tenant:
        from accounts import services

        tag = uuid.uuid4().hex[:10]
        with django_db_blocker.unblock():
            from django.core.management import call_command

            call_command("seed_catalog", verbosity=0)
            user = services.create_user(email=f"{tag}@example.com", password=None)
            org = services.create_organization(name=f"org-{tag}", owner=user)
            key, plaintext = services.create_api_key(organization=org, name="e2e", scopes=list(scopes), created_by=user)
        return Tenant(organization_id=org.pk, api_key=plaintext, api_key_id=key.pk, base_url=asgi_server)

    return make


@pytest.fixture
def tenant(make_tenant, inference_worker) -> Tenant:
    return make_tenant()


@pytest.fixture
def openai_client(tenant):
    import openai

    return openai.OpenAI(base_url=f"{tenant.base_url}/v1", api_key=tenant.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def reference_engine():
    """The engine in this process, float32, for 'the same greedy output' comparisons."""
    from workers.engine import Engine, bundled_model_path

    engine = Engine(bundled_model_path(), dtype="float32", max_batch_size=8).start()
    yield engine
    engine.stop()


@pytest.fixture
def db_read(django_db_blocker):
    """Run a read against the committed database (what the servers wrote)."""

    def read(fn):
        with django_db_blocker.unblock():
            return fn()

    return read
