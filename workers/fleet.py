"""The fleet's side of Redis and Celery: queue depths, remote control, liveness, request progress.

Everything here talks to the broker (Redis), not the database:

- queue depths: the length of a deployment's Celery queue (kombu keeps one Redis list per queue
  and priority);
- remote control: ``fleet_load`` / ``fleet_unload`` (commands of ``workers.agent``) and Celery's own
  ``cancel_consumer``; a worker adds its consumer itself, with ``add_consumer``, once its model is
  loaded;
- liveness: each worker process refreshes ``fleet:alive:<instance>`` with every heartbeat;
- request progress: where each request got to (accepted, started, streaming, finished) and on which
  worker process, so that a request whose worker died is redelivered at once when nothing of it
  reached the client, or failed with a clear error when part of it did; never both, never neither.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from datetime import datetime, timezone

import redis
from django.conf import settings
from kombu.transport.redis import Channel as KombuChannel

from inference_platform.celery import DEPLOYMENT_QUEUE_PREFIX, app, deployment_queue

from .cancellation import MARK_TTL_S, mark_key
from .dispatch import longest_wait, serving_key, waiting_key

log = logging.getLogger(__name__)

TICK_TASK = "workers.fleet_tick"
RUN_INFERENCE = "workers.run_inference"
# kombu's Redis transport: a queue is a list per priority step; the unacked messages live in a hash.
PRIORITY_SEPARATOR = "\x06\x16"
PRIORITY_STEPS = (0, 3, 6, 9)

STAGE_ACCEPTED, STAGE_STARTED, STAGE_STREAMING, STAGE_FINISHED = "accepted", "started", "streaming", "finished"
# Its usage event has left for billing; only its final reply may not have reached the client.
STAGE_BILLED = "billed"
DONE_STAGES = (STAGE_BILLED, STAGE_FINISHED)
WORKER_LOST_CODE = "worker_lost"

_client: redis.Redis | None = None
_client_lock = threading.Lock()


def client() -> redis.Redis:
    global _client
    with _client_lock:
        if _client is None:
            _client = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True, socket_timeout=10,
                                           socket_connect_timeout=5, health_check_interval=30)
        return _client


def _alive_key(instance: str) -> str:
    return f"fleet:alive:{instance}"


def _inflight_key(instance: str) -> str:
    return f"fleet:inflight:{instance}"


def _progress_key(request_id: str) -> str:
    return f"inference:progress:{request_id}"


def progress_ttl() -> int:
    """Kept past any redelivery: twice the visibility timeout, at least an hour."""
    visibility = int(settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("visibility_timeout", 3600))
    return max(2 * visibility, 3600)


def liveness_ttl() -> int:
    return max(1, int(settings.FLEET_HEARTBEAT_SECONDS * settings.FLEET_MISSED_HEARTBEATS + 0.999))


# ------------------------------------------------------------------------------- queue depths


def queue_lists(queue: str) -> list[str]:
    return [queue if step == 0 else f"{queue}{PRIORITY_SEPARATOR}{step}" for step in PRIORITY_STEPS]


def queue_depths(names) -> dict[str, int]:
    """Messages waiting (not yet taken by a worker) on each deployment's queue."""
    names = list(names)
    if not names:
        return {}
    pipe = client().pipeline(transaction=False)
    for name in names:
        for key in queue_lists(deployment_queue(name)):
            pipe.llen(key)
    lengths = pipe.execute()
    steps = len(PRIORITY_STEPS)
    return {name: sum(lengths[i * steps:(i + 1) * steps]) for i, name in enumerate(names)}


def waiting_counts(names) -> dict[str, int]:
    """Requests someone waits for (admitted, no first token yet: ``dispatch.waiting_key``) per
    deployment. Its queue may hold more: messages of requests given up on, which a worker skips."""
    names = list(names)
    if not names:
        return {}
    since = int((time.time() - longest_wait()) * 1000)
    pipe = client().pipeline(transaction=False)
    for name in names:
        pipe.zcount(waiting_key(name), since, "+inf")
    return dict(zip(names, (int(count) for count in pipe.execute())))


def awaited_depth(*, queued: int, engine_waiting: int, awaited: int) -> int:
    """A deployment's waiting requests: what waits on its queue and in its engines, but no more
    than the requests someone still waits for (``waiting_counts``): a queue keeps the messages of
    requests given up on until a worker skips them, and they must not load a model for nobody."""
    return min(queued + engine_waiting, awaited)


