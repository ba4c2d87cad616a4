"""Whether the gateway process that sent a request still waits for it (``dispatch.pulse_key``).

Its pulse missing once is not enough: Redis may have restarted and lost it, and the gateway sets
it again within PULSE_EVERY_S. Missing at checks at least GRACE_S apart, with none seen between,
the gateway is gone. A check that fails (Redis down) says nothing. Each check also reads when the
pulse was last set (its key's time to live): the gateway was alive then (``last_beat``), which
bounds what it can have passed on to its client."""

from __future__ import annotations

import logging
import time

from . import dispatch, fleet

log = logging.getLogger(__name__)
GRACE_S = 2 * dispatch.PULSE_EVERY_S
CHECK_EVERY_S = 1.0  # asked as often as a request's answers wait (each of its n): Redis at most this often


class GatewayPulse:
    def __init__(self, key: str, *, grace_s: float | None = None) -> None:
        self.key, self.grace_s = key, GRACE_S if grace_s is None else grace_s
        self._missing_since: float | None = None
        self._checked_at: float | None = None
        self.abandoned = False  # it said gone once
        self.last_beat: float | None = None  # when the gateway last set its pulse, as seen (monotonic)

    def gone(self) -> bool:
        now = time.monotonic()
        if self._checked_at is not None and now - self._checked_at < CHECK_EVERY_S:
            return self.abandoned
        self._checked_at = now
        try:
            left_ms = fleet.client().pttl(self.key)  # -2: no such key
        except Exception as exc:
            log.warning("could not check the gateway's pulse %s: %s", self.key, exc)
            return False
        if left_ms is not None and left_ms != -2:  # -1: set without an expiry, alive as far as it says
            self._missing_since = None
            beat = now - max(0.0, dispatch.PULSE_TTL_S - left_ms / 1000) if left_ms >= 0 else now
            self.last_beat = beat if self.last_beat is None else max(self.last_beat, beat)
            return False
        if self._missing_since is None:
            self._missing_since = now
        self.abandoned = now - self._missing_since >= self.grace_s
        return self.abandoned
