"""The fleet agent inside each Celery worker process.

- Heartbeats: a thread started when the worker is ready. Every FLEET_HEARTBEAT_SECONDS it refreshes
  the process's liveness key in Redis and, for a fleet worker (WORKER_SLOTS > 0), writes what it
  consumes and hosts through ``services.record_heartbeat`` (registering first).
- Remote control commands the placement loop sends: ``fleet_load`` (load the deployment's engine,
  then ``add_consumer`` its queue on this worker) and ``fleet_unload`` (stop consuming, wait for the
  requests taken to finish, unload). Loads and unloads of one deployment run one after the other.
- Around each request (``serve``): in-flight counts and idle time per deployment, a one-minute
  window of request figures for the metrics, and where the request got to, so that a redelivered
  copy neither repeats what the client already received nor runs twice.
- Fencing: a process that was only paused (stopped, swapping, a debugger) past its liveness may
  have been presumed dead, and its requests handed on. While that may be so, it checks before
  sending anything of a request, and once more before its next heartbeat revives it, that the
  request is still its own; one that is not (``Ticket.superseded``) is aborted, sent nothing more
  and billed nothing: the worker that took it over answers and bills it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

from celery.signals import task_received, worker_ready, worker_shutdown
from celery.worker import state as worker_state
from celery.worker.control import control_command
from django.conf import settings
from django.db import close_old_connections, connection

from inference_platform.celery import app, deployment_queue

from . import choices, fleet
from .inference import send_quietly
from .reservations import reservations
from .runtime import host, preload_names

log = logging.getLogger(__name__)

INSTANCE = uuid.uuid4().hex[:16]  # this run of this process
WINDOW_S = 60.0
MAX_SAMPLES = 400
RUN_INFERENCE = "workers.run_inference"


@dataclass(eq=False)
class Ticket:
    """One run of a request in this process."""

    request_id: str
    superseded: bool = False  # another worker took the request over: this run must stop quietly


class Figures:
    """One deployment's last minute on this worker."""

    def __init__(self):
        self.in_flight = 0
        self.last_active = time.time()
        self.done: deque = deque()  # (time, latency_ms, ttft_ms, prompt_tokens, completion_tokens, failed)
        self.steps: deque = deque()  # (time, steps, generated tokens), summed over this worker's engines
        self._engine = None  # the instance of the engine last seen
        self._base = (0, 0)  # what the earlier engines had done when the current one started
        self._total = (0, 0)

    def record(self, event: dict | None) -> None:
        if event is None:
            return
        self.done.append((time.time(), event.get("latency_ms"), event.get("ttft_ms"),
                          int(event.get("prompt_tokens") or 0), int(event.get("completion_tokens") or 0),
                          event.get("status") == "failed"))

    def _observe(self, now: float, engine: dict) -> None:
        """Snapshot the engine's counters, carried on across a reload so the window spans both."""
        if engine.get("instance") != self._engine:
            self._engine = engine.get("instance")
            self._base = self._total
            self.steps.append((now, *self._base))  # a new engine's counters start at zero
        self._total = (self._base[0] + int(engine.get("steps") or 0),
                       self._base[1] + int(engine.get("generated_tokens") or 0))
        self.steps.append((now, *self._total))

    def summary(self, now: float, engine: dict | None) -> dict:
        while self.done and now - self.done[0][0] > WINDOW_S:
            self.done.popleft()
        if engine:
            self._observe(now, engine)
        # The newest snapshot from before the window stays as its baseline.
        while len(self.steps) > 1 and now - self.steps[1][0] >= WINDOW_S:
            self.steps.popleft()
        done = list(self.done)
        steps = self.steps[-1][1] - self.steps[0][1] if self.steps else 0
        generated = self.steps[-1][2] - self.steps[0][2] if self.steps else 0
        return {
            "window_s": WINDOW_S,
            "requests": len(done),
            "failed": sum(1 for d in done if d[5]),
            "prompt_tokens": sum(d[3] for d in done),
            "completion_tokens": sum(d[4] for d in done),
            "latencies_ms": [d[1] for d in done if d[1] is not None][-MAX_SAMPLES:],
            "ttft_ms": [d[2] for d in done if d[2] is not None][-MAX_SAMPLES:],
            "steps": max(0, steps),
            "generated_tokens": max(0, generated),
        }


