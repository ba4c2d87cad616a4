"""Process-local caches of the rows every inference request reads (its API key, its deployment),
which a write in any process invalidates at once.

An ORM query costs a gateway about 2 ms of CPU, and each request needs two of them before it can
be dispatched: on a burst of requests that is most of the time the last one waits. So each
process keeps what it read, tagged with the *generation* current when it read it: a random token
in Redis that every write to those rows replaces (:func:`invalidate`, called by the owning apps'
services and signal receivers), right away and again once the write commits. A request reads the
generation once (one Redis GET) and uses entries of that generation only, so a revoked key fails
on its next request in every process. Entries are also dropped after ``MAX_AGE_S``, for rows
changed outside Django (raw SQL), which nothing reports. Without Redis nothing is cached.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Callable, Hashable, TypeVar

import redis
from django.conf import settings
from django.db import transaction

GENERATION_KEY = "read-cache:generation"
MAX_AGE_S = 60.0

log = logging.getLogger(__name__)
T = TypeVar("T")
_pinned = threading.local()
_client: redis.Redis | None = None
_caches: "weakref.WeakSet[ReadCache]" = weakref.WeakSet()


def _redis() -> redis.Redis:
    """One blocking client (a thread-safe pool) per process; not Django's cache, which builds a
    client object per call and costs more than the GET."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=2)
    return _client


_outage = {"down": False}  # so that an outage is logged once, not once per request


def _unreachable(exc: Exception, consequence: str) -> None:
    if not _outage["down"]:
        _outage["down"] = True
        log.warning("the read cache cannot reach Redis (%s: %s); %s",
                    type(exc).__name__, exc, consequence)


def _reachable() -> None:
    if _outage["down"]:
        _outage["down"] = False
        log.warning("the read cache reaches Redis again")


def _read_generation() -> bytes | None:
    try:
        value = _redis().get(GENERATION_KEY)
        if value is None:  # first use, or Redis was emptied: start a generation no entry can have
            _redis().set(GENERATION_KEY, secrets.token_hex(8), nx=True)
            value = _redis().get(GENERATION_KEY)
    except Exception as exc:  # Redis is down: read the database every time
        _unreachable(exc, "every read goes to the database until it is back")
        return None
    _reachable()
    return value


def generation() -> bytes | None:
    """The current generation (the pinned one inside :func:`pinned`); None: do not cache."""
    value = getattr(_pinned, "value", None)
    return value if value is not None else _read_generation()


@contextmanager
def pinned():
    """Within the block this thread reads the generation once: one request, one Redis read."""
    _pinned.value = _read_generation()
    try:
        yield
    finally:
        _pinned.value = None


def _bump() -> None:
    try:
        _redis().set(GENERATION_KEY, secrets.token_hex(8))
    except Exception as exc:
        _unreachable(exc, f"a change may take up to {MAX_AGE_S:.0f} s to reach the processes that cached the row")
        return
    _reachable()


def invalidate() -> None:
    """Make every process re-read cached rows: call after writing them. Bumps now (this
    transaction's own reads) and once the write commits (readers that re-read meanwhile saw the
    old row)."""
    _bump()
    transaction.on_commit(_bump)


class ReadCache:
    """``get(key, load)``: ``load()``'s value, read once per generation (what ``load`` raises is not
    cached). Safe across threads: an entry read under an older generation lands on a discarded shelf."""

    def __init__(self, *, max_entries: int = 10_000):
        self.max_entries = max_entries
        self._shelf: tuple[bytes | None, float, dict] = (None, 0.0, {})
        _caches.add(self)

    def clear(self) -> None:
        self._shelf = (None, 0.0, {})

    def get(self, key: Hashable, load: Callable[[], T]) -> T:
        current = generation()
        if current is None:
            return load()
        tag, born, entries = self._shelf
        if tag != current or time.monotonic() - born > MAX_AGE_S or len(entries) >= self.max_entries:
            entries = {}
            self._shelf = (current, time.monotonic(), entries)
        try:
            return entries[key]
        except KeyError:
            value = entries[key] = load()
            return value


def clear_local() -> None:
    """Empty this process's caches. A transaction that rolls back (every test does) bumps no
    generation, so what a thread read inside it could otherwise outlive it here."""
    for cache in list(_caches):
        cache.clear()


def invalidate_on_change(*models) -> None:
    """Invalidate whenever a row of ``models`` is saved or deleted through the ORM (an app's
    ``ready()``; a queryset ``update()`` sends no signal: its caller invalidates)."""
    from django.db.models.signals import post_delete, post_save

    for model in models:
        for signal in (post_save, post_delete):
            signal.connect(_changed, sender=model, weak=False, dispatch_uid=f"read-cache-{model._meta.label}-{id(signal)}")


def _changed(sender, **kwargs) -> None:
    invalidate()
