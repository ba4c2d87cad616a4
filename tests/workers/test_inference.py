"""The worker's side of a request when its engine is not there to take it: a clear, retryable
error for the gateway at once (not a 30 s wait for nothing), and a dead engine loaded again."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

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
    def stream(self, reply, to_message, ticket=None, client_streams=True, request_id=None):
        return SimpleNamespace()


class NoCancels:
    def is_cancelled(self, request_id):
        return False

    def is_void(self, request_id):
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


def test_a_bug_while_submitting_answers_a_500_at_once():
    class Buggy(StoppedEngine):
        def submit(self, *args, **kwargs):
            raise ValueError("a bug")

    sent = []
    payload = {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "reply_channel": "reply", "deployment": SPEC,
               "kind": "completion", "prompt": "Hi", "sampling": {"max_tokens": 4}}
    assert inference.run(payload, host=Host(Buggy()), send=lambda reply, message: sent.append(message),
                         relay=Relay(), cancels=NoCancels()) is None
    assert [(m["status"], m["code"]) for m in sent] == [(500, "internal_error")]


def test_a_deployment_whose_engine_loop_died_is_loaded_again(monkeypatch):
    class Engine:
        is_running = True

        def stop(self, timeout=None):
            self.stopped = True

    host, loads = EngineHost(), []
    monkeypatch.setattr(host, "_load", lambda spec: loads.append(Engine()) or loads[-1])
    first = host.engine_for(SPEC)
    assert host.engine_for(SPEC) is first and len(loads) == 1
    first.is_running = False  # its loop crashed: every request on it would fail
    second = host.engine_for(SPEC)
    assert second is not first and second.is_running and len(loads) == 2
    assert first.stopped  # what it still held is failed, its memory let go


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
    # The listener's own thread also catches up once it has subscribed, which may come after
    # the mark: the request may be told twice (an abort is idempotent), the other one never.
    assert cancelled and set(cancelled) == {running}
    listener._redis.delete(mark_key(running))


# --- loads and unloads that overlap -------------------------------------------------------------------


class QueuedSteps:
    """The agent's per-deployment serial queue, run by the test."""

    def __init__(self):
        self.steps = []

    def submit(self, name, step):
        self.steps.append(step)

    def run_all(self):
        while self.steps:
            self.steps.pop(0)()


class FakeHost:
    def __init__(self, during_load=None):
        self.loaded, self.load_seconds, self.during_load = {}, {}, during_load

    def spec(self, name):
        return self.loaded.get(name)

    def engine_for(self, spec):
        if self.during_load:
            self.during_load, during = None, self.during_load
            during()
        self.loaded[spec["name"]] = spec

    def unload(self, name):
        self.loaded.pop(name, None)


def test_settings_changed_while_loading_are_loaded_next_not_dropped(monkeypatch):
    """An unload and a load with other settings arrive while the first load runs: the worker must
    end up serving the new settings (it used to mark the old engine ready and skip the rest)."""
    from workers import agent as agent_module

    old = {"id": 1, "name": "smol", "dtype": "float32"}
    new = {**old, "dtype": "bfloat16"}
    agent = agent_module.Agent()
    agent.serial = QueuedSteps()
    reported = []
    host = FakeHost(during_load=lambda: (agent.submit_unload("smol"), agent.submit_load(new, "placement")))
    monkeypatch.setattr(agent_module, "host", host)
    monkeypatch.setattr(agent_module.app.control, "add_consumer", lambda *a, **k: None)
    monkeypatch.setattr(agent_module.app.control, "cancel_consumer", lambda *a, **k: None)
    monkeypatch.setattr(agent, "_drain", lambda name: None)
    monkeypatch.setattr(agent, "_report_loaded", lambda spec, seconds: reported.append(spec))
    agent.submit_load(old, "placement")
    agent.serial.run_all()
    assert host.spec("smol") == new and reported == [new]
    assert agent.hosted["smol"]["state"] == "ready"


