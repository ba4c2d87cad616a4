"""Read the live workers' engine statistics through Celery's remote control.

Other suites' workers may serve the same deployment queue during a full run, so the figures are
summed (counters) or maxed (peaks) over every worker that hosts the deployment.
"""

from __future__ import annotations

from tests.support import wait_until

SUMMED = ("running", "waiting", "kv_blocks_used", "requests_aborted", "requests_finished", "steps")


def engine_stats(worker: str, deployment: str) -> dict:
    from inference_platform.celery import app

    replies = app.control.broadcast("engine_stats", reply=True, timeout=2.0)
    engines = [stats for reply in replies for node in reply.values()
               for name, stats in node.get("engines", {}).items() if name == deployment]
    if not any(worker in reply for reply in replies):
        raise AssertionError(f"worker {worker} did not answer engine_stats")
    combined = {key: sum(e.get(key, 0) for e in engines) for key in SUMMED}
    combined["batch_size_max"] = max((e.get("batch_size_max", 0) for e in engines), default=0)
    return combined


def wait_idle(worker: str, deployment: str, *, timeout: float = 30) -> dict:
    """Wait until no engine runs anything and none holds a KV block for a live request."""
    return wait_until(
        lambda: (s := engine_stats(worker, deployment)) and s["running"] == 0 and s["waiting"] == 0
        and s["kv_blocks_used"] == 0 and s,
        timeout=timeout, message="the engines to be idle with every KV block free",
    )
