"""`up` keeps the platform running when one of its parts dies: the part is started again, and the
clients it was serving get a clear error instead of a cut connection."""

from __future__ import annotations

import json
import os
import signal

import httpx
import psutil

from tests.project.test_cli import start_up
from tests.support import wait_until


def part(up: psutil.Process, *words: str) -> psutil.Process | None:
    """The child of ``up`` whose command line holds every word (None while there is none)."""
    for child in up.children():
        line = " ".join(child.cmdline())
        if all(word in line for word in words):
            return child
    return None


def chat(port: int, key: str, **body) -> httpx.Response:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 4, **body}
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def test_a_killed_inference_worker_is_restarted_and_its_open_stream_ends_with_worker_lost(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_HEARTBEAT_SECONDS", "0.5")  # its death is noticed within 1.5 s
    proc, port, log = start_up(tmp_path)
    try:
        up = psutil.Process(proc.pid)
        key = (tmp_path / "api-key.txt").read_text().strip()
        worker = part(up, "celery", "worker@")
        # Banning the end-of-text tokens keeps it streaming until the kill.
        body = {"model": "smollm2-135m-instruct", "stream": True, "max_tokens": 400,
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "logit_bias": {"0": -100, "2": -100}}
        events = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 2:  # the answer has started reaching us
                    worker.kill()
        assert events[-1] != "[DONE]"
        error = json.loads(events[-1])["error"]
        assert error["code"] == "worker_lost" and "not billed" in error["message"]

        wait_until(lambda: "restarted the inference worker" in log.read_text(), timeout=60,
                   message="the worker's restart")
        assert "warning: the inference worker exited with code -9; restarting it in 1s" in log.read_text()
        # Answered by the new worker once it has loaded the model again: the platform stayed up.
        answer = chat(port, key)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=90)


def test_a_request_whose_web_server_died_is_cancelled_not_run_to_its_end(tmp_path):
    """Its client's connection died with the server: the worker notices the gateway's pulse is
    gone, and records a failure billed for what reached that server while it was alive, not for
    what was generated until the worker noticed (let alone the whole answer, for nobody)."""
    proc, port, log = start_up(tmp_path)
    try:
        up = psutil.Process(proc.pid)
        key = (tmp_path / "api-key.txt").read_text().strip()
        body = {"model": "smollm2-135m-instruct", "stream": True, "max_tokens": 4000,
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "logit_bias": {"0": -100, "2": -100}}
        received = 0
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {key}"}) as response:
                request_id = response.headers["x-request-id"]
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    received += 1
                    if received == 3:  # the answer is reaching its client
                        part(up, "uvicorn").kill()
        except httpx.TransportError:
            pass  # the connection died with the server
        worker_log = tmp_path / "logs" / "worker.log"
        wait_until(lambda: f"request {request_id}: its gateway is gone; cancelled" in worker_log.read_text(),
                   timeout=120, message="the worker to cancel the request")
        answer = wait_until(lambda: _answered(port, key), timeout=120, message="the restarted web server's answer")
        assert answer.status_code == 200

        def record():
            csv = httpx.get(f"http://127.0.0.1:{port}/v1/usage/export.csv", timeout=30,
                            headers={"Authorization": f"Bearer {key}"}).text
            return next((line for line in csv.splitlines() if request_id in line), None)

        line = wait_until(record, timeout=60, message="the request's usage record")
        header = httpx.get(f"http://127.0.0.1:{port}/v1/usage/export.csv", timeout=30,
                           headers={"Authorization": f"Bearer {key}"}).text.splitlines()[0].split(",")
        fields = dict(zip(header, line.split(",")))
        # It had at most what the client got when it died (3 events: the role and two tokens) and
        # what was on its way; the worker generated on for seconds before it noticed.
        assert fields["status"] == "failed" and int(fields["completion_tokens"]) <= 2 + 8, fields
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=90)


def test_a_web_server_killed_outright_takes_its_worker_processes_along_and_is_restarted(tmp_path):
    proc, port, log = start_up(tmp_path, "--web-workers", "2")
    try:
        up = psutil.Process(proc.pid)
        key = (tmp_path / "api-key.txt").read_text().strip()
        master = part(up, "uvicorn")
        workers = [child for child in master.children() if "spawn_main" in " ".join(child.cmdline())]
        assert len(workers) == 2
        master.kill()
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert alive == [], "the web server's worker processes outlived it and hold its port"
        wait_until(lambda: "restarted the web server" in log.read_text(), timeout=60, message="the web server's restart")
        answer = wait_until(lambda: _answered(port, key), timeout=120, message="the restarted web server's answer")
        assert answer.json()["choices"][0]["message"]["content"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=90)


def _answered(port: int, key: str) -> httpx.Response | None:
    try:
        response = chat(port, key)
    except httpx.TransportError:
        return None
    return response if response.status_code == 200 else None