# --- billing before the last message ------------------------------------------------------------------


def finishing(final, happened: list):
    """A host, relay and cancels whose engine takes the request and ends it with ``final``."""
    class Handle:
        prompt_tokens = final.prompt_tokens

        def abort(self):
            happened.append("abort")

    class Finished:
        handle, last, ended, computed_tokens = None, final, True, 0

        def open(self):
            pass

        def wait(self, timeout, progressed=None, *, poll=None):
            return final

    class Engine(StoppedEngine):
        def submit(self, *args, **kwargs):
            return Handle()

    class Cancels(NoCancels):
        def watch(self, request_id, abort):
            pass

        def unwatch(self, request_id):
            pass

    relay = type("R", (), {"stream": lambda self, reply, to_message, ticket=None, client_streams=True, request_id=None: Finished()})()
    return {"host": Host(Engine()), "relay": relay, "cancels": Cancels()}


def final_output(**timings):
    from workers.engine.sequence import RequestOutput, RequestTimings

    return RequestOutput(request_id="r", token_ids=[5, 6], text="hi", logprobs=None, finished=True,
                         finish_reason="length", prompt_tokens=3, cached_prompt_tokens=0, completion_tokens=2,
                         timings=RequestTimings(**{"arrival_time": 0.0, "queue_time": 0.001, "time_to_first_token": 0.01,
                                                   "e2e_latency": 0.02, "mean_batch_size": 2.5, **timings}))


def completion_payload(**extra) -> dict:
    return {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "reply_channel": "reply", "deployment": SPEC,
            "kind": "completion", "prompt": "Hi", "sampling": {"max_tokens": 2}, "organization_id": 1, **extra}


def test_the_usage_event_leaves_before_the_last_message(monkeypatch):
    """A worker killed between the two must have billed what the client received: the usage
    event first, then inference.finished (which the progress record reads as 'billed')."""
    happened = []
    payload, parts = completion_payload(), finishing(final_output(), happened)

    def run():
        return inference.run(payload, send=lambda reply, message: happened.append(message["type"]), **parts)

    monkeypatch.setattr(inference, "emit_usage", lambda event: happened.append(("usage", event)))
    event = run()
    kinds = [h[0] if isinstance(h, tuple) else h for h in happened]
    assert kinds == ["inference.started", "usage", "inference.finished"]
    assert happened[1][1] is event
    assert (event["status"], event["completion_tokens"], event["batch_size"]) == ("completed", 2, 2.5)

    # Billing that fails (the broker down after its retries) still ends the client's stream, is
    # tried once, and fails the task loudly.
    def broken(event):
        happened.append("emit attempt")
        raise ConnectionError("broker down")

    happened.clear()
    monkeypatch.setattr(inference, "emit_usage", broken)
    with pytest.raises(ConnectionError):
        run()
    assert happened == ["inference.started", "emit attempt", "inference.finished"]


def test_a_request_queued_longer_than_a_cancel_lasts_is_not_run(monkeypatch):
    """Its client is gone (no gateway waits an hour for a worker) and its cancel mark may have
    expired: it is dropped unrun and unbilled, whereas one queued a while still runs."""
    import time

    from workers.cancellation import MARK_TTL_S

    for waited, runs in ((MARK_TTL_S + 60, False), (MARK_TTL_S - 60, True)):
        billed, sent = [], []
        monkeypatch.setattr(inference, "emit_usage", billed.append)
        payload = completion_payload(admitted_at=time.time() - waited)
        inference.run(payload, send=lambda reply, message: sent.append(message), **finishing(final_output(), []))
        assert (len(billed), bool(sent)) == ((1, True) if runs else (0, False))


