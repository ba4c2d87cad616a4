"""Keeping the command line's children running: a child that dies is started again, after a wait
that doubles while it keeps dying young, and the whole set stops only when one is in a crash loop.

A restarted inference worker loads its models again; the fleet fails or redelivers the requests
the dead one held (``workers.fleet.recover_requests``), so the web server stays up and its clients
get an answer or a clear error instead of a cut connection.

Stopping (Ctrl-C or SIGTERM) waits for each child up to its grace (``stop_all``): the inference
worker's running requests may take the drain timeout; another Ctrl-C or SIGTERM meanwhile stops
everything at once.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from .processes import STOP_GRACE_S, describe, respawn, stop_all


@dataclass
class Backoff:
    """When to start a dead child again: soon after a death that ended a healthy run (one of at
    least ``healthy_after_s``), then waits doubling up to ``max_delay_s`` while it keeps dying
    young; at most ``limit`` restarts in a row after young deaths, and the next young death gives up
    (a crash loop: a setting or a bug to fix)."""

    healthy_after_s: float = 60.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    limit: int = 5
    young_deaths: int = 0

    def after_death(self, *, lived_s: float) -> float | None:
        """Seconds to wait before the restart, or None to give up."""
        if lived_s >= self.healthy_after_s:
            self.young_deaths = 0
        self.young_deaths += 1
        if self.young_deaths > self.limit:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2 ** (self.young_deaths - 1))


def supervise(procs: list[subprocess.Popen], *, say: Callable[[str], None] = print,
              backoff: Callable[[], Backoff] = Backoff, poll_s: float = 0.2) -> int:
    """Run until Ctrl-C or SIGTERM (0), restarting any child that dies, or until a child is in a
    crash loop (1); then stop every child (``shut_down``: another signal meanwhile stops them at
    once). ``procs`` is updated in place with the restarted ones."""
    signals: list[int] = []

    def on_signal(signum, frame):
        signals.append(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    backoffs = [backoff() for _ in procs]
    restart_at: dict[int, float] = {}  # index in procs -> when
    code = 0
    try:
        while not signals and code == 0:
            now = time.monotonic()
            for index, proc in enumerate(procs):
                if index in restart_at:
                    if now >= restart_at[index]:
                        del restart_at[index]
                        procs[index] = respawn(proc)
                        say(f"restarted {describe(proc)} (pid {procs[index].pid})")
                    continue
                if proc.poll() is None:
                    continue
                wait = backoffs[index].after_death(lived_s=now - proc.started_at)
                if wait is None:
                    say(f"error: {describe(proc)} exited with code {proc.returncode}, "
                        f"{backoffs[index].young_deaths} times in a row within {backoffs[index].healthy_after_s:g}s "
                        "of starting; stopping (see its log)")
                    code = 1
                    break
                say(f"warning: {describe(proc)} exited with code {proc.returncode}; restarting it in {wait:g}s")
                restart_at[index] = now + wait
            time.sleep(poll_s)
    finally:
        try:
            # The first signal asked for this stop; any other, even one that came with it, forces it.
            shut_down(procs, say=say, signals=signals, asked=min(1, len(signals)))
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    return code


def shut_down(procs: list[subprocess.Popen], *, say: Callable[[str], None] = print, grace_s: float = STOP_GRACE_S,
              signals: list[int] | None = None, asked: int = 0, announce: bool = True) -> None:
    """Stop every child, the last started first within a stage (``stop_all``, each child waited for
    up to its grace). A Ctrl-C or SIGTERM meanwhile, beyond the ``asked`` first of ``signals`` (those
    that asked for this stop), stops them all at once (SIGKILL). ``announce``: say when the stop
    starts and ends (the notices of a long wait and of a kill are said either way)."""
    signals = [] if signals is None else signals

    def on_signal(signum, frame):
        signals.append(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        if announce:
            say("stopping...")
        stop_all(list(reversed(procs)), grace_s=grace_s, forced=lambda: len(signals) > asked, say=say)
        if announce:
            say("stopped")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
