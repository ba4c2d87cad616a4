"""Requests of a worker that died: real Celery messages in the real Redis broker, taken without an
acknowledgement as a worker takes them, then recovered: redelivered when the client saw nothing,
failed with a clear error when it had started streaming. And the worker side of a redelivery:
what a second copy of a request sends, or whether it runs at all."""

from __future__ import annotations

import time
import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from inference_platform.celery import app
from workers import dispatch, fleet, services
from workers.agent import Agent
from workers.cancellation import mark_key
from workers.models import FleetEvent, Worker


def _payload(name: str, reply: str = "") -> dict:
    return {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "reply_channel": reply,
            "deployment": {"id": None, "name": name, "model": "m"}, "organization_id": None}


@pytest.fixture
def taken():
    """Publish a request on a deployment's queue and take it without acknowledging it (a worker
    that received it); the broker connection stays open until the end of the test."""
    connections, names = [], []

    def take(payload: dict):
        name = payload["deployment"]["name"]
        names.append(name)
        dispatch.enqueue(payload)
        connection = app.connection_for_read()
        connections.append(connection)
        message = connection.SimpleQueue(f"deployment.{name}").get(timeout=5)
        assert message.headers["id"] == payload["request_id"]
        return message.delivery_tag

    yield take
    for connection in connections:
        connection.release()
    for name in names:
        fleet.client().delete(*fleet.queue_lists(f"deployment.{name}"))


def _dead_worker() -> Worker:
    return services.register_worker(hostname=f"dead-{uuid.uuid4().hex[:6]}@nowhere", instance=uuid.uuid4().hex[:16],
                                    pid=1, device_kind="cpu", device_name="cpu", device_memory_bytes=0, slots=1,
                                    queues=["default"])


@pytest.mark.django_db
def test_a_request_the_client_saw_nothing_of_is_redelivered_at_once(taken):
    worker = _dead_worker()
    name = f"r-{uuid.uuid4().hex[:6]}"
    payload = _payload(name)
    tag = taken(payload)
    fleet.track_received(worker.instance, payload["request_id"], tag)
    fleet.claim(payload, instance=worker.instance, hostname=worker.hostname)
    fleet.set_stage(payload["request_id"], fleet.STAGE_STARTED, prompt_tokens=12)
    assert fleet.queue_depths([name]) == {name: 0}

    recovered = services.mark_worker_gone(worker=worker, reason="no heartbeat for 5s")
    assert recovered == {"redelivered": [(payload["request_id"], name)], "interrupted": []}
    assert fleet.queue_depths([name]) == {name: 1}  # back on its queue, not after the visibility timeout
    assert FleetEvent.objects.filter(kind="redelivered", message=payload["request_id"]).exists()


@pytest.mark.django_db
def test_a_request_that_was_streaming_fails_with_a_clear_error_and_is_not_run_again(taken):
    worker = _dead_worker()
    layer = get_channel_layer()
    reply = async_to_sync(layer.new_channel)()
    name = f"r-{uuid.uuid4().hex[:6]}"
    payload = _payload(name, reply)
    tag = taken(payload)
    fleet.track_received(worker.instance, payload["request_id"], tag)
    fleet.claim(payload, instance=worker.instance, hostname=worker.hostname)
    fleet.set_stage(payload["request_id"], fleet.STAGE_STREAMING)

    recovered = services.mark_worker_gone(worker=worker, reason="no heartbeat for 5s")
    assert recovered["interrupted"] == [(payload["request_id"], name)]
    error = async_to_sync(layer.receive)(reply)
    assert error["type"] == "inference.error" and error["status"] == 503 and error["code"] == "worker_lost"
    assert "not billed" in error["message"]
    r = fleet.client()
    assert fleet.queue_depths([name]) == {name: 0} and not r.hexists("unacked", tag)
    assert r.exists(mark_key(payload["request_id"]))  # any copy that still turns up is dropped


class Recorder:
    def __init__(self):
        self.sent: list[str] = []
        self.ran = 0

    def send(self, channel, message):
        self.sent.append(message["type"])

    def run(self, send, ticket):
        self.ran += 1
        for kind in ("inference.accepted", "inference.started", "inference.delta", "inference.finished"):
            send("reply", {"type": kind, "prompt_tokens": 3, "text": "x"})
        return {"status": "completed", "latency_ms": 12, "ttft_ms": 3, "prompt_tokens": 3, "completion_tokens": 1}


def _serve(agent: Agent, payload: dict) -> Recorder:
    recorder = Recorder()
    agent.serve(payload, hostname="me@here", send=recorder.send, run=recorder.run)
    return recorder


def test_the_first_delivery_runs_and_records_its_progress():
    agent = Agent()
    payload = _payload(f"s-{uuid.uuid4().hex[:6]}")
    recorder = _serve(agent, payload)
    assert recorder.ran == 1 and recorder.sent == ["inference.accepted", "inference.started", "inference.delta",
                                                   "inference.finished"]
    assert fleet.client().hget(f"inference:progress:{payload['request_id']}", "stage") == "finished"
    figures = agent.figures[payload["deployment"]["name"]]
    assert figures.in_flight == 0 and figures.summary(figures.last_active, None)["requests"] == 1
    assert _serve(agent, payload).ran == 0  # a copy of a finished request


