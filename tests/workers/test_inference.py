"""The worker's side of a request when its engine is not there to take it: a clear, retryable
error for the gateway at once (not a 30 s wait for nothing), and a dead engine loaded again."""

from __future__ import annotations

import uuid

import pytest

from workers import inference
from workers.cancellation import CancelListener, mark_key
from workers.engine import EngineError
from workers.runtime import EngineHost

SPEC = {"id": None, "name": "smol", "model": "smollm2", "weights": "bundled"}


class StoppedEngine:
    tokenizer = None
    is_running = False

    def submit(self, *args, **kwargs):
        raise EngineError("the engine is stopped")

    submit_chat = submit


class Host:
    def __init__(self, engine):
        self.engine = engine

    def spec(self, name):
        return SPEC

    def engine_for(self, spec):
        return self.engine


class Relay:
    def stream(self, reply, to_message):
        return object()


class NoCancels:
    def is_cancelled(self, request_id):
        return False


def test_an_engine_that_cannot_take_the_request_answers_a_503_at_once():
    sent = []
    payload = {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "reply_channel": "reply", "deployment": SPEC,
               "kind": "completion", "prompt": "Hi", "sampling": {"max_tokens": 4}}
    event = inference.run(payload, host=Host(StoppedEngine()), send=lambda reply, message: sent.append(message),
                          relay=Relay(), cancels=NoCancels())
    assert event is None  # nothing ran: nothing to bill
    [error] = sent
    assert (error["type"], error["status"], error["code"]) == ("inference.error", 503, "model_unavailable")


def test_a_deployment_whose_engine_loop_died_is_loaded_again(monkeypatch):
    class Engine:
        is_running = True

    host, loads = EngineHost(), []
    monkeypatch.setattr(host, "_load", lambda spec: loads.append(Engine()) or loads[-1])
    first = host.engine_for(SPEC)
    assert host.engine_for(SPEC) is first and len(loads) == 1
    first.is_running = False  # its loop crashed: every request on it would fail
    second = host.engine_for(SPEC)
    assert second is not first and second.is_running and len(loads) == 2


@pytest.mark.django_db
def test_a_cancel_published_while_the_listener_was_away_is_caught_up_on():
    """Pub/sub reaches only those subscribed: a cancel published while the listener reconnects is
    lost as a message, but its mark remains, and the listener checks the marks on subscribing."""
    from django.conf import settings

    listener, cancelled = CancelListener(settings.REDIS_URL), []
    running, other = f"chatcmpl-{uuid.uuid4().hex}", f"chatcmpl-{uuid.uuid4().hex}"
    listener.watch(running, lambda: cancelled.append(running))
    listener.watch(other, lambda: cancelled.append(other))
    listener._redis.set(mark_key(running), "1", ex=60)  # the mark, without the message
    listener._catch_up()
    assert cancelled == [running]
    listener._redis.delete(mark_key(running))