# ------------------------------------------------------------------------------ remote control


def send_load(*, hostname: str, spec: dict, trigger: str) -> None:
    """Ask a worker to load a deployment, then consume its queue (``workers.agent.fleet_load``)."""
    app.control.broadcast("fleet_load", arguments={"spec": spec, "trigger": trigger}, destination=[hostname],
                          reply=False)


def send_release(*, hostname: str, name: str) -> None:
    """Stop a worker consuming a deployment's queue, then unload it once its requests are done."""
    app.control.cancel_consumer(deployment_queue(name), destination=[hostname], reply=False)
    app.control.broadcast("fleet_unload", arguments={"name": name}, destination=[hostname], reply=False)


def trigger_tick() -> None:
    """Run the placement loop now (at most a few times a second, whoever asks)."""
    if client().set("fleet:wake", "1", nx=True, px=250):
        app.send_task(TICK_TASK, queue="default", expires=max(5.0, settings.FLEET_TICK_SECONDS * 5),
                      ignore_result=True)


PLACEMENT_LOCK = "fleet:placement"  # held by the one placement pass running (``TickLock``)


def forget_requests_of_a_stopped_platform() -> int:
    """For a Redis that kept its data while nothing used it (the embedded one's append-only file,
    across a stop of ``up``): the requests queued, held or waiting then had their clients'
    connections closed with the platform. Their deployment queues, unacknowledged deliveries and
    waiting counts (which a queue limit reads) go, and the placement lock; the billing queue stays,
    its usage events are money. How many requests went."""
    redis_client = client()
    forgotten = 0
    for key in list(redis_client.scan_iter(match=f"{DEPLOYMENT_QUEUE_PREFIX}*")):
        if redis_client.type(key) == "list":
            forgotten += redis_client.llen(key)
            redis_client.delete(key)
    # kombu's hash of deliveries not acknowledged: tag -> [message, exchange, routing key]
    unacked, unacked_index = KombuChannel.unacked_key, KombuChannel.unacked_index_key
    for tag, raw in list(redis_client.hscan_iter(unacked)):
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, IndexError, TypeError):
            continue
        if str(routing_key).startswith(DEPLOYMENT_QUEUE_PREFIX):
            redis_client.hdel(unacked, tag)
            redis_client.zrem(unacked_index, tag)
            forgotten += 1
    waiting = list(redis_client.scan_iter(match=waiting_key("*")))
    if waiting:
        redis_client.delete(*waiting)
    redis_client.delete(PLACEMENT_LOCK)
    return forgotten


class TickLock:
    """One placement loop at a time. A tick that finds it held leaves a note, and the holder runs
    once more, so that no wake-up is lost."""

    def __init__(self):
        self._lock = client().lock(PLACEMENT_LOCK, timeout=120, blocking=False)
        self.acquired = False

    def __enter__(self) -> "TickLock":
        self.acquired = bool(self._lock.acquire(blocking=False))
        if not self.acquired:
            client().set("fleet:tick-again", "1", ex=60)
        return self

    def again(self) -> bool:
        return bool(client().delete("fleet:tick-again"))

    def __exit__(self, *exc) -> None:
        if self.acquired:
            try:
                self._lock.release()
            except redis.exceptions.LockError:
                log.warning("the placement lock expired while a tick ran")


# ------------------------------------------------------------------------------------ liveness


def set_alive(instance: str, hostname: str) -> None:
    client().set(_alive_key(instance), hostname, ex=liveness_ttl())


def mark_serving(names) -> None:
    """This live process hosts these deployments' engines (see ``dispatch.serving_key``)."""
    names = list(names)
    if names:
        pipe = client().pipeline(transaction=False)
        for name in names:
            pipe.set(serving_key(name), "1", ex=liveness_ttl())
        pipe.execute()


def clear_alive(instance: str) -> None:
    client().delete(_alive_key(instance))


def instance_alive(instance: str | None) -> bool:
    return bool(instance) and bool(client().exists(_alive_key(instance)))


# ---------------------------------------------------------------------------- request progress


def track_received(instance: str, request_id: str, delivery_tag: str) -> None:
    """A worker process received a request (before it runs): remember its broker delivery tag."""
    pipe = client().pipeline(transaction=False)
    pipe.hset(_inflight_key(instance), request_id, delivery_tag)
    pipe.expire(_inflight_key(instance), progress_ttl())
    pipe.execute()


