"""The embedded SQLite database, as the settings configure it, takes several writers at once:
transactions that read then write (billing's records, key touches) wait for each other instead of
failing with "database is locked"."""

from __future__ import annotations

import threading

from django.db import transaction
from django.db.utils import ConnectionHandler

from inference_platform.env import database_from_url

WRITERS, ROUNDS = 4, 40


def test_concurrent_read_then_write_transactions_all_commit(tmp_path, django_db_blocker, monkeypatch):
    handler = ConnectionHandler({"default": database_from_url("", data_dir=tmp_path)})
    monkeypatch.setattr(transaction, "connections", handler)  # atomic() on this database, not the tests' own
    errors: list[BaseException] = []
    start = threading.Barrier(WRITERS)

    def writer(n: int) -> None:
        connection = handler["default"]  # this thread's own connection
        try:
            start.wait()
            for i in range(ROUNDS):
                with transaction.atomic(using="default", savepoint=False), connection.cursor() as cursor:
                    cursor.execute("SELECT COUNT(*) FROM ledger")
                    cursor.execute("INSERT INTO ledger (writer, seen) VALUES (%s, %s)", [n, cursor.fetchone()[0]])
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    with django_db_blocker.unblock():
        with handler["default"].cursor() as cursor:
            cursor.execute("CREATE TABLE ledger (id INTEGER PRIMARY KEY, writer INTEGER, seen INTEGER)")
        handler["default"].close()
        threads = [threading.Thread(target=writer, args=(n,)) for n in range(WRITERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with handler["default"].cursor() as cursor:
            cursor.execute("SELECT COUNT(*), COUNT(DISTINCT seen), MAX(seen) FROM ledger")
            rows, distinct, highest = cursor.fetchone()
        handler["default"].close()
    assert errors == []
    # Serialized: each transaction saw every row committed before it.
    assert rows == distinct == WRITERS * ROUNDS and highest == rows - 1
