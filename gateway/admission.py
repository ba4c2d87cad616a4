"""Where the gateway's blocking pre-dispatch work runs (the key, the deployment, the quota, the
rate-limit script, the publish): one trip per request.

By default a trip goes to the caller's thread, as Django's ``sync_to_async`` does. Under an ASGI
server that thread is new for every request, and so is its database connection: opening one costs
more than all of a request's queries (about 15 ms on PostgreSQL). The server process therefore
calls :func:`use_threads`: trips then run on a few long-lived threads that keep their
connections. In-process callers (the test client, inside a test's transaction) keep the default,
since another thread's connection would not see their uncommitted rows.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.db import connections

# A kept connection idle for longer than this is checked before use: the server may have closed it.
IDLE_CHECK_S = 30.0

_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()
_last_used = threading.local()


def use_threads(count: int = 4) -> None:
    """Run trips on ``count`` long-lived threads from now on (idempotent)."""
    global _executor
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix="gateway-admission")


async def run(fn, *args):
    """``fn(*args)`` on a thread (see the module's docstring); its exceptions propagate."""
    if _executor is None:
        return await sync_to_async(fn)(*args)
    return await asyncio.get_running_loop().run_in_executor(_executor, functools.partial(_trip, fn, *args))


def _trip(fn, *args):
    _check_idle_connections()
    try:
        return fn(*args)
    finally:
        _last_used.at = time.monotonic()
        for conn in connections.all(initialized_only=True):
            _keep_or_close(conn)


def _check_idle_connections() -> None:
    if time.monotonic() - getattr(_last_used, "at", 0.0) < IDLE_CHECK_S:
        return
    for conn in connections.all(initialized_only=True):
        if conn.connection is not None and not conn.is_usable():
            conn.close()


def _keep_or_close(conn) -> None:
    """Django's end-of-request check, without its age limit: these connections are meant to stay."""
    if conn.connection is not None and conn.errors_occurred:
        if conn.is_usable():
            conn.errors_occurred = False
        else:
            conn.close()
