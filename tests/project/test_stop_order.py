"""How `up` stops its children: stage by stage, each stage's ``before_stop`` first."""

from __future__ import annotations

import sys

from inference_platform.processes import STAGE_BILLING, STAGE_REDIS, spawn, stop_all

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_the_billing_worker_stops_after_the_others_once_drained_and_redis_last():
    web, worker, billing, redis = (spawn(SLEEPER) for _ in range(4))
    billing.stop_stage, redis.stop_stage = STAGE_BILLING, STAGE_REDIS
    seen = []

    def drain():  # what the billing worker waits for, and what is still running meanwhile
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
    billing.before_stop = lambda: (_ for _ in ()).throw(AssertionError("drained a dead child"))
    stop_all([billing], grace_s=1)
    assert billing.returncode == 0
