"""The engines a worker process hosts: one per deployment it serves, loaded once, shared by
every task thread (the engine's own loop does the batching)."""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)


class EngineHost:
    def __init__(self):
        self._engines: dict[str, object] = {}
        self._specs: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.load_seconds: dict[str, float] = {}

    def engine_for(self, spec: dict):
        """The running engine for a deployment, loading it on first use (one load at a time)."""
        name = spec["name"]
        engine = self._engines.get(name)
        if engine is not None and engine.is_running:
            return engine
        with self._lock:
            engine = self._engines.get(name)
            if engine is not None and not engine.is_running:  # its loop died (unload pops first)
                log.error("the engine of deployment %s stopped running; loading it again", name)
                self._engines.pop(name, None)
                engine.stop(timeout=1)  # fails what it still held and lets its memory go
                engine = None
            if engine is None:
                engine = self._load(spec)
                self._engines[name] = engine
                self._specs[name] = spec
        return engine

    def _load(self, spec: dict):
        from workers.engine import Engine

        started = time.monotonic()
        log.info("loading deployment %s from %s", spec["name"], spec["weights"])
        engine = Engine(
            spec["weights"],
            dtype=None if spec.get("dtype") in (None, "", "auto") else spec["dtype"],
            quantization=None if spec.get("quantization") in (None, "", "none") else spec["quantization"],
            max_batch_size=spec.get("max_batch_size", 32),
            batch_window_ms=spec.get("batch_window_ms", 0),
            warm_up=True,  # "ready" means its first request is as quick as the next ones
            **_worker_engine_options(),
        ).start()
        self.load_seconds[spec["name"]] = time.monotonic() - started
        log.info("deployment %s ready in %.1fs", spec["name"], self.load_seconds[spec["name"]])
        return engine

    def loaded(self) -> dict[str, object]:
        return dict(self._engines)

    def spec(self, name: str) -> dict | None:
        """The spec a loaded deployment's engine was made from (None when it is not loaded)."""
        return self._specs.get(name)

    def unload(self, name: str) -> None:
        with self._lock:
            engine = self._engines.pop(name, None)
            self._specs.pop(name, None)
        if engine is not None:
            engine.stop()

    def stats(self) -> dict[str, dict]:
        return {name: engine.stats() for name, engine in self.loaded().items()}


def _worker_engine_options() -> dict:
    """Engine options every deployment on this worker shares, from the settings (none when
    running outside Django)."""
    from django.conf import settings

    if not settings.configured:
        return {}
    return {"kv_memory_fraction": getattr(settings, "ENGINE_KV_MEMORY_FRACTION", None),
            "cuda_graphs": getattr(settings, "ENGINE_CUDA_GRAPHS", True)}


def preload_names() -> list[str]:
    """The deployments INFERENCE_PRELOAD asks this worker process to load as it starts."""
    return [name for name in os.environ.get("INFERENCE_PRELOAD", "").split(",") if name]


host = EngineHost()
