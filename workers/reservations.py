"""How many requests a worker process takes from the broker before it runs them.

Celery's prefetch is one count per process, over all its queues: by default its thread count (64),
far more than an engine runs at once. What an engine could not run yet waited inside it, out of
reach of any other replica (one added to absorb a burst got none of it), and out of the queue depth
that the autoscaler and the deployment's queue limit read. So a process serving inference takes,
per deployment it hosts, what the engine batches plus a quarter more (the engine refills a
finished request's slot from those at once), and one message per other queue it consumes; the rest
waits on the queue, for whichever replica frees a slot first.

Celery re-reads the count between two turns of its consumer loop (``QoS.update``), so it can be
changed from any thread.
"""

from __future__ import annotations

import logging
import math
import threading

from inference_platform.celery import DEPLOYMENT_QUEUE_PREFIX

log = logging.getLogger(__name__)


def reserve_for(batch_size: int) -> int:
    """The requests a process takes for one deployment whose engine batches ``batch_size``."""
    batch_size = max(1, int(batch_size))
    return batch_size + max(1, math.ceil(batch_size / 4))


class Reservations:
    def __init__(self):
        self._lock = threading.Lock()
        self._consumer = None
        self._threads = 0  # Celery's own prefetch (threads × multiplier): never more than that; 0: unbounded
        self._batch_sizes: dict[str, int] = {}
        self._warned: set[str] = set()

    def attach(self, consumer) -> None:
        """The worker's Celery consumer, once it is ready: its prefetch is the ceiling."""
        with self._lock:
            self._consumer = consumer
            self._threads = int(getattr(consumer, "initial_prefetch_count", 0) or 0)
        self.apply()

    def serve(self, name: str, batch_size) -> None:
        """This process serves (or is loading) ``name``, batching up to ``batch_size`` requests."""
        try:
            batch_size = max(1, int(batch_size))
        except (TypeError, ValueError):
            return
        with self._lock:
            if self._batch_sizes.get(name) == batch_size:
                return
            self._batch_sizes[name] = batch_size
        self.apply()

    def forget(self, name: str) -> None:
        """``name`` is unloaded here."""
        with self._lock:
            if self._batch_sizes.pop(name, None) is None:
                return
        self.apply()

    def wanted(self) -> int:
        """The prefetch this process should have: Celery's own while it serves no inference (a
        billing or control worker)."""
        with self._lock:
            return self._wanted()

    def apply(self) -> None:
        """Set the consumer's prefetch to what the hosted deployments need. A reconnection starts
        from it (``initial_prefetch_count``; Celery's own reduction is off in the settings)."""
        with self._lock:  # two threads applying at once must not leave the older figure
            consumer = self._consumer
            qos = getattr(consumer, "qos", None)
            if qos is None:
                return
            wanted = self._wanted()
            if qos.value == wanted:
                return
            log.info("taking up to %s requests from the broker at once (was %s)", wanted or "any number of",
                     qos.value)
            consumer.initial_prefetch_count = wanted  # what Celery starts from after a reconnection
            qos.value = wanted  # read by the consumer loop, which applies it (QoS.update)

    def _wanted(self) -> int:
        if not self._batch_sizes:
            return self._threads
        task_consumer = getattr(self._consumer, "task_consumer", None)
        queues = [q.name for q in list(getattr(task_consumer, "queues", None) or [])]
        others = sum(1 for queue in queues if not queue.startswith(DEPLOYMENT_QUEUE_PREFIX))
        wanted = sum(reserve_for(size) for size in self._batch_sizes.values()) + others
        if self._threads and wanted > self._threads:
            self._warn_short_of_threads(wanted)
            return self._threads
        return wanted

    def _warn_short_of_threads(self, wanted: int) -> None:
        key = ",".join(f"{n}={b}" for n, b in sorted(self._batch_sizes.items()))
        if key in self._warned:
            return
        self._warned.add(key)
        log.warning("the deployments here batch up to %s requests, but this worker runs %d at once: start it "
                    "with --concurrency %d or more to fill their batches", key, self._threads, wanted)


reservations = Reservations()