def test_a_copy_of_a_request_running_on_a_live_worker_is_dropped():
    payload = _payload(f"s-{uuid.uuid4().hex[:6]}")
    fleet.track_received("other-live", payload["request_id"], "tag")  # as the worker does on receiving it
    fleet.claim(payload, instance="other-live", hostname="other@here")
    fleet.set_alive("other-live", "other@here")
    try:
        assert _serve(Agent(), payload).ran == 0
    finally:
        fleet.clear_alive("other-live")


def test_a_redelivered_request_sends_only_what_the_client_has_not_seen():
    payload = _payload(f"s-{uuid.uuid4().hex[:6]}")
    fleet.claim(payload, instance="dead-one", hostname="dead@here")
    fleet.set_stage(payload["request_id"], fleet.STAGE_STARTED, prompt_tokens=3)
    recorder = _serve(Agent(), payload)
    assert recorder.ran == 1 and recorder.sent == ["inference.delta", "inference.finished"]


@pytest.mark.parametrize("client_streams", [True, False])
def test_a_redelivered_request_the_gateway_held_tokens_of_tells_it_to_void_them(client_streams):
    """A client that does not stream saw nothing even if tokens left the dead worker (the gateway
    holds them until the end): the copy runs again from the start, and says so first."""
    payload = {**_payload(f"s-{uuid.uuid4().hex[:6]}"), "stream": client_streams}
    fleet.claim(payload, instance="dead-four", hostname="dead@here")
    fleet.set_stage(payload["request_id"], fleet.STAGE_STARTED, prompt_tokens=3)
    recorder = _serve(Agent(), payload)
    assert recorder.ran == 1
    assert recorder.sent == ([] if client_streams else ["inference.restarted"]) + ["inference.delta",
                                                                                  "inference.finished"]


def test_a_redelivered_request_that_had_been_streaming_is_answered_with_an_error():
    layer = get_channel_layer()
    reply = async_to_sync(layer.new_channel)()
    payload = _payload(f"s-{uuid.uuid4().hex[:6]}", reply)
    fleet.claim(payload, instance="dead-two", hostname="dead@here")
    fleet.set_stage(payload["request_id"], fleet.STAGE_STREAMING)
    assert _serve(Agent(), payload).ran == 0
    error = async_to_sync(layer.receive)(reply)
    assert error["code"] == "worker_lost" and "dead@here" in error["message"]


def test_a_workers_minute_of_figures_for_the_metrics():
    from workers.agent import Figures

    figures = Figures()
    figures.record({"status": "completed", "latency_ms": 120, "ttft_ms": 30, "prompt_tokens": 10, "completion_tokens": 5})
    figures.record({"status": "failed", "latency_ms": None, "ttft_ms": None, "prompt_tokens": 4, "completion_tokens": 0})
    first = figures.summary(1000.0, {"instance": "a", "steps": 10, "generated_tokens": 25})
    assert (first["requests"], first["failed"], first["completion_tokens"]) == (2, 1, 5)
    assert first["latencies_ms"] == [120] and (first["steps"], first["generated_tokens"]) == (10, 25)
    later = figures.summary(1030.0, {"instance": "a", "steps": 30, "generated_tokens": 85})
    assert (later["steps"], later["generated_tokens"]) == (30, 85)
    # Scaled to zero, then reloaded: the new engine's counters restart, the minute spans both engines.
    figures.summary(1035.0, None)
    reloaded = figures.summary(1040.0, {"instance": "b", "steps": 0, "generated_tokens": 0})
    assert (reloaded["steps"], reloaded["generated_tokens"]) == (30, 85)
    # A reload whose counters are already past the old ones by its first snapshot is still a new engine.
    again = figures.summary(1045.0, {"instance": "c", "steps": 40, "generated_tokens": 90})
    assert (again["steps"], again["generated_tokens"]) == (70, 175)
    # Two minutes later only the last minute's work counts.
    aged = figures.summary(1110.0, {"instance": "c", "steps": 44, "generated_tokens": 98})
    assert (aged["steps"], aged["generated_tokens"]) == (4, 8)


FINISHED = {"type": "inference.finished", "finish_reason": "length", "error": None,
            "usage": {"prompt_tokens": 3, "cached_prompt_tokens": 0, "completion_tokens": 2},
            "timings": {"queue_ms": 1.0, "ttft_ms": 2.0, "tpot_ms": 1.0, "latency_ms": 4.0}}