def held_count(instance: str) -> int:
    """How many requests the process ``instance`` took and has not finished."""
    return int(client().hlen(_inflight_key(instance)))


def untrack(instance: str, request_id: str) -> None:
    client().hdel(_inflight_key(instance), request_id)


def running_elsewhere(request_id: str, *, owner: str | None, instance: str) -> bool:
    """Whether a process other than ``instance`` runs the request: alive, and still holding it (one
    presumed dead and recovered holds it no more, even once it is back)."""
    return bool(owner) and owner != instance and instance_alive(owner) and bool(held_by(owner, [request_id]))


def held_by(instance: str, request_ids: list[str]) -> set[str]:
    """Which of these requests ``instance`` still holds. Recovery takes a dead process's requests
    out of its record (``recover_requests``), so a process that was only paused, and presumed dead,
    learns here which of its requests another worker now answers."""
    if not request_ids:
        return set()
    values = client().hmget(_inflight_key(instance), request_ids)
    return {request_id for request_id, value in zip(request_ids, values) if value is not None}


def claim(payload: dict, *, instance: str, hostname: str) -> dict:
    """Record that ``instance`` runs this request; returns the previous record ({} the first time)."""
    key = _progress_key(payload["request_id"])
    r = client()
    previous = r.hgetall(key)
    if previous and (previous.get("stage") in DONE_STAGES
                     or running_elsewhere(payload["request_id"], owner=previous.get("instance"), instance=instance)):
        return previous  # done, or still running on another worker: the caller drops this copy
    deployment = payload.get("deployment") or {}
    record = {
        "instance": instance, "worker": hostname, "reply": payload.get("reply_channel", ""),
        "organization_id": payload.get("organization_id") or "", "api_key_id": payload.get("api_key_id") or "",
        "deployment_id": deployment.get("id") or "", "deployment": deployment.get("name", ""),
        "model": deployment.get("model", ""),
        "billing_id": payload.get("billing_id") or payload["request_id"], "endpoint": payload.get("endpoint") or "",
    }
    if not previous:
        record["stage"] = STAGE_ACCEPTED
    pipe = r.pipeline(transaction=False)
    pipe.hset(key, mapping=record)
    pipe.expire(key, progress_ttl())
    pipe.execute()
    return previous


def set_stage(request_id: str, stage: str, **fields) -> None:
    client().hset(_progress_key(request_id), mapping={"stage": stage, **{k: str(v) for k, v in fields.items()}})


def set_stages(request_ids: list[str], stage: str) -> None:
    """``set_stage`` for many requests in one round trip."""
    pipe = client().pipeline(transaction=False)
    for request_id in request_ids:
        pipe.hset(_progress_key(request_id), "stage", stage)
    pipe.execute()


def finish(request_id: str, *, instance: str) -> None:
    pipe = client().pipeline(transaction=False)
    pipe.hset(_progress_key(request_id), "stage", STAGE_FINISHED)
    pipe.hdel(_inflight_key(instance), request_id)
    pipe.execute()


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def fail_interrupted(request_id: str, record: dict, *, reason: str) -> bool:
    """Tell the waiting client that its request died with its worker after part of the answer
    reached it, and record it for billing as failed (no output counted: the tokens produced were
    lost with the worker, so the request is free). Once per request; False if already done."""
    r = client()
    if not r.hsetnx(_progress_key(request_id), "failed", "1"):
        return False
    r.hset(_progress_key(request_id), "stage", STAGE_FINISHED)
    r.set(mark_key(request_id), "1", ex=MARK_TTL_S)  # a copy redelivered later is dropped
    message = (f"The worker running this request stopped ({reason}) after part of the answer was sent; "
               "the request was interrupted and is not billed. Retry it.")
    _send_error(record.get("reply", ""), status=503, message=message, code=WORKER_LOST_CODE)
    organization_id = _int_or_none(record.get("organization_id"))
    if organization_id is not None and record.get("model"):
        from .inference import emit_usage

        try:
            emit_usage({
                "request_id": record.get("billing_id") or request_id, "organization_id": organization_id,
                "api_key_id": _int_or_none(record.get("api_key_id")),
                "deployment_id": _int_or_none(record.get("deployment_id")),
                "deployment": record.get("deployment", ""), "model": record["model"],
                "prompt_tokens": _int_or_none(record.get("prompt_tokens")) or 0, "cached_prompt_tokens": 0,
                "completion_tokens": 0, "status": "failed", "queue_ms": None, "ttft_ms": None, "latency_ms": None,
                "finished_at": datetime.now(timezone.utc).isoformat(),
                **({"endpoint": record["endpoint"]} if record.get("endpoint") else {}),
            })
        except Exception:
            log.exception("could not record the interrupted request %s for billing", request_id)
    return True


