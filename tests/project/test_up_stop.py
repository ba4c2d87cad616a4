"""Stopping `up` lets the requests already running finish, as a graceful stop of an inference
server should: Ctrl-C waits for the inference worker's running requests (up to FLEET_DRAIN_TIMEOUT)
while the web server keeps streaming them, and billing records them before Redis stops."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time

import httpx

from tests.project.test_cli import start_up

MODEL = "smollm2-135m-instruct"
# Banning the end-of-text tokens makes every answer run to its max_tokens.
LONG = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "Tell me a long story."}],
        "logit_bias": {"0": -100, "2": -100}}


def stream(port: int, key: str, **body) -> tuple[list[str], list[float]]:
    """A streamed answer's events (``data:`` payloads) and when each arrived."""
    events, times = [], []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json={**LONG, **body}, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                times.append(time.monotonic())
    return events, times


def test_ctrl_c_lets_a_running_stream_finish_bills_it_and_exits_0(tmp_path):
    proc, port, log = start_up(tmp_path)
    try:
        key = (tmp_path / "api-key.txt").read_text().strip()
        # Sized to this machine (its decode rate, from an answer once the engine is warm): about
        # 12 s of tokens, so that the answer still runs when `up` says what it waits for, and runs
        # past the 5 s the web server used to give open streams and the 10 s the worker used to get.
        stream(port, key, max_tokens=8)
        events, times = stream(port, key, max_tokens=32)
        rate = (len(events) - 4) / max(times[-3] - times[1], 1e-3)  # from its first token to its last
        max_tokens = int(min(600, max(40, 12 * rate)))

        body = {**LONG, "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"}) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 2:  # the answer is under way: Ctrl-C (the terminal signals the whole group)
                    os.killpg(proc.pid, signal.SIGINT)

        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(event) for event in events[:-1]]
        assert not [chunk for chunk in chunks if "error" in chunk]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == max_tokens

        assert proc.wait(timeout=120) == 0, log.read_text()
        output = log.read_text()
        assert ("waiting up to 600 s for the inference worker to finish its 1 running request; "
                "press Ctrl-C again (or send SIGTERM again) to stop now") in output, output
        assert output.rstrip().endswith("stopped") and "killing" not in output
        # Billing recorded it after the worker finished, before the embedded Redis stopped.
        with sqlite3.connect(tmp_path / "db.sqlite3") as db:
            row = db.execute("SELECT status, completion_tokens FROM billing_usagerecord WHERE request_id = ?",
                             (request_id,)).fetchone()
        assert row == ("completed", max_tokens)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_web_command_keeps_open_answers_as_long_as_the_workers_drain(tmp_path):
    """`web` run apart (compose's web service) must not cut the streams a stopping GPU worker is
    still finishing: its server's graceful timeout is the drain timeout, and its supervisor waits."""
    import subprocess
    import sys

    import psutil

    from tests.support import REPO_ROOT, free_port, wait_until

    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
    env.update(DATA_DIR=str(tmp_path), FLEET_DRAIN_TIMEOUT="42")
    web = subprocess.Popen([sys.executable, "-m", "inference_platform.cli", "web", "--port", str(free_port())],
                           cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        server = wait_until(lambda: [c for c in psutil.Process(web.pid).children() if "uvicorn" in " ".join(c.cmdline())],
                            timeout=60, message="the web server")[0]
        line = server.cmdline()
        assert line[line.index("--timeout-graceful-shutdown") + 1] == "42"
    finally:
        web.send_signal(signal.SIGINT)
        web.wait(timeout=60)
