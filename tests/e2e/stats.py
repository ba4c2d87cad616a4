"""Read a live worker's engine statistics through Celery's remote control."""

from __future__ import annotations

from tests.support import wait_until


def engine_stats(worker: str, deployment: str) -> dict:
    from inference_platform.celery import app

    replies = app.control.broadcast("engine_stats", reply=True, timeout=2.0, destination=[worker])
    for reply in replies:
        if worker in reply:
            return reply[worker]["engines"].get(deployment, {})
    raise AssertionError(f"worker {worker} did not answer engine_stats")


def wait_idle(worker: str, deployment: str, *, timeout: float = 30) -> dict:
    """Wait until the engine runs nothing and holds no KV block for a live request."""
    return wait_until(
        lambda: (s := engine_stats(worker, deployment)) and s["running"] == 0 and s["waiting"] == 0
        and s["kv_blocks_used"] == 0 and s,
        timeout=timeout, message="the engine to be idle with every KV block free",
    )
