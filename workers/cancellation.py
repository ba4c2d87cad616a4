"""Cancelling a request from any gateway process, wherever its worker is.

The gateway marks the request cancelled in Redis (a key with a TTL, for a task not yet picked up)
and publishes its id; every worker process listens on one pub/sub channel and aborts the request
if its engine runs it.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import redis
from django.conf import settings

CHANNEL = "inference:cancel"
MARK_TTL_S = 3600
# The mark of a cancel that is the gateway giving up (a timeout, Redis failing), not its client: a
# client waiting for the whole answer got an error instead, and pays nothing (``workers.inference``).
VOID = "void"
log = logging.getLogger(__name__)


def mark_key(request_id: str) -> str:
    return f"inference:cancelled:{request_id}"


def mark_value(*, void: bool) -> str:
    return VOID if void else "1"


def request_cancel(client: redis.Redis, request_id: str, *, void: bool = False) -> None:
    """Sync form of ``workers.dispatch.cancel``, for a thread or tests."""
    client.set(mark_key(request_id), mark_value(void=void), ex=MARK_TTL_S)
    client.publish(CHANNEL, request_id)


class CancelListener:
    """One pub/sub subscription per worker process, dispatching to the requests it runs."""

    def __init__(self, url: str | None = None):
        self._redis = redis.Redis.from_url(url or settings.REDIS_URL)
        self._callbacks: dict[str, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._listen, name="cancel-listener", daemon=True)
        self._thread.start()

    def is_cancelled(self, request_id: str) -> bool:
        return bool(self._redis.exists(mark_key(request_id)))

    def is_void(self, request_id: str) -> bool:
        """Whether the request's cancel was the gateway giving up rather than its client."""
        return self._redis.get(mark_key(request_id)) == VOID.encode()

    def watch(self, request_id: str, on_cancel: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks[request_id] = on_cancel
        if self.is_cancelled(request_id):  # cancelled between the first check and now
            on_cancel()

    def unwatch(self, request_id: str) -> None:
        with self._lock:
            self._callbacks.pop(request_id, None)

    def _catch_up(self) -> None:
        """Abort the watched requests whose mark is set: cancels published while this listener
        was not subscribed (pub/sub delivers to those listening, once) left their marks."""
        with self._lock:
            watched = list(self._callbacks.items())
        if not watched:
            return
        pipe = self._redis.pipeline(transaction=False)
        for request_id, _ in watched:
            pipe.exists(mark_key(request_id))
        for (_, callback), marked in zip(watched, pipe.execute()):
            if marked:
                callback()

    def _listen(self) -> None:
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(CHANNEL)
                self._catch_up()  # after subscribing: no cancel falls between the two
                for message in pubsub.listen():
                    request_id = message["data"].decode()
                    with self._lock:
                        callback = self._callbacks.get(request_id)
                    if callback:
                        callback()
            except redis.RedisError as exc:  # Redis restarted: resubscribe after a pause
                log.warning("cancel listener lost Redis (%s); resubscribing", exc)
                threading.Event().wait(1.0)
            finally:
                pubsub.close()


_listener: CancelListener | None = None
_lock = threading.Lock()


def listener() -> CancelListener:
    global _listener
    with _lock:
        if _listener is None:
            _listener = CancelListener()
        return _listener