@pytest.mark.django_db
@pytest.mark.parametrize("kept", [True, False], ids=["last message kept", "last message lost"])
def test_a_request_that_died_after_it_was_billed_is_ended_without_a_second_record(taken, monkeypatch, kept):
    """Billed, but its last message never left: the client gets that message (kept with the
    progress record) and ends as it would have; no 'failed, free' usage event races the one
    already on billing's queue."""
    import json

    from workers import inference

    emitted = []
    monkeypatch.setattr(inference, "emit_usage", emitted.append)
    worker = _dead_worker()
    layer = get_channel_layer()
    reply = async_to_sync(layer.new_channel)()
    name = f"r-{uuid.uuid4().hex[:6]}"
    payload = _payload(name, reply)
    payload["organization_id"], payload["deployment"]["model"] = 1, "m"
    tag = taken(payload)
    fleet.track_received(worker.instance, payload["request_id"], tag)
    fleet.claim(payload, instance=worker.instance, hostname=worker.hostname)
    fleet.set_stage(payload["request_id"], fleet.STAGE_BILLED, **({"finished": json.dumps(FINISHED)} if kept else {}))

    services.mark_worker_gone(worker=worker, reason="no heartbeat for 5s")
    message = async_to_sync(layer.receive)(reply)
    if kept:
        assert message == FINISHED
    else:
        assert message["code"] == "worker_lost" and "billed" in message["message"]
        assert "not billed" not in message["message"]
    r = fleet.client()
    assert fleet.queue_depths([name]) == {name: 0} and not r.hexists("unacked", tag)
    assert emitted == []  # no second usage event
    assert _serve(Agent(), payload).ran == 0  # a copy that turns up later is dropped, and tells nobody twice
    assert fleet.client().hget(f"inference:progress:{payload['request_id']}", "stage") == "finished"


def test_a_redelivered_copy_of_a_billed_request_sends_the_last_message_once():
    import json

    layer = get_channel_layer()
    reply = async_to_sync(layer.new_channel)()
    payload = _payload(f"s-{uuid.uuid4().hex[:6]}", reply)
    fleet.claim(payload, instance="dead-three", hostname="dead@here")
    fleet.set_stage(payload["request_id"], fleet.STAGE_BILLED, finished=json.dumps(FINISHED))
    assert _serve(Agent(), payload).ran == 0
    assert async_to_sync(layer.receive)(reply) == FINISHED
    assert _serve(Agent(), payload).ran == 0  # and a third copy sends nothing more
    record = fleet.client().hgetall(f"inference:progress:{payload['request_id']}")
    assert record["stage"] == "finished" and record["told"] == "1"


def test_a_paused_worker_presumed_dead_learns_which_requests_were_handed_on():
    """Recovery took this process's requests out of its record while it was paused: once back, and
    before its heartbeat revives it, it marks those runs superseded; not a run it still holds."""
    from workers.agent import INSTANCE, Ticket

    agent = Agent()
    kept, handed_on = Ticket(f"kept-{uuid.uuid4().hex}"), Ticket(f"gone-{uuid.uuid4().hex}")
    for ticket in (kept, handed_on):
        fleet.track_received(INSTANCE, ticket.request_id, "tag")
    try:
        fleet.untrack(INSTANCE, handed_on.request_id)  # as recover_requests does
        agent._alive_since = time.monotonic()  # its heartbeat is fresh: nothing can have been handed on
        agent.check_tickets([kept, handed_on])
        assert not handed_on.superseded
        agent._alive_since = time.monotonic() - fleet.liveness_ttl()  # paused past its liveness
        agent.check_tickets([kept, handed_on])
        assert handed_on.superseded and not kept.superseded
    finally:
        fleet.untrack(INSTANCE, kept.request_id)


def test_a_copy_is_run_when_its_worker_is_back_but_no_longer_holds_the_request():
    """The worker was presumed dead and its request redelivered; it is alive again by the time the
    copy arrives, but recovery took the request from it: the copy runs (else nobody would)."""
    payload = _payload(f"s-{uuid.uuid4().hex[:6]}")
    fleet.track_received("paused-one", payload["request_id"], "tag")
    fleet.claim(payload, instance="paused-one", hostname="paused@here")
    fleet.set_stage(payload["request_id"], fleet.STAGE_STARTED, prompt_tokens=3)
    fleet.set_alive("paused-one", "paused@here")
    try:
        assert _serve(Agent(), payload).ran == 0  # it holds the request: a copy is not run
        fleet.client().delete(f"fleet:inflight:paused-one")  # recovered while it was paused
        recorder = _serve(Agent(), payload)
        assert recorder.ran == 1 and recorder.sent == ["inference.delta", "inference.finished"]
    finally:
        fleet.clear_alive("paused-one")


def test_an_interrupted_batch_line_is_recorded_under_its_lines_billing_id(monkeypatch):
    """So that the run that completes it when the batch resumes replaces this free record."""
    from workers import inference

    emitted = []
    monkeypatch.setattr(inference, "emit_usage", emitted.append)
    payload = {**_payload(f"r-{uuid.uuid4().hex[:6]}"), "organization_id": 7, "billing_id": "batch_req_abc_3"}
    fleet.claim(payload, instance="i-1", hostname="me@here")
    record = fleet.client().hgetall(fleet._progress_key(payload["request_id"]))
    assert fleet.fail_interrupted(payload["request_id"], record, reason="its worker died")
    [event] = emitted
    assert (event["request_id"], event["status"], event["completion_tokens"]) == ("batch_req_abc_3", "failed", 0)
