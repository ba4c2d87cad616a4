"""Failed sign-ins (the dashboard's and the admin site's), counted per email in the cache (Redis:
every web process shares it).

After ``MAX_FAILURES`` failures within ``WINDOW_S``, sign-ins to that email are refused until
``WINDOW_S`` after the last of them, whatever the password: guessing one account's password is
slow however many machines try. Per email, not per address: behind a proxy every client has the
proxy's address. A password reset still works, and lifts the lock (any save of the user does).
The cache unreachable, sign-ins are not counted rather than refused.
"""

from __future__ import annotations

import hashlib
import logging
import time

from django import forms
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.core.cache import cache
from django.db.models.signals import post_save
from django.dispatch import receiver

from .models import User

log = logging.getLogger(__name__)

MAX_FAILURES = 10
WINDOW_S = 15 * 60


def _keys(email: str) -> tuple[str, str]:
    digest = hashlib.sha256(email.strip().lower().encode()).hexdigest()[:32]  # no address in Redis
    return f"login-failures:{digest}", f"login-locked:{digest}"


def seconds_locked(email: str) -> int:
    """How long sign-ins to ``email`` stay refused (0: they are not)."""
    _, locked = _keys(email)
    try:
        until = cache.get(locked)
    except Exception as exc:  # Redis down: sign-ins go on, unthrottled
        log.warning("sign-in throttle unavailable: %s", exc)
        return 0
    return max(0, int(until - time.time()) + 1) if until else 0


def record_failure(email: str) -> None:
    failures, locked = _keys(email)
    try:
        cache.add(failures, 0, timeout=WINDOW_S)
        try:
            count = cache.incr(failures)
        except ValueError:  # expired between the two calls
            cache.set(failures, count := 1, timeout=WINDOW_S)
        cache.touch(failures, WINDOW_S)
        if count >= MAX_FAILURES:
            cache.set(locked, time.time() + WINDOW_S, timeout=WINDOW_S)
    except Exception as exc:
        log.warning("sign-in throttle unavailable: %s", exc)


def clear(email: str) -> None:
    try:
        cache.delete_many(list(_keys(email)))
    except Exception as exc:
        log.warning("sign-in throttle unavailable: %s", exc)


class ThrottledLogin:
    """For a Django login form (``username`` is the email): refuses a locked email before its
    password is checked."""

    def clean(self):
        email = self.cleaned_data.get("username")
        wait = seconds_locked(email) if email else 0
        if wait:
            raise forms.ValidationError(
                f"Too many failed sign-ins to this account: try again in {-(-wait // 60)} minutes, or reset "
                "your password.", code="throttled")
        return super().clean()


@receiver(user_login_failed)
def _failed(sender, credentials=None, **kwargs) -> None:
    email = (credentials or {}).get("username")
    if email:
        record_failure(email)


@receiver(user_logged_in)
def _signed_in(sender, user=None, **kwargs) -> None:
    if user is not None and user.email:
        clear(user.email)


@receiver(post_save, sender=User)
def _saved(sender, instance=None, **kwargs) -> None:
    """A new password (a reset), or the operator's change, lifts the lock."""
    if instance is not None and instance.email:
        clear(instance.email)
