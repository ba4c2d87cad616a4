"""Failed dashboard sign-ins, counted per email in the cache (Redis: every web process shares it).

After ``MAX_FAILURES`` failures within ``WINDOW_S``, sign-ins to that email are refused until
``WINDOW_S`` after the last of them, whatever the password: guessing one account's password is
slow however many machines try. Per email, not per address: behind a proxy every client has the
proxy's address. A password reset still works meanwhile.
"""

from __future__ import annotations

import hashlib
import time

from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.core.cache import cache
from django.dispatch import receiver

MAX_FAILURES = 10
WINDOW_S = 15 * 60


def _keys(email: str) -> tuple[str, str]:
    digest = hashlib.sha256(email.strip().lower().encode()).hexdigest()[:32]  # no address in Redis
    return f"login-failures:{digest}", f"login-locked:{digest}"


def seconds_locked(email: str) -> int:
    """How long sign-ins to ``email`` stay refused (0: they are not)."""
    _, locked = _keys(email)
    until = cache.get(locked)
    return max(0, int(until - time.time()) + 1) if until else 0


def record_failure(email: str) -> None:
    failures, locked = _keys(email)
    cache.add(failures, 0, timeout=WINDOW_S)
    try:
        count = cache.incr(failures)
    except ValueError:  # expired between the two calls
        cache.set(failures, count := 1, timeout=WINDOW_S)
    cache.touch(failures, WINDOW_S)
    if count >= MAX_FAILURES:
        cache.set(locked, time.time() + WINDOW_S, timeout=WINDOW_S)


def clear(email: str) -> None:
    cache.delete_many(list(_keys(email)))


@receiver(user_login_failed)
def _failed(sender, credentials=None, **kwargs) -> None:
    email = (credentials or {}).get("username")
    if email:
        record_failure(email)


@receiver(user_logged_in)
def _signed_in(sender, user=None, **kwargs) -> None:
    if user is not None and user.email:
        clear(user.email)
