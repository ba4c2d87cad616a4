"""Fixtures for the whole suite: a real Celery worker process against the test database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from tests.support import REPO_ROOT, wait_until


def test_database_url() -> str:
    """A URL for the database pytest-django created, so child processes share it."""
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgresql://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


# Where the emails of the processes tests start go (one file per connection), for tests to read:
# whichever billing worker takes an email's task, its email lands here.
WORKER_MAIL = Path(settings.DATA_DIR) / f"worker-mail-{os.getpid()}"


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(DATABASE_URL=test_database_url(), REDIS_URL=settings.REDIS_URL, DJANGO_SETTINGS_MODULE="inference_platform.settings",
               EMAIL_BACKEND="django.core.mail.backends.filebased.EmailBackend", EMAIL_FILE_PATH=str(WORKER_MAIL))
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def _fresh_read_cache():
    """Each test starts with empty read caches: its rolled-back rows must not serve the next."""
    from inference_platform import read_cache

    read_cache.clear_local()


@pytest.fixture(scope="session")
def django_db_setup(django_test_environment, django_db_blocker):
    """Always create the test database, also for runs whose tests reach it only through child
    processes (pytest-django would otherwise create it only for tests marked django_db)."""
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        config = setup_databases(verbosity=0, interactive=False, aliases={"default"}, serialized_aliases=set())
    _forget_rate_limit_windows()
    yield
    with django_db_blocker.unblock():
        teardown_databases(config, verbosity=0)


def _forget_rate_limit_windows() -> None:
    """The new database numbers keys and organizations from 1 again: windows a run of a minute ago
    left in the suite's Redis under those ids are not this run's."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    for name in client.scan_iter("rl:*", count=1000):
        client.delete(name)


@pytest.fixture(scope="session")
def celery_worker(django_db_setup, django_db_blocker):
    """One real Celery worker (thread pool, prefetch 1) consuming the billing queue (not `default`,
    where the fleet tests' placement task travels)."""
    from inference_platform.readiness import check_workers

    name = f"test-worker-{os.getpid()}@localhost"
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "inference_platform", "worker", "--pool", "threads",
         "--concurrency", "4", "--prefetch-multiplier", "1", "--queues", "billing",
         "--hostname", name, "--loglevel", "WARNING", "--without-gossip", "--without-mingle"],
        cwd=REPO_ROOT, env=child_env(),
    )
    try:
        wait_until(
            lambda: name in check_workers(settings.CELERY_BROKER_URL, timeout=0.5).get("workers", []),
            timeout=60, message="the Celery worker to answer a ping",
        )
        yield name
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
