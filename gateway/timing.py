"""Where an inference request's time goes before its stream starts, sent back as a standard
``Server-Timing`` header (``auth;dur=1.2, admit;dur=0.8, ...``, milliseconds).

Stages, in order: ``auth`` (waiting for an admission thread, the key, the body), ``admit`` (the deployment, credit and
spend limits, rate limits), ``dispatch`` (the publish on the deployment's queue), ``queue`` (until
a worker took the request and its engine accepted it), ``load`` (more waiting, when that worker
had to load the model first). Clients, and bench/serving.py, can tell the platform's own share of
the time to first token from the engine's.
"""

from __future__ import annotations

import time


class Stages:
    def __init__(self):
        self._last = time.perf_counter()
        self.durations: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """Close stage ``name``: the time since the previous mark (or the start)."""
        now = time.perf_counter()
        self.durations[name] = self.durations.get(name, 0.0) + (now - self._last) * 1000
        self._last = now

    def header(self) -> str:
        return ", ".join(f"{name};dur={ms:.2f}" for name, ms in self.durations.items())


def parse(header: str | None) -> dict[str, float]:
    """``{stage: ms}`` from a ``Server-Timing`` header (entries without ``dur`` are skipped)."""
    stages = {}
    for entry in (header or "").split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if name and key == "dur":
                try:
                    stages[name] = float(value)
                except ValueError:
                    pass
    return stages
