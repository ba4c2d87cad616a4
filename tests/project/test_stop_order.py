"""How `up` stops its children: stage by stage, each stage's ``before_stop`` first, each child
waited for up to its own grace, all of them killed at once when the stop is forced."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from inference_platform.processes import STAGE_BILLING, STAGE_REDIS, spawn, stop_all
from tests.support import wait_until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_the_billing_worker_stops_after_the_others_once_drained_and_redis_last():
    web, worker, billing, redis = (spawn(SLEEPER) for _ in range(4))
    billing.stop_stage, redis.stop_stage = STAGE_BILLING, STAGE_REDIS
    seen = []

    def drain(forced):  # what the billing worker waits for, and what is still running meanwhile
        seen.append(("drain", web.poll() is None, worker.poll() is None, billing.poll() is None, redis.poll() is None))

    billing.before_stop = drain
    try:
        stop_all([redis, billing, worker, web], grace_s=5)
        assert seen == [("drain", False, False, True, True)]  # the others gone; billing and Redis still up
        assert all(proc.poll() is not None for proc in (web, worker, billing, redis))
    finally:
        for proc in (web, worker, billing, redis):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_child_that_already_exited_is_not_drained():
    billing = spawn([sys.executable, "-c", "pass"])
    billing.wait()
    billing.stop_stage = STAGE_BILLING
    billing.before_stop = lambda forced: (_ for _ in ()).throw(AssertionError("drained a dead child"))
    stop_all([billing], grace_s=1)
    assert billing.returncode == 0


# A child that finishes its work after a SIGTERM (as a Celery worker's warm shutdown finishes its
# running requests): says it is ready (its handler in place), then on SIGTERM says it is draining
# and exits 0 once the test lets it (the file ``release`` appears), or never when there is none.
DRAINER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    folder = Path(sys.argv[1])
    def drain(signum, frame):
        (folder / "draining").touch()
        while not (folder / "release").exists():
            time.sleep(0.02)
        sys.exit(0)
    signal.signal(signal.SIGTERM, drain)
    (folder / "ready").touch()
    while True:
        time.sleep(1)
""")

# A child that ignores SIGTERM: only the SIGKILL at the end of its grace stops it.
DEAF = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(sys.argv[1]).touch()
    while True:
        time.sleep(1)
""")


def started(args: list[str], ready: Path, role: str = "") -> subprocess.Popen:
    proc = spawn(args, role=role)
    wait_until(lambda: ready.exists() or proc.poll() is not None, timeout=30, message=f"{ready.name}")
    assert proc.poll() is None
    return proc


def test_a_child_with_a_longer_grace_finishes_its_work_past_the_short_grace_and_billing_drains_after_it(tmp_path):
    """The inference worker's grace is the drain timeout: it outlives the others' short grace and
    stops on its own (exit 0, not a SIGKILL); only then does billing drain, Redis last."""
    (tmp_path / "worker").mkdir()
    worker = started([sys.executable, "-c", DRAINER, str(tmp_path / "worker")], tmp_path / "worker" / "ready")
    web = started([sys.executable, "-c", DEAF, str(tmp_path / "web-ready")], tmp_path / "web-ready")
    billing, redis = spawn(SLEEPER), spawn(SLEEPER)
    worker.stop_grace_s = 30  # its drain timeout; the others keep grace_s
    billing.stop_stage, redis.stop_stage = STAGE_BILLING, STAGE_REDIS
    seen = []
    billing.before_stop = lambda forced: seen.append(
        ("drain", web.poll() is None, worker.poll() is None, billing.poll() is None, redis.poll() is None))
    stopping = threading.Thread(target=stop_all, args=([redis, billing, worker, web],), kwargs={"grace_s": 0.5})
    stopping.start()
    try:
        wait_until(lambda: (tmp_path / "worker" / "draining").exists(), timeout=30, message="the worker's SIGTERM")
        # The short grace is over: the web server, deaf to SIGTERM, was killed...
        wait_until(lambda: web.returncode is not None or web.poll() is not None, timeout=30,
                   message="the web server's kill")
        assert web.returncode == -signal.SIGKILL
        # ...while the worker still finishes its work, and billing waits for it.
        assert worker.poll() is None
        assert seen == [] and billing.poll() is None
        (tmp_path / "worker" / "release").touch()  # its last request ends
        stopping.join(timeout=60)
        assert not stopping.is_alive()
        assert worker.returncode == 0  # it stopped on its own, not killed
        assert seen == [("drain", False, False, True, True)]
        assert billing.returncode is not None and redis.returncode is not None
    finally:
        (tmp_path / "worker" / "release").touch()
        stopping.join(timeout=60)
        for proc in (web, worker, billing, redis):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_forced_stop_kills_every_child_at_once_without_draining_billing(tmp_path):
    (tmp_path / "worker").mkdir()
    worker = started([sys.executable, "-c", DRAINER, str(tmp_path / "worker")], tmp_path / "worker" / "ready",
                     role="the inference worker")
    billing, redis = spawn(SLEEPER), spawn(SLEEPER)
    worker.stop_grace_s = 600  # it would wait for its requests that long
    worker.waiting_for = lambda: "the inference worker to finish its 2 running requests"
    billing.stop_stage, redis.stop_stage = STAGE_BILLING, STAGE_REDIS
    billing.before_stop = lambda forced: pytest.fail("a forced stop drained billing")
    force = threading.Event()
    said: list[str] = []
    stopping = threading.Thread(target=stop_all, args=([redis, billing, worker],),
                                kwargs={"grace_s": 0.5, "forced": force.is_set, "say": said.append,
                                        "notice_after_s": 0})
    stopping.start()
    try:
        wait_until(lambda: said, timeout=30, message="the notice of the wait")
        assert said == ["waiting up to 600 s for the inference worker to finish its 2 running requests; "
                        "press Ctrl-C again (or send SIGTERM again) to stop now"]
        wait_until(lambda: (tmp_path / "worker" / "draining").exists(), timeout=30, message="the worker's SIGTERM")
        assert worker.poll() is None
        force.set()  # a second Ctrl-C
        stopping.join(timeout=30)
        assert not stopping.is_alive()
        assert len(said) == 2 and said[1].startswith("stopping now: killing the inference worker, ")
        assert [p.returncode for p in (worker, billing, redis)] == [-signal.SIGKILL] * 3
    finally:
        force.set()
        stopping.join(timeout=30)
        for proc in (worker, billing, redis):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