@pytest.mark.parametrize("admitted, waited_s", [(-7.5, 7.5), (None, 0.0), (+60.0, 0.0)])
def test_the_usage_events_timings_count_from_the_gateways_admission(monkeypatch, admitted, waited_s):
    """What the client waited: the task's queue and a first run whose worker died (7.5 s here)
    come before the engine's own timings; a gateway of before (no time) or a clock behind the
    gateway's add nothing. The time per output token is the engine's alone."""
    import time

    sent = []
    payload = completion_payload(**({} if admitted is None else {"admitted_at": time.time() + admitted}))
    monkeypatch.setattr(inference, "emit_usage", lambda event: None)
    final = final_output(time_per_output_token=0.004)
    event = inference.run(payload, send=lambda reply, message: sent.append(message), **finishing(final, []))
    for name, engine_ms in (("queue_ms", 1), ("ttft_ms", 10), ("latency_ms", 20)):
        assert event[name] == pytest.approx(engine_ms + waited_s * 1000, abs=250), name
        assert sent[-1]["timings"][name] == event[name]
    assert sent[-1]["timings"]["tpot_ms"] == 4.0


def test_the_usage_event_carries_the_prices_the_gateway_admitted_the_request_at():
    """Copied from the task's payload, so billing applies them whenever it records the event; a
    payload from a gateway of before has none, and neither has its event (billing: the catalog's)."""
    from billing.events import parse_usage_event
    from workers.engine.sequence import RequestOutput, RequestTimings

    final = RequestOutput(request_id="r", token_ids=[5], text="hi", logprobs=None, finished=True, finish_reason="stop",
                          prompt_tokens=3, cached_prompt_tokens=0, completion_tokens=1,
                          timings=RequestTimings(arrival_time=0.0, queue_time=0.001, time_to_first_token=0.01,
                                                 e2e_latency=0.02, mean_batch_size=1.0))
    prices = {"input_per_mtok": "0.050000", "cached_input_per_mtok": "0.025000", "output_per_mtok": "0.100000",
              "per_request": "0.000000"}
    payload = {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "deployment": SPEC, "organization_id": 1,
               "prices": prices}
    event = parse_usage_event(inference._usage_event(payload, finished_answers(final)))
    assert event.prices.as_strings() == prices
    del payload["prices"]
    assert parse_usage_event(inference._usage_event(payload, finished_answers(final))).prices is None


@pytest.mark.django_db
def test_a_batch_line_run_twice_is_charged_once():
    """Its runner stopped mid-request: the line runs again as a new request (a new request id, the
    cancel of the first one must not stop it), but under the line's billing id, which billing
    records once: for the run that completed."""
    from billing.models import LedgerEntry, UsageRecord
    from billing.services import record_usage
    from tests.billing.conftest import make_organization
    from workers.engine.sequence import RequestOutput, RequestTimings

    organization = make_organization()
    prices = {"input_per_mtok": "1.000000", "cached_input_per_mtok": "0.500000", "output_per_mtok": "2.000000",
              "per_request": "0.000000"}
    runs = []
    for completion_tokens, reason in ((3, "abort"), (8, "stop")):
        final = RequestOutput(request_id="r", token_ids=[5] * completion_tokens, text="hi", logprobs=None,
                              finished=True, finish_reason=reason, prompt_tokens=4, cached_prompt_tokens=0,
                              completion_tokens=completion_tokens, timings=RequestTimings(arrival_time=0.0))
        payload = {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "billing_id": "batch_req_abc_7", "deployment": SPEC,
                   "organization_id": organization.pk, "prices": prices}
        runs.append(record_usage(event=inference._usage_event(payload, finished_answers(final))))
    assert runs[0].pk == runs[1].pk and runs[0].request_id == "batch_req_abc_7"
    assert (runs[1].status, runs[1].completion_tokens) == ("completed", 8)
    assert UsageRecord.objects.count() == 1
    assert [e.amount for e in LedgerEntry.objects.filter(kind="usage")] == [-runs[1].cost]


