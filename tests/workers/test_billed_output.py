"""A client that waits for the whole answer pays for its output only if it got it, or gave the
request up itself. When the platform gives up instead (the gateway's timeout or a Redis failure,
which cancel "void"; a worker that stops serving the model), the client got an error it may retry,
and must not pay twice. A streaming client got its tokens as they came: it pays for them either way.

The real worker path: the bundled model's engine, the relay over the channel layer to a reply
channel read here, the cancel listener on Redis."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings

from workers import inference
from workers.cancellation import CancelListener, request_cancel
from workers.engine.loader import bundled_model_path
from workers.relay import ChannelSender, StreamRelay
from workers.runtime import EngineHost

SPEC = {"id": None, "name": f"billed-output-{uuid.uuid4().hex[:6]}", "model": "smollm2",
        "weights": str(bundled_model_path()), "max_batch_size": 4}


@pytest.fixture(scope="module")
def worker():
    """What a worker process has: an engine host, a sender and relay, a cancel listener."""
    host, sender = EngineHost(), ChannelSender()
    relay = StreamRelay(sender)
    yield host, sender, relay, CancelListener(settings.REDIS_URL)
    relay.close()
    host.unload(SPEC["name"])


class Running:
    """One request served on a thread of its own, as a Celery task thread serves it."""

    def __init__(self, worker, monkeypatch, *, stream: bool, max_tokens: int = 400, **payload_extra):
        host, self.sender, relay, cancels = worker
        self.request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.reply = async_to_sync(self.sender.layer.new_channel)()
        self.billed: list[dict] = []
        monkeypatch.setattr(inference, "emit_usage", self.billed.append)
        payload = {"request_id": self.request_id, "reply_channel": self.reply, "deployment": SPEC,
                   "kind": "completion", "prompt": "Once upon a time", "organization_id": 1, "stream": stream,
                   "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}, **payload_extra}
        self.engine = host.engine_for(SPEC)
        self.thread = threading.Thread(target=inference.run, args=(payload,), kwargs=dict(
            host=host, send=self.sender.send, relay=relay, cancels=cancels))
        self.thread.start()

    def receive(self) -> dict:
        return async_to_sync(self.sender.layer.receive)(self.reply)

    def after_tokens(self, count: int) -> None:
        """Read the reply channel until ``count`` tokens came (as the gateway reads it)."""
        seen = 0
        while seen < count:
            event = self.receive()
            assert event["type"] in ("inference.started", "inference.delta"), event
            seen += len(event.get("token_ids") or ())

    def usage(self) -> dict:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()
        [event] = self.billed
        return event


def cancel(request_id: str, *, void: bool) -> None:
    request_cancel(redis.Redis.from_url(settings.REDIS_URL), request_id, void=void)


@pytest.mark.parametrize("stream, void, billed", [
    (False, True, False),  # the gateway gave up (a 504, a 503 "retry"): nothing reached the client
    (False, False, True),  # its client cancelled: what was produced is billed
    (True, True, True),  # a streaming client got its tokens as they came, whoever gave up
], ids=["gateway-gave-up", "client-cancelled", "streaming"])
def test_a_cancelled_request_is_billed_for_its_output_only_if_its_client_had_it_or_gave_it_up(
        worker, monkeypatch, stream, void, billed):
    running = Running(worker, monkeypatch, stream=stream)
    running.after_tokens(3)
    cancel(running.request_id, void=void)
    usage = running.usage()
    assert usage["prompt_tokens"] > 0  # counted either way; a failed request without output is free
    if billed:
        assert usage["status"] == "cancelled" and 3 <= usage["completion_tokens"] < 400
    else:
        assert (usage["status"], usage["completion_tokens"]) == ("failed", 0)


def test_a_request_the_worker_stopped_is_free_for_a_client_that_does_not_stream(worker, monkeypatch):
    """What the engine's stop does to each request it runs (the worker unloading the model): an
    abort nobody asked for, which the gateway answers with a 503 "interrupted; retry"."""
    running = Running(worker, monkeypatch, stream=False)
    running.after_tokens(3)
    assert running.engine.abort(running.request_id)
    usage = running.usage()
    assert (usage["status"], usage["completion_tokens"]) == ("failed", 0)


def test_a_request_that_ends_as_it_should_is_billed_whole(worker, monkeypatch):
    running = Running(worker, monkeypatch, stream=False, max_tokens=12)
    usage = running.usage()
    assert (usage["status"], usage["completion_tokens"]) == ("completed", 12)


def test_a_request_that_ends_as_its_gateway_gives_up_on_it_is_free(worker, monkeypatch):
    """The two cross: the gateway's void cancel is marked (its broadcast not heard yet) while the
    request reaches its last token. Its client got the 504, not the answer."""
    from workers.cancellation import VOID, mark_key

    running = Running(worker, monkeypatch, stream=False, max_tokens=12)
    running.after_tokens(3)
    redis.Redis.from_url(settings.REDIS_URL).set(mark_key(running.request_id), VOID, ex=60)  # no broadcast
    usage = running.usage()
    assert (usage["status"], usage["completion_tokens"]) == ("failed", 0)


def test_a_stream_whose_gateway_died_is_billed_for_what_reached_it_while_alive(worker, monkeypatch, settings):
    """The gateway process died mid-stream (its pulse stops): the worker notices seconds later and
    stops, having generated on for nobody. Billed: the tokens the gateway had when last alive, as a
    failure of the platform's, not as the client's cancel. (Pulse timings shortened for the test.)"""
    import time

    from workers import dispatch, pulse

    monkeypatch.setattr(dispatch, "PULSE_TTL_S", 2)
    monkeypatch.setattr(pulse, "GRACE_S", 1.0)
    settings.GATEWAY_STALL_TIMEOUT = 2  # the worker looks at its request (and the pulse) every 0.5 s
    key, client, dead = f"gateway:pulse:test-{uuid.uuid4().hex}", redis.Redis.from_url(settings.REDIS_URL), \
        threading.Event()

    def beat():  # as the gateway's event loop does
        client.set(key, "1", ex=dispatch.PULSE_TTL_S)
        while not dead.wait(0.3):
            client.set(key, "1", ex=dispatch.PULSE_TTL_S)

    beats_seen: list[float] = []  # the gateway's last beat, as the worker saw it at each check
    check = pulse.GatewayPulse.gone

    def watched(self) -> bool:
        gone = check(self)
        if self.last_beat is not None:
            beats_seen.append(self.last_beat)
        return gone

    monkeypatch.setattr(pulse.GatewayPulse, "gone", watched)
    beater = threading.Thread(target=beat)
    beater.start()
    try:
        running = Running(worker, monkeypatch, stream=True, max_tokens=4000, gateway_pulse=key)
        running.after_tokens(40)
        read_40 = time.monotonic()
        seen, deadline = 40, read_40 + 30
        # The gateway reads on, beating, until the worker has seen a beat after its 40th token.
        while not any(beat_at > read_40 for beat_at in beats_seen):
            assert time.monotonic() < deadline, "the worker never checked the gateway's pulse"
            seen += len(running.receive().get("token_ids") or ())
    finally:
        dead.set()  # the gateway dies: its pulse stops, nobody reads what the worker sends on
        beater.join()
    at_death = seen
    while (event := running.receive())["type"] == "inference.delta":
        seen += len(event.get("token_ids") or ())
    usage = running.usage()
    assert usage["status"] == "failed"
    # What reached the gateway by its last beat: at least the 40 it read then, at most what it had
    # read as it died and the little still on its way (what came after is generated for nobody).
    assert 40 <= usage["completion_tokens"] <= at_death + 10 and seen < 4000


def test_a_request_whose_gateway_died_before_it_ran_is_not_run(worker, monkeypatch):
    """A queue kept across a restart of the platform (the embedded Redis's append-only file) holds
    requests whose clients' connections closed with it: a worker taking one finds its gateway's
    pulse gone, and neither runs nor bills it."""
    from workers import pulse

    monkeypatch.setattr(pulse, "GRACE_S", 1.0)
    running = Running(worker, monkeypatch, stream=True, gateway_pulse=f"gateway:pulse:gone-{uuid.uuid4().hex}")
    running.thread.join(timeout=30)
    assert not running.thread.is_alive() and running.billed == []
    assert not running.engine.abort(running.request_id)  # the engine never had it
