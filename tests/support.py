"""Small helpers shared by the tests: free ports, waiting on a condition with a deadline."""

from __future__ import annotations

import socket
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port nobody listens on right now (closed again before returning)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, *, timeout: float, interval: float = 0.1, message: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; fail with ``message`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {message}")
        time.sleep(interval)


def assert_billed_as_priced(record) -> None:
    """A usage record cost something at its prices, and was charged that, give or take the
    fraction of a micro-dollar its organization carries from request to request."""
    from billing.pricing import COST_QUANTUM, Prices, exact_cost

    exact = exact_cost(prices=Prices.of(record), prompt_tokens=record.prompt_tokens,
                       cached_prompt_tokens=record.cached_prompt_tokens, completion_tokens=record.completion_tokens,
                       status=record.status)
    assert exact > 0 and abs(record.cost - exact) < COST_QUANTUM, (record.cost, exact)