class _ProgressSend:
    """The reply sender of one request: records where the request got to before the client can
    see it, and leaves out what a redelivered copy must not send twice. (Its first token's
    stage is recorded by the relay that sends the tokens.)"""

    def __init__(self, send, request_id: str, skip: set[str]):
        self._send, self._id, self._skip = send, request_id, set(skip)

    def __call__(self, channel: str, message: dict) -> None:
        kind = message.get("type")
        if kind in self._skip:
            self._skip.discard(kind)
            return
        if kind == "inference.finished":  # the run emitted the usage event before it: see inference.run
            # Kept, so that if this process dies before the client has it, recovery can send it.
            self._stage(fleet.STAGE_BILLED, finished=json.dumps(message))
        self._send(channel, message)
        if kind == "inference.started":
            self._stage(fleet.STAGE_STARTED, prompt_tokens=message.get("prompt_tokens", 0))

    def _stage(self, stage: str, **fields) -> None:
        try:
            fleet.set_stage(self._id, stage, **fields)
        except Exception:  # the answer matters more than the record of its progress
            log.exception("could not record that %s is %s", self._id, stage)


class _Serial:
    """Runs the operations of each deployment one after the other, on a thread per deployment."""

    def __init__(self):
        self._queues: dict[str, deque] = {}
        self._lock = threading.Lock()

    def submit(self, name: str, operation) -> None:
        with self._lock:
            queue = self._queues.get(name)
            if queue is None:
                queue = self._queues[name] = deque()
                threading.Thread(target=self._run, args=(name,), name=f"fleet-{name}", daemon=True).start()
            queue.append(operation)

    def _run(self, name: str) -> None:
        try:
            while True:
                with self._lock:
                    queue = self._queues[name]
                    if not queue:
                        del self._queues[name]
                        return
                    operation = queue.popleft()
                try:
                    operation()
                except Exception:
                    log.exception("fleet operation on %s failed", name)
        finally:
            connection.close()


def detect_device() -> tuple[str, str, int]:
    """(kind, name, memory in bytes): the GPU this process uses, or the CPU and the machine's RAM."""
    try:
        import torch

        if torch.cuda.is_available():
            index = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            return "cuda", props.name, int(props.total_memory)
    except Exception:  # no usable torch/CUDA: a CPU worker
        log.debug("no CUDA device", exc_info=True)
    import psutil

    return "cpu", "cpu", int(psutil.virtual_memory().total)


