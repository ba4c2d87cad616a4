"""Checks that a dependency answers, each returning ``{"ok": bool, ...}`` and never raising.

Shared by ``/readyz`` and the command line's start-up checks, so both name a dead service the same
way (with its URL, never its password).
"""

from __future__ import annotations

import redis

from .env import redact_url


def check_database(connection) -> dict:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return {"ok": True, "vendor": connection.vendor}
    except Exception as exc:  # any driver error means "down"
        return {"ok": False, "error": one_line(exc)}


def check_redis(url: str, *, timeout: float = 1.0) -> dict:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        client.ping()
        return {"ok": True, "url": redact_url(url)}
    except Exception as exc:
        return {"ok": False, "url": redact_url(url), "error": one_line(exc)}
    finally:
        client.close()


def check_workers(broker_url: str, *, timeout: float = 1.0) -> dict:
    from .celery import app

    try:
        with app.connection_for_write(broker_url) as conn:
            # The first answer is enough: without a limit the ping waits out its whole timeout,
            # and /readyz took a second every time (more than a Kubernetes probe's default wait).
            replies = app.control.ping(timeout=timeout, connection=conn, limit=1)
    except Exception as exc:
        return {"ok": False, "error": one_line(exc)}
    workers = sorted(name for reply in replies for name in reply)
    if not workers:
        return {"ok": False, "workers": [], "error": f"no Celery worker answered a ping within {timeout:g}s"}
    return {"ok": True, "workers": workers}


def check_inference_workers() -> dict:
    """The workers sending the fleet's heartbeats (inference workers; a billing worker answers a
    ping but serves no model)."""
    from django.db import DatabaseError

    from workers.models import Worker

    try:
        alive = sorted(Worker.objects.filter(status=Worker.Status.ALIVE).values_list("hostname", flat=True))
    except DatabaseError as exc:
        return {"ok": False, "error": one_line(exc)}
    if not alive:
        return {"ok": False, "workers": [], "error": "no inference worker sends heartbeats: requests get a 503"}
    return {"ok": True, "workers": alive}


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