def tell_billed(request_id: str, record: dict, *, reason: str) -> None:
    """The worker died after billing the whole answer but before its last message reached the
    client: send that message (kept in the progress record) on its behalf, so the client ends as
    it would have. Once per request."""
    r = client()
    if not r.hsetnx(_progress_key(request_id), "told", "1"):
        return
    r.hset(_progress_key(request_id), "stage", STAGE_FINISHED)
    try:
        finished = json.loads(record.get("finished") or "")
    except ValueError:
        finished = None
    if isinstance(finished, dict) and finished.get("type") == "inference.finished":
        _send(record.get("reply", ""), finished)
    else:
        _send_error(record.get("reply", ""), status=503, code=WORKER_LOST_CODE,
                    message=f"The worker running this request stopped ({reason}) after the whole answer was "
                            "produced and billed; only the end of the stream was lost.")


def _send_error(reply: str, *, status: int, message: str, code: str) -> None:
    _send(reply, {"type": "inference.error", "status": status, "message": message, "param": None, "code": code})


def _send(reply: str, message: dict) -> None:
    if not reply:
        return
    from .relay import sender

    try:
        sender().send(reply, message)
    except Exception as exc:  # the client is gone: nothing to tell
        log.info("could not tell %s: %s", reply, exc)


def recover_requests(*, instance: str, reason: str) -> dict[str, list[tuple[str, str]]]:
    """The requests a dead worker process held: redeliver those the client has seen nothing of
    (Celery/kombu's own restore of the unacknowledged message, at the head of its queue), fail the
    ones it had started streaming. Returns {"redelivered": [...], "interrupted": [...]}, each a list
    of (request id, deployment name)."""
    r = client()
    held = r.hgetall(_inflight_key(instance))
    done: dict[str, list[tuple[str, str]]] = {"redelivered": [], "interrupted": []}
    if not held:
        return done
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        qos = channel.qos
        for request_id, tag in held.items():
            record = r.hgetall(_progress_key(request_id))
            stage = record.get("stage")
            if stage == STAGE_FINISHED:
                continue
            if stage in (STAGE_STREAMING, STAGE_BILLED):
                if stage == STAGE_BILLED:
                    tell_billed(request_id, record, reason=reason)
                elif fail_interrupted(request_id, record, reason=reason):
                    done["interrupted"].append((request_id, record.get("deployment", "")))
                # Drop the unacknowledged copy: nobody should run it again.
                r.zrem(channel.unacked_index_key, tag)
                r.hdel(channel.unacked_key, tag)
            else:
                qos.restore_by_tag(tag, leftmost=False)  # rpush: the next message taken from the queue
                done["redelivered"].append((request_id, record.get("deployment", "")))
    r.delete(_inflight_key(instance))
    return done


def _decode_task(raw: str) -> tuple[str, dict] | None:
    """(task name, payload) of a queued Celery message, or None."""
    try:
        message = json.loads(raw)
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return message.get("headers", {}).get("task", ""), args[0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def fail_queued(name: str, *, message: str, code: str, status: int = 503) -> int:
    """Take every request still waiting on a deployment's queue and answer it with an error (a
    stopped, failed or deleted deployment); returns how many. Nothing ran, so nothing is billed."""
    r = client()
    failed = 0
    for key in queue_lists(deployment_queue(name)):
        while True:
            raw = r.rpop(key)
            if raw is None:
                break
            decoded = _decode_task(raw)
            if decoded is None or decoded[0] != RUN_INFERENCE:
                log.warning("dropped an unreadable message from %s", key)
                continue
            payload = decoded[1]
            request_id = payload.get("request_id", "")
            if request_id:
                r.set(mark_key(request_id), "1", ex=MARK_TTL_S)
            _send_error(payload.get("reply_channel", ""), status=status, message=message, code=code)
            failed += 1
    return failed


def spec_hash(spec: dict) -> str:
    """A short fingerprint of a deployment's engine settings: a replica loaded with other settings
    is replaced."""
    import hashlib

    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:32]
