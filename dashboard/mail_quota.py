"""How often the dashboard mails one address. Anyone may type someone else's address into a form
(sign-up, a password reset, an invitation from an organization of their own), which must not let
them flood it, nor make the platform a relay for their text: each kind of email to each address is
counted, one a minute and a few a day, in the cache (shared by every web process)."""

from __future__ import annotations

import logging

from django.core.cache import cache

log = logging.getLogger(__name__)

EVERY_S = 60
A_DAY = 5
DAY_S = 24 * 3600


def row(obj, created) -> str:
    """A recipient named by a database row: its id and creation, which a database made again (a
    test run's) does not reuse while the counts last."""
    return f"{obj.pk}:{int(created.timestamp() * 1000)}"


def of_user(user) -> str:
    return row(user, user.date_joined)


def of_organization(organization) -> str:
    return row(organization, organization.created_at)


def keys(kind: str, who: str) -> tuple[str, str]:
    """The cache's counts of one kind of email to one recipient: this minute's, today's."""
    return f"mail-quota:{kind}:{who}:minute", f"mail-quota:{kind}:{who}:day"


def take(kind: str, who: str, *, every_s: int | None = EVERY_S, a_day: int = A_DAY) -> str | None:
    """Count one email; why it may not go, if it may not ("minute": one went less than ``every_s``
    ago, "day": ``a_day`` went today), else None. With the cache down it goes, uncounted: an email
    a person asked for matters more than the count."""
    minute, day = keys(kind, who)
    try:
        if every_s is not None and not cache.add(minute, 1, timeout=every_s):
            return "minute"
        cache.add(day, 0, timeout=DAY_S)
        if cache.incr(day) > a_day:
            return "day"
    except Exception:
        log.warning("the cache is unreachable: a %s email goes uncounted", kind, exc_info=True)
    return None


def give_back(kind: str, who: str, *, every_s: int | None = EVERY_S) -> None:
    """An email counted but not sent (the mail server refused it, another limit held it): it counts
    for neither the minute (asking again at once is fine) nor the day."""
    minute, day = keys(kind, who)
    try:
        if every_s is not None:
            cache.delete(minute)
        cache.decr(day)
    except Exception:  # the cache down, or the count gone: the minute and the day pass by themselves
        pass