def test_an_embedding_request_cut_off_is_free_as_any_request_cut_before_its_output():
    """It answers nothing before all its inputs are embedded: cut off, it is recorded cancelled,
    unbilled, and a batch line's run that completes it replaces that record."""
    import numpy as np

    from billing.events import parse_usage_event
    from workers.engine.sequence import RequestOutput, RequestTimings

    def output(embedded: bool, reason: str) -> RequestOutput:
        return RequestOutput(request_id="r", token_ids=[], text="", logprobs=None, finished=True,
                             finish_reason=reason, prompt_tokens=5, cached_prompt_tokens=2, completion_tokens=0,
                             timings=RequestTimings(arrival_time=0.0),
                             embedding=np.ones(4, dtype=np.float32) if embedded else None)

    payload = {"request_id": f"embd-{uuid.uuid4().hex}", "deployment": SPEC, "organization_id": 1, "kind": "embedding"}
    cut = parse_usage_event(inference._usage_event(payload, finished_answers(output(True, "length"),
                                                                             output(False, "abort"))))
    assert (cut.status, cut.completion_tokens) == ("cancelled", 0)
    whole = parse_usage_event(inference._usage_event(payload, finished_answers(output(True, "length"),
                                                                               output(True, "length"))))
    assert (whole.status, whole.prompt_tokens, whole.cached_prompt_tokens) == ("completed", 10, 4)


def test_an_embeddings_request_over_the_token_limit_is_a_400_before_anything_runs(monkeypatch):
    submitted, sent = [], []

    class Tokenizer:
        def encode(self, text, add_special_tokens=True):
            return [1] * len(text.split())

    class Engine(StoppedEngine):
        tokenizer = Tokenizer()

        def submit(self, *args, **kwargs):
            submitted.append(args)
            raise AssertionError("nothing may run")

    monkeypatch.setattr(inference, "EMBEDDING_MAX_TOKENS", 5)
    payload = {"request_id": f"embd-{uuid.uuid4().hex}", "reply_channel": "reply", "deployment": SPEC,
               "kind": "embedding", "prompts": ["one two three", [7, 8, 9]], "sampling": {"embed": True}}
    assert inference.run(payload, host=Host(Engine()), send=lambda reply, message: sent.append(message),
                         relay=Relay(), cancels=NoCancels()) is None
    [error] = sent
    assert (error["status"], error["param"]) == (400, "input") and "6 tokens" in error["message"] and not submitted


def finished_answers(*outputs):
    """A request's answers, each ended with its output."""
    from workers.choices import Choices

    return Choices([SimpleNamespace(last=out, ended=True) for out in outputs])


def test_n_answers_run_as_n_engine_requests_billed_as_one(monkeypatch):
    from workers.engine.sequence import RequestOutput, RequestTimings

    def final(index, tokens, reason):
        return RequestOutput(request_id=f"r/{index}", token_ids=list(range(tokens)), text="x" * tokens, logprobs=None,
                             finished=True, finish_reason=reason, prompt_tokens=3, cached_prompt_tokens=0,
                             completion_tokens=tokens, timings=RequestTimings(
                                 arrival_time=0.0, queue_time=0.001, time_to_first_token=0.01 * (index + 1),
                                 e2e_latency=0.02 * (index + 1), mean_batch_size=2.0))

    finals, submitted, sent = [final(0, 4, "stop"), final(1, 6, "length")], [], []

    class Handle:
        prompt_tokens = 3

        def abort(self):
            raise AssertionError("nothing is aborted")

    class Engine(StoppedEngine):
        def submit(self, prompt, params, *, request_id, listener):
            submitted.append((request_id, params.seed))
            return Handle()

    class Answer(SimpleNamespace):
        computed_tokens = 0

        def open(self):
            pass

        def wait(self, timeout, progressed=None, *, poll=None):
            return self.last

    class Cancels(NoCancels):
        def watch(self, request_id, abort):
            pass

        def unwatch(self, request_id):
            pass

    answers = iter(finals)
    relay = SimpleNamespace(stream=lambda *a, **k: Answer(last=next(answers), ended=True))
    monkeypatch.setattr(inference, "emit_usage", lambda event: None)
    payload = {"request_id": "cmpl-x", "reply_channel": "reply", "deployment": SPEC, "kind": "completion",
               "prompt": "Hi", "sampling": {"max_tokens": 6, "seed": 7}, "organization_id": 1, "n": 2}
    event = inference.run(payload, host=Host(Engine()), send=lambda reply, message: sent.append(message),
                          relay=relay, cancels=Cancels())
    assert [seed for _, seed in submitted] == [7, 8] and len({rid for rid, _ in submitted}) == 2
    assert (event["request_id"], event["prompt_tokens"], event["completion_tokens"]) == ("cmpl-x", 3, 10)
    assert (event["status"], event["ttft_ms"], event["latency_ms"]) == ("completed", 10.0, 40.0)
    finished = sent[-1]
    assert finished["choices"] == [{"index": 0, "finish_reason": "stop"}, {"index": 1, "finish_reason": "length"}]
    assert finished["usage"]["completion_tokens"] == 10


