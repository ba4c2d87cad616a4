"""How many requests a worker process takes from the broker before it runs them.

Celery's prefetch is one count per process, over all its queues: by default its thread count (64),
far more than an engine runs at once. What an engine could not run yet waited inside it, out of
reach of any other replica (one added to absorb a burst got none of it), and out of the queue depth
that the autoscaler and the deployment's queue limit read. So a process serving inference takes,
per deployment it hosts, what the engine batches plus a quarter more (the engine refills a
finished request's slot from those at once), and one message per other queue it consumes; the rest
waits on the queue, for whichever replica frees a slot first.

A request with several answers (``n``, a batch of prompts) is several sequences in the engine but
one message: while it runs, its deployment's share is that much lower (``holding``), so that the
process does not take a batch's worth of such requests; the other deployments' shares stay.

Celery re-reads the count between two turns of its consumer loop (``QoS.update``), so it can be
changed from any thread.
"""

from __future__ import annotations

import logging
import math
import threading
from contextlib import contextmanager

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
        self._held: dict[str, int] = {}  # per deployment: its engine's sequences beyond one per running request
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

    @contextmanager
    def holding(self, name: str, sequences: int):
        """While a request of ``sequences`` engine sequences runs for ``name`` here: its message counts
        for them all."""
        extra = max(0, int(sequences) - 1)
        if not extra:
            yield
            return
        self._hold(name, extra)
        try:
            yield
        finally:
            self._hold(name, -extra)

    def _hold(self, name: str, extra: int) -> None:
        with self._lock:
            held = self._held.get(name, 0) + extra
            if held:
                self._held[name] = held
            else:
                self._held.pop(name, None)
        self.apply(quiet=True)

    def wanted(self) -> int:
        """The prefetch this process should have: Celery's own while it serves no inference (a
        billing or control worker)."""
        with self._lock:
            return self._wanted()

    def apply(self, *, quiet: bool = False) -> None:
        """Set the consumer's prefetch to what the hosted deployments need. A reconnection starts
        from it (``initial_prefetch_count``; Celery's own reduction is off in the settings).
        ``quiet``: a change of every request with several answers, logged at debug level."""
        with self._lock:  # two threads applying at once must not leave the older figure
            consumer = self._consumer
            qos = getattr(consumer, "qos", None)
            if qos is None:
                return
            wanted = self._wanted()
            if qos.value == wanted:
                return
            log.log(logging.DEBUG if quiet else logging.INFO, "taking up to %s requests from the broker at once "
                    "(was %s)", wanted or "any number of", qos.value)
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
        # A deployment's share less its running requests' extra sequences: down to none, not below.
        shares = sum(max(0, reserve_for(size) - self._held.get(name, 0)) for name, size in self._batch_sizes.items())
        taken = shares + others
        return max(1, min(taken, self._threads) if self._threads else taken)  # never 0, which is "no limit"

    def _warn_short_of_threads(self, wanted: int) -> None:
        key = ",".join(f"{n}={b}" for n, b in sorted(self._batch_sizes.items()))
        if key in self._warned:
            return
        self._warned.add(key)
        log.warning("the deployments here batch up to %s requests, but this worker runs %d at once: start it "
                    "with --concurrency %d or more to fill their batches", key, self._threads, wanted)


reservations = Reservations()
