"""Sign-ins (the dashboard's and the admin site's), counted per account in the cache (Redis: every
web process shares it).

Each attempt is counted before its password is checked, and after ``MAX_FAILURES`` attempts within
``WINDOW_S`` that did not sign in, sign-ins to that account are refused until ``WINDOW_S`` after
the last of them, whatever the password: guessing one account's password is slow however many
machines try, and however many attempts they send at once. Per account, not per address: behind
a proxy every client has the proxy's address. A password reset still works, and lifts the lock
(any save of the user does). The cache unreachable, sign-ins are not counted rather than refused.
"""

from __future__ import annotations

import hashlib
import logging
import time

from django import forms
from django.contrib.auth.signals import user_logged_in
from django.core.cache import cache
from django.db.models.signals import post_save
from django.dispatch import receiver

from .models import User

log = logging.getLogger(__name__)

MAX_FAILURES = 10
WINDOW_S = 15 * 60


def _keys(email: str) -> tuple[str, str]:
    """The account's counters: keyed by the email of the user a sign-in as ``email`` would find
    (the database matches case-insensitively, and on PostgreSQL ``ſ`` matches ``s``: every
    spelling that reaches an account must count against it), else by ``email`` itself."""
    email = email.strip()
    account = User.objects.filter(email__iexact=email).values_list("email", flat=True).first()
    digest = hashlib.sha256((account or email).lower().encode()).hexdigest()[:32]  # no address in Redis
    return f"login-failures:{digest}", f"login-locked:{digest}"


def _locked_for(locked: str) -> int:
    until = cache.get(locked)
    return max(0, int(until - time.time()) + 1) if until else 0


def take_attempt(email: str) -> int:
    """Count an attempt to sign in as ``email`` before its password is checked: 0 if it may go
    on, else how long the account stays locked. Counted first, so that attempts sent together
    cannot all pass a check that only the failures they make would fail."""
    failures, locked = _keys(email)
    try:
        if wait := _locked_for(locked):
            return wait
        cache.add(failures, 0, timeout=WINDOW_S)
        try:
            count = cache.incr(failures)
        except ValueError:  # expired between the two calls
            cache.set(failures, count := 1, timeout=WINDOW_S)
        cache.touch(failures, WINDOW_S)
        if count > MAX_FAILURES:
            cache.set(locked, time.time() + WINDOW_S, timeout=WINDOW_S)
            return WINDOW_S
    except Exception as exc:
        log.warning("sign-in throttle unavailable: %s", exc)
    return 0


def clear(email: str) -> None:
    try:
        cache.delete_many(list(_keys(email)))
    except Exception as exc:
        log.warning("sign-in throttle unavailable: %s", exc)


class ThrottledLogin:
    """For a Django login form (``username`` is the email): refuses a locked account before its
    password is checked."""

    def clean(self):
        email = self.cleaned_data.get("username")
        wait = take_attempt(email) if email else 0
        if wait:
            raise forms.ValidationError(
                f"Too many failed sign-ins to this account: try again in {-(-wait // 60)} minutes, or reset "
                "your password.", code="throttled")
        return super().clean()


@receiver(user_logged_in)
def _signed_in(sender, user=None, **kwargs) -> None:
    if user is not None and user.email:
        clear(user.email)


@receiver(post_save, sender=User)
def _saved(sender, instance=None, **kwargs) -> None:
    """A new password (a reset), or the operator's change, lifts the lock."""
    if instance is not None and instance.email:
        clear(instance.email)
