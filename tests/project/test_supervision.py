"""The command line's children are restarted when they die, and a crash loop stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil

from inference_platform.processes import spawn
from inference_platform.supervision import Backoff, supervise
from tests.support import REPO_ROOT, wait_until


def test_the_wait_doubles_while_a_child_dies_young_and_resets_after_a_healthy_run():
    backoff = Backoff(healthy_after_s=60, first_delay_s=1, max_delay_s=5, limit=5)
    assert [backoff.after_death(lived_s=2) for _ in range(5)] == [1, 2, 4, 5, 5]
    assert backoff.after_death(lived_s=2) is None  # the sixth young death in a row: a crash loop
    assert backoff.after_death(lived_s=61) == 1  # after a healthy run it starts over


def test_a_child_in_a_crash_loop_stops_everything_with_its_name():
    said = []
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    crashing = spawn([sys.executable, "-c", "raise SystemExit(3)"], role="the inference worker")
    healthy = spawn([sys.executable, "-c", "import time; time.sleep(600)"], role="the web server")
    procs = [crashing, healthy]
    code = supervise(procs, say=said.append, backoff=lambda: Backoff(first_delay_s=0.01, limit=2), poll_s=0.01)
    assert code == 1
    assert said.count("warning: the inference worker exited with code 3; restarting it in 0.01s") == 1
    assert any(line.startswith("error: the inference worker exited with code 3, 3 times in a row") for line in said)
    assert healthy.poll() is not None  # stopped with the rest
    assert procs[0] is not crashing  # restarted twice before giving up
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # given back


SUPERVISOR = textwrap.dedent("""
    import sys
    from inference_platform.processes import spawn
    from inference_platform.supervision import Backoff, supervise
    child = spawn([sys.executable, "-c", "import time; time.sleep(600)"], role="the billing worker")
    sys.exit(supervise([child], backoff=lambda: Backoff(first_delay_s=0.05)))
""")


def test_a_killed_child_is_started_again_and_a_signal_still_stops_everything(tmp_path):
    log = tmp_path / "supervisor.log"
    with open(log, "w") as out:
        supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR], cwd=REPO_ROOT, stdout=out,
                                      stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        first = wait_until(lambda: psutil.Process(supervisor.pid).children(), timeout=30,
                           message="the first child")[0]
        first.kill()
        second = wait_until(lambda: [c for c in psutil.Process(supervisor.pid).children() if c.pid != first.pid],
                            timeout=30, message="the restarted child")[0]
        wait_until(lambda: f"(pid {second.pid})" in log.read_text(), timeout=30, message="the restart's line")
        output = log.read_text()
        assert "warning: the billing worker exited with code -9; restarting it in 0.05s" in output
        assert f"restarted the billing worker (pid {second.pid})" in output

        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=30) == 0, log.read_text()
        gone, alive = psutil.wait_procs([second], timeout=15)
        assert alive == []
    finally:
        if supervisor.poll() is None:
            supervisor.kill()


# A supervisor whose child, like an inference worker in its warm shutdown, keeps running after a
# SIGTERM (it would for its drain timeout, 600 s), and says when it has its handler in place.
DRAINING_SUPERVISOR = textwrap.dedent("""
    import sys
    from inference_platform.processes import spawn
    from inference_platform.supervision import supervise
    child = spawn([sys.executable, "-c", '''
    import signal, sys, time
    from pathlib import Path
    signal.signal(signal.SIGTERM, lambda signum, frame: Path(sys.argv[1], "draining").touch())
    Path(sys.argv[1], "ready").touch()
    while True:
        time.sleep(1)
    ''', sys.argv[1]], role="the inference worker")
    child.stop_grace_s = 600
    child.waiting_for = lambda: "the inference worker to finish its 3 running requests"
    sys.exit(supervise([child]))
""")


def test_a_stop_waits_for_the_inference_worker_and_says_so_and_a_second_signal_forces_it(tmp_path):
    log = tmp_path / "supervisor.log"
    with open(log, "w") as out:
        supervisor = subprocess.Popen([sys.executable, "-c", DRAINING_SUPERVISOR, str(tmp_path)], cwd=REPO_ROOT,
                                      stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until(lambda: (tmp_path / "ready").exists(), timeout=30, message="the child")
        [child] = psutil.Process(supervisor.pid).children()

        supervisor.send_signal(signal.SIGTERM)  # docker compose stop
        wait_until(lambda: "waiting up to" in log.read_text() or supervisor.poll() is not None, timeout=60,
                   message="the notice of the wait")
        output = log.read_text()
        assert ("waiting up to 600 s for the inference worker to finish its 3 running requests; "
                "press Ctrl-C again (or send SIGTERM again) to stop now") in output, output
        assert output.count("waiting up to") == 1
        assert (tmp_path / "draining").exists() and child.is_running() and supervisor.poll() is None

        supervisor.send_signal(signal.SIGINT)  # then Ctrl-C: stop now
        assert supervisor.wait(timeout=30) == 0, log.read_text()
        output = log.read_text()
        assert "stopping now: killing the inference worker" in output and output.rstrip().endswith("stopped")
        gone, alive = psutil.wait_procs([child], timeout=15)
        assert alive == []
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
