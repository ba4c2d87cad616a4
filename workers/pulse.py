"""Whether the gateway process that sent a request still waits for it (``dispatch.pulse_key``).

Its pulse missing once is not enough: Redis may have restarted and lost it, and the gateway sets
it again within PULSE_EVERY_S. Missing at checks at least GRACE_S apart, with none seen between,
the gateway is gone. A check that fails (Redis down) says nothing."""

from __future__ import annotations

import logging
import time

from . import dispatch, fleet

log = logging.getLogger(__name__)
GRACE_S = 2 * dispatch.PULSE_EVERY_S
CHECK_EVERY_S = 1.0  # asked as often as a request's answers wait (each of its n): Redis at most this often


class GatewayPulse:
    def __init__(self, key: str, *, grace_s: float = GRACE_S) -> None:
        self.key, self.grace_s = key, grace_s
        self._missing_since: float | None = None
        self._checked_at: float | None = None
        self.abandoned = False  # it said gone once

    def gone(self) -> bool:
        now = time.monotonic()
        if self._checked_at is not None and now - self._checked_at < CHECK_EVERY_S:
            return self.abandoned
        self._checked_at = now
        try:
            beating = bool(fleet.client().exists(self.key))
        except Exception as exc:
            log.warning("could not check the gateway's pulse %s: %s", self.key, exc)
            return False
        if beating:
            self._missing_since = None
            return False
        if self._missing_since is None:
            self._missing_since = now
        self.abandoned = now - self._missing_since >= self.grace_s
        return self.abandoned