class Agent:
    def __init__(self):
        self.hostname = ""
        self.slots = 0
        self.consumer = None
        self.lock = threading.Lock()
        self.figures: dict[str, Figures] = {}
        self.hosted: dict[str, dict] = {}  # name -> state, deployment_id, spec_hash, load_seconds, error, origin
        self.running: dict[str, Ticket] = {}
        self.serial = _Serial()
        self._stopping = threading.Event()
        self._registered = False
        self._alive_since: float | None = None  # when the last liveness refresh that succeeded began

    # --------------------------------------------------------------------------- lifecycle

    def start(self, consumer) -> None:
        self.consumer = consumer
        self.hostname = consumer.hostname
        self.slots = int(settings.WORKER_SLOTS)
        preloads = preload_names()
        for name in preloads:  # their queues are consumed from the start: reserve little until their specs are read
            reservations.serve(name, 1)
        reservations.attach(consumer)
        threading.Thread(target=self._beat_forever, name="fleet-heartbeat", daemon=True).start()
        if self.slots > 0:
            for name in preloads:
                self.serial.submit(name, lambda name=name: self._preload(name))

    def stop(self) -> None:
        self._stopping.set()
        try:
            fleet.clear_alive(INSTANCE)
            if self.slots > 0 and self._registered:
                from .services import worker_stopped

                worker_stopped(hostname=self.hostname, instance=INSTANCE)
        except Exception:
            log.exception("could not report the shutdown of %s", self.hostname)

    # --------------------------------------------------------------------------- heartbeats

    def _beat_forever(self) -> None:
        device = None
        interval = float(settings.FLEET_HEARTBEAT_SECONDS)
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                if self.presumed_dead():  # before the refresh revives it: see the module's docstring
                    with self.lock:
                        tickets = list(self.running.values())
                    self.check_tickets(tickets)
                fleet.set_alive(INSTANCE, self.hostname)
                self._alive_since = started  # the key was set after this: it expires after started + TTL
                fleet.mark_serving(host.loaded())
                reservations.apply()  # a safety net: serve/forget apply it, and a reconnection starts from it
                if self.slots > 0:
                    device = device or detect_device()
                    self._beat(device)
            except Exception:
                log.exception("heartbeat of %s failed; trying again", self.hostname)
                connection.close()
            self._stopping.wait(max(0.05, interval - (time.monotonic() - started)))

    def presumed_dead(self) -> bool:
        """Whether the placement loop may have found this process's liveness expired (and handed
        its requests on): its last refresh is older than three quarters of the liveness TTL."""
        return self._alive_since is not None and time.monotonic() - self._alive_since > 0.75 * fleet.liveness_ttl()

    def check_tickets(self, tickets: list[Ticket]) -> None:
        """Mark superseded the runs whose request this process holds no more (recovery took it):
        only possible, so only asked of Redis, while this process may be presumed dead."""
        if not self.presumed_dead():
            return
        open_tickets = [ticket for ticket in tickets if not ticket.superseded]
        held = fleet.held_by(INSTANCE, [ticket.request_id for ticket in open_tickets])
        for ticket in open_tickets:
            if ticket.request_id not in held:
                ticket.superseded = True
                log.warning("request %s was handed to another worker while this one was presumed dead; "
                            "stopping this copy", ticket.request_id)

    def _beat(self, device) -> None:
        from .services import record_heartbeat, register_worker

        close_old_connections()
        queues, deployments = self.report()
        if not self._registered:
            register_worker(hostname=self.hostname, instance=INSTANCE, pid=os.getpid(), device_kind=device[0],
                            device_name=device[1], device_memory_bytes=device[2], slots=self.slots, queues=queues)
            self._registered = True
        depths = fleet.queue_depths(deployments)
        worker = record_heartbeat(hostname=self.hostname, instance=INSTANCE, queues=queues, queue_depths=depths,
                                  deployments=deployments)
        if worker is None:  # marked gone and replaced by a newer row, or the table was emptied
            self._registered = False
            return
        with self.lock:  # a preload is offered for adoption once; later it is the placement's to keep
            for name, report in deployments.items():
                if report.get("origin") == "preload" and report.get("state") == "ready" and name in self.hosted:
                    self.hosted[name]["origin"] = ""

    def report(self) -> tuple[list[str], dict[str, dict]]:
        """The queues consumed, and per deployment hosted: state, settings, in-flight requests, the
        engine's statistics and the last minute's figures."""
        now = time.time()
        consumer = self.consumer
        task_consumer = getattr(consumer, "task_consumer", None)
        queues = sorted(q.name for q in list(getattr(task_consumer, "queues", None) or []))
        stats = host.stats()
        deployments = {}
        with self.lock:
            for name in set(self.hosted) | set(stats) | {n for n, f in self.figures.items() if f.in_flight}:
                hosted = dict(self.hosted.get(name) or {})
                spec = host.spec(name) or {}
                if not hosted:  # loaded outside the fleet (a request, or a preload by name)
                    hosted = {"state": "ready" if name in stats else "serving", "deployment_id": spec.get("id"),
                              "spec_hash": fleet.spec_hash(spec) if spec else "", "origin": "preload",
                              "load_seconds": host.load_seconds.get(name)}
                figures = self.figures.setdefault(name, Figures())
                deployments[name] = {
                    **hosted,
                    "in_flight": figures.in_flight,
                    "last_active": figures.last_active,
                    "engine": stats.get(name) or {},
                    "settings": {k: spec.get(k) for k in ("batch_window_ms", "max_batch_size", "dtype")} if spec else {},
                    **figures.summary(now, stats.get(name)),
                }
        return queues, deployments

    # ---------------------------------------------------------------------- load and unload

    def submit_load(self, spec: dict, trigger: str) -> None:
        with self.lock:
            current = self.hosted.get(spec["name"])
            if current and current.get("state") in ("loading", "ready") and \
                    current.get("spec_hash") == fleet.spec_hash(spec):
                if current.get("state") == "ready":  # a repeated command: just report it again
                    self.serial.submit(spec["name"], lambda: self._report_loaded(spec, current.get("load_seconds") or 0.0))
                return
            self.hosted[spec["name"]] = {"state": "loading", "deployment_id": spec["id"],
                                         "spec_hash": fleet.spec_hash(spec), "origin": trigger}
        self.serial.submit(spec["name"], lambda: self._load(spec, trigger))

    def submit_unload(self, name: str) -> None:
        with self.lock:
            if name in self.hosted:
                self.hosted[name]["state"] = "unloading"
            else:
                self.hosted[name] = {"state": "unloading", "origin": ""}
        self.serial.submit(name, lambda: self._unload(name))

    def _preload(self, name: str) -> None:
        from models_catalog.models import Deployment

        from .dispatch import engine_spec
        from .services import replica_failed

        deployment = Deployment.objects.filter(name=name).select_related("model").first()
        if deployment is None:
            log.warning("INFERENCE_PRELOAD names %s, which does not exist", name)
            return
        try:
            spec = engine_spec(deployment)  # its weights' path resolved: they may be gone
        except Exception as exc:
            log.exception("could not preload %s", name)
            replica_failed(hostname=self.hostname, instance=INSTANCE, deployment_id=deployment.pk, name=name,
                           error=str(exc)[:1000])
            return
        with self.lock:
            self.hosted[name] = {"state": "loading", "deployment_id": spec["id"], "spec_hash": fleet.spec_hash(spec),
                                 "origin": "preload"}
        self._load(spec, "preload")

    def _load(self, spec: dict, trigger: str) -> None:
        from .services import replica_failed

        name = spec["name"]
        with self.lock:
            if not self._still_wanted(spec):
                return  # unloaded meanwhile, or other settings asked for since: the step queued after this loads those
        reservations.serve(name, spec.get("max_batch_size"))
        loaded = host.spec(name)
        if loaded is not None and loaded != spec:
            # Other settings, or a deleted deployment's name taken again: the old engine finishes
            # what it took, then makes room.
            app.control.cancel_consumer(deployment_queue(name), destination=[self.hostname], reply=False)
            self._drain(name)
            host.unload(name)
        started = time.monotonic()
        try:
            host.engine_for(spec)
        except Exception as exc:
            log.exception("could not load %s", name)
            with self.lock:
                self.hosted[name] = {**self.hosted.get(name, {}), "state": "failed", "error": str(exc)[:500]}
            replica_failed(hostname=self.hostname, instance=INSTANCE, deployment_id=spec["id"], name=name,
                           error=str(exc)[:1000])
            with self.lock:
                self.hosted.pop(name, None)
            reservations.forget(name)
            return
        seconds = host.load_seconds.get(name) or (time.monotonic() - started)
        with self.lock:
            if not self._still_wanted(spec):
                # An unload or other settings came during the load: what is queued after this
                # step must find the deployment not ready (and not consuming) to do its part.
                return
            self.hosted[name] = {**self.hosted.get(name, {}), "state": "ready", "load_seconds": round(seconds, 3)}
            self.figures.setdefault(name, Figures()).last_active = time.time()
        app.control.add_consumer(deployment_queue(name), destination=[self.hostname], reply=False)
        self._report_loaded(spec, seconds)

    def _still_wanted(self, spec: dict) -> bool:
        """Whether this worker is still to load ``spec``: its deployment is loading, with these
        settings. Call with ``self.lock`` held."""
        hosted = self.hosted.get(spec["name"]) or {}
        return hosted.get("state") == "loading" and hosted.get("spec_hash") == fleet.spec_hash(spec)

    def _report_loaded(self, spec: dict, seconds: float) -> None:
        from .services import replica_loaded

        wanted = replica_loaded(hostname=self.hostname, instance=INSTANCE, deployment_id=spec["id"],
                                name=spec["name"], seconds=round(seconds, 3), spec_hash=fleet.spec_hash(spec))
        with self.lock:
            origin = (self.hosted.get(spec["name"]) or {}).get("origin")
        if not wanted and origin != "preload":
            log.info("%s is no longer wanted here: unloading it", spec["name"])
            self.submit_unload(spec["name"])

    def _busy(self, name: str) -> bool:
        with self.lock:
            figures = self.figures.get(name)
            if figures is not None and figures.in_flight:
                return True
        queue = deployment_queue(name)
        for _ in range(3):
            try:
                return any((r.delivery_info or {}).get("routing_key") == queue
                           for r in list(worker_state.reserved_requests))
            except RuntimeError:  # the set changed while we read it
                continue
        return True

    def _drain(self, name: str) -> None:
        """Wait (up to FLEET_DRAIN_TIMEOUT) until the requests this process took for ``name`` end."""
        deadline = time.monotonic() + float(settings.FLEET_DRAIN_TIMEOUT)
        time.sleep(0.3)  # let the consumer act on the cancel before counting what it took
        while self._busy(name) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _unload(self, name: str) -> None:
        with self.lock:
            if (self.hosted.get(name) or {}).get("state") != "unloading":
                return  # loaded again meanwhile
        # A load finished after the placement's cancel_consumer may have added the queue back.
        app.control.cancel_consumer(deployment_queue(name), destination=[self.hostname], reply=False)
        self._drain(name)
        with self.lock:
            if (self.hosted.get(name) or {}).get("state") != "unloading":
                return
        host.unload(name)
        reservations.forget(name)
        with self.lock:
            if (self.hosted.get(name) or {}).get("state") == "unloading":
                self.hosted.pop(name, None)
        log.info("unloaded %s", name)

    # ------------------------------------------------------------------------------ requests

    def serve(self, payload: dict, *, hostname: str, send, run):
        """Run one request through ``run(send)`` (``workers.inference.run``) with the bookkeeping."""
        request_id = payload["request_id"]
        name = payload["deployment"]["name"]
        reservations.serve(name, payload["deployment"].get("max_batch_size"))
        previous = fleet.claim(payload, instance=INSTANCE, hostname=hostname)
        skip: set[str] = set()
        if previous:
            stage, owner = previous.get("stage"), previous.get("instance")
            if stage == fleet.STAGE_BILLED and owner != INSTANCE and not fleet.instance_alive(owner):
                fleet.tell_billed(request_id, previous, reason=f"{previous.get('worker') or 'a worker'} stopped")
                return None
            if stage in fleet.DONE_STAGES:
                return None
            running = self.running.get(request_id)
            if owner == INSTANCE and running is not None and not running.superseded:
                return None  # a copy of a request this process is running
            if fleet.running_elsewhere(request_id, owner=owner, instance=INSTANCE):
                return None  # still running on a live worker
            if stage == fleet.STAGE_STREAMING:
                fleet.fail_interrupted(request_id, previous, reason=f"{previous.get('worker') or 'a worker'} stopped")
                return None
            skip.add("inference.accepted")
            if stage == fleet.STAGE_STARTED:
                skip.add("inference.started")
                if payload.get("stream") is False:  # the gateway may hold tokens of the first run: void them
                    send_quietly(send, payload["reply_channel"], {"type": "inference.restarted"})
            log.info("running %s again: its worker %s stopped at %s", request_id, previous.get("worker"), stage)
        ticket = Ticket(request_id)
        with self.lock:
            figures = self.figures.setdefault(name, Figures())
            figures.in_flight += 1
            figures.last_active = time.time()
            self.running[request_id] = ticket
        event = None
        try:
            with reservations.holding(name, choices.sequences(payload)):
                event = run(_ProgressSend(send, request_id, skip), ticket)
            return event
        finally:
            with self.lock:
                figures.in_flight -= 1
                figures.last_active = time.time()
                figures.record(event)
                if self.running.get(request_id) is ticket:
                    del self.running[request_id]
            if not ticket.superseded:  # else the request's record is its new worker's to keep
                try:
                    fleet.finish(request_id, instance=INSTANCE)
                except Exception:
                    log.exception("could not record the end of %s", request_id)


