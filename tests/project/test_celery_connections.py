"""Celery workers keep a few database connections between tasks, not one per thread."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from inference_platform import celery as celery_app

pytestmark = pytest.mark.django_db(transaction=True)


def test_only_a_few_threads_keep_their_connection(monkeypatch):
    monkeypatch.setattr(celery_app, "_keepers", set())
    count = celery_app.KEPT_CONNECTIONS + 2
    kept, done = [], threading.Barrier(count)

    def task_thread():  # a pool thread whose task used the database; all alive at once, as in a pool
        from django.db import connection as thread_connection

        thread_connection.ensure_connection()
        celery_app._recycle_connections(task=None)
        kept.append(thread_connection.connection is not None)
        done.wait(timeout=30)
        thread_connection.close()  # the test's own cleanup

    threads = [threading.Thread(target=task_thread) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(kept) == [False, False] + [True] * celery_app.KEPT_CONNECTIONS


def test_a_broken_connection_is_closed_after_the_task(monkeypatch):
    connection.ensure_connection()
    connection.errors_occurred = True
    monkeypatch.setattr(connection, "is_usable", lambda: False)
    celery_app._recycle_connections(task=None)
    assert connection.connection is None