def test_a_relay_that_fails_answers_the_client_at_once_and_bills_what_ran(monkeypatch):
    """Not a silent stall until the gateway's timeout: an error event, then the usual billing."""
    sent, billed = [], []

    class Handle:
        prompt_tokens = 3

        def abort(self):
            pass

    class Engine(StoppedEngine):
        def submit(self, *args, **kwargs):
            return Handle()

    class Broken(SimpleNamespace):
        computed_tokens = 0

        def open(self):
            pass

        def wait(self, timeout, progressed=None, *, poll=None):
            raise RuntimeError("the relay broke")

        def tokens_sent(self, by=None):
            return 0

    class Cancels(NoCancels):
        def watch(self, request_id, abort):
            pass

        def unwatch(self, request_id):
            pass

    monkeypatch.setattr(inference, "emit_usage", billed.append)
    payload = {"request_id": "cmpl-y", "reply_channel": "reply", "deployment": SPEC, "kind": "completion",
               "prompt": "Hi", "sampling": {"max_tokens": 6}, "organization_id": 1}
    relay = SimpleNamespace(stream=lambda *a, **k: Broken(last=None, ended=False))
    with pytest.raises(RuntimeError):
        inference.run(payload, host=Host(Engine()), send=lambda reply, message: sent.append(message),
                      relay=relay, cancels=Cancels())
    assert [m["type"] for m in sent] == ["inference.started", "inference.error"]
    assert (sent[-1]["status"], sent[-1]["code"]) == (500, "internal_error")
    [event] = billed
    assert (event["status"], event["prompt_tokens"], event["completion_tokens"]) == ("failed", 3, 0)


@pytest.mark.parametrize("stream, billed", [(True, 9), (False, 0)])
def test_an_answer_whose_end_never_reached_its_gateway_is_not_billed_as_completed(monkeypatch, stream, billed):
    """The engine finished it, but a send failed (the gateway's channel full, Redis failing): a
    streaming client pays for the tokens its gateway received, one waiting for the whole answer
    got an error instead, and pays nothing."""
    from workers.choices import Choices
    from workers.engine.sequence import RequestOutput, RequestTimings

    final = RequestOutput(request_id="r", token_ids=[5], text="hi", logprobs=None, finished=True, finish_reason="stop",
                          prompt_tokens=3, cached_prompt_tokens=0, completion_tokens=50,
                          timings=RequestTimings(arrival_time=0.0, queue_time=0.001, time_to_first_token=0.01,
                                                 e2e_latency=0.02, mean_batch_size=1.0))
    answer = SimpleNamespace(last=final, ended=True, lost=True, tokens_sent=lambda by=None: 9)
    billed_events = []
    monkeypatch.setattr(inference, "emit_usage", billed_events.append)
    payload = {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "deployment": SPEC, "organization_id": 1,
               "stream": stream}
    class Cancels(NoCancels):
        def unwatch(self, request_id):
            pass

    inference._bill(payload, Choices([answer]), Cancels())
    [event] = billed_events
    assert (event["status"], event["completion_tokens"]) == ("failed", billed)