agent = Agent()


@worker_ready.connect
def _start_agent(sender=None, **kwargs) -> None:
    agent.start(sender)


@worker_shutdown.connect
def _stop_agent(sender=None, **kwargs) -> None:
    agent.stop()


@task_received.connect
def _track_received(sender=None, request=None, **kwargs) -> None:
    """Remember which broker delivery holds each request this process took, so that the placement
    loop can hand it to another worker at once if this process dies."""
    if request is None or request.name != RUN_INFERENCE:
        return
    try:
        fleet.track_received(INSTANCE, request.id, request.message.delivery_tag)
    except Exception:
        log.exception("could not track %s", request.id)


@control_command(args=[("spec", dict), ("trigger", str)], signature="<spec> <trigger>")
def fleet_load(state, spec=None, trigger="initial", **kwargs):
    """Load a deployment's engine, then consume its queue."""
    if not isinstance(spec, dict) or "name" not in spec:
        return {"error": "fleet_load needs the deployment's engine spec"}
    agent.submit_load(spec, trigger)
    return {"ok": f"loading {spec['name']}"}


@control_command(args=[("name", str)], signature="<name>")
def fleet_unload(state, name="", **kwargs):
    """Stop consuming a deployment's queue and unload it once its requests are done."""
    if not name:
        return {"error": "fleet_unload needs a deployment name"}
    agent.submit_unload(name)
    return {"ok": f"unloading {name}"}
