"""The fleet for real: Celery workers hosting the bundled model, placed by the placement loop that
Celery beat runs, called through uvicorn with the openai client.

Everything waits on conditions (``wait_until``), never on sleeps: model loads on a busy CPU take
seconds to tens of seconds.
"""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from inference_platform.celery import app
from tests.support import wait_until

from .conftest import status_of

pytestmark = pytest.mark.slow

LOAD_TIMEOUT = 180  # a model load on a loaded 2-core machine


def _client(tenant) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tenant.base_url}/v1", api_key=tenant.api_key, max_retries=0, timeout=300)


def _chat(tenant, model: str, content: str = "Say hello.", max_tokens: int = 8):
    return _client(tenant).chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0)


def _engines_on_workers() -> dict[str, set[str]]:
    """What each live worker process really hosts, asked over Celery's remote control."""
    replies = app.control.broadcast("engine_stats", reply=True, timeout=3)
    return {worker: set(reply.get("engines", {})) for answer in replies for worker, reply in answer.items()}


def _consumed_queues(hostname: str) -> set[str]:
    replies = app.control.inspect(destination=[hostname], timeout=3).active_queues() or {}
    return {queue["name"] for queue in replies.get(hostname, [])}


def _replicas(db_read, name: str) -> list[tuple[str, str]]:
    from workers.models import Replica

    return db_read(lambda: list(Replica.objects.filter(deployment__name=name)
                                .values_list("worker__hostname", "status")))


def _history(db_read, name: str) -> list[str]:
    from models_catalog.models import Deployment
    from workers.selectors import status_history

    return db_read(lambda: status_history(deployment=Deployment.objects.get(name=name)))


def _unacknowledged(deployment: str) -> list[str]:
    """Messages of the deployment's queue a worker took and has not acknowledged yet (kombu keeps
    them in its ``unacked`` hash until then, for a redelivery)."""
    from workers import fleet as broker

    held = broker.client().hvals("unacked")
    return [raw for raw in held if json.loads(raw)[2] == f"deployment.{deployment}"]


def test_a_deployment_loads_serves_scales_to_zero_and_cold_starts(fleet, tenant, deploy, db_read):
    created = deploy(scale_to_zero_seconds=3)
    name = created["name"]
    assert created["status"] == "pending"

    wait_until(lambda: status_of(tenant, name) == "ready", timeout=LOAD_TIMEOUT, interval=0.3,
               message=f"{name} to be ready")
    assert _history(db_read, name)[:2] == ["loading", "ready"]
    [(hostname, state)] = _replicas(db_read, name)
    assert state == "ready" and f"deployment.{name}" in _consumed_queues(hostname)

    answer = _chat(tenant, name)
    assert answer.choices[0].message.content and answer.usage.completion_tokens > 0

    # Idle for 3 s: the worker stops consuming and unloads the engine; the deployment is scaled to zero.
    wait_until(lambda: status_of(tenant, name) == "scaled_to_zero", timeout=60, message="scale to zero")
    wait_until(lambda: name not in _engines_on_workers().get(hostname, {name}), timeout=30,
               message="the engine to be unloaded")
    assert f"deployment.{name}" not in _consumed_queues(hostname)
    assert _replicas(db_read, name) == []

    # The next request cold-starts it: it waits while a worker loads the model (status visible).
    seen: list[str] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(status_of(tenant, name))
            stop.wait(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    try:
        answer = _chat(tenant, name, max_tokens=4)
    finally:
        stop.set()
        watcher.join()
    cold_start = time.monotonic() - started
    assert answer.choices[0].message.content
    assert "loading" in seen, seen
    with tenant.api() as api:
        metrics = api.get(f"/v1/deployments/{name}/metrics").json()
    assert metrics["cold_starts_total"] == 1 and metrics["last_cold_start_seconds"] > 0
    assert metrics["status"] == "ready" and metrics["replicas_ready"] == 1
    print(f"\ncold start (request to full answer, CPU): {cold_start:.1f}s")

    # The worker's heartbeat brings the request figures.
    def figures():
        with tenant.api() as api:
            data = api.get(f"/v1/deployments/{name}/metrics").json()
        return data if data["requests_per_minute"] > 0 else None

    data = wait_until(figures, timeout=15, message="the request figures")
    assert data["latency_p50_ms"] > 0 and data["tokens_per_second"] > 0 and data["average_batch_size"] >= 1


def test_two_deployments_with_different_batch_windows_are_served_by_two_workers_and_deleted_cleanly(fleet, tenant, deploy, db_read):
    quick = deploy(batch_window_ms=5, min_replicas=1)["name"]
    patient = deploy(batch_window_ms=80, min_replicas=1)["name"]
    for name in (quick, patient):
        wait_until(lambda: status_of(tenant, name) == "ready", timeout=LOAD_TIMEOUT, interval=0.3,
                   message=f"{name} to be ready")
    [(quick_worker, _)] = _replicas(db_read, quick)
    [(patient_worker, _)] = _replicas(db_read, patient)
    assert quick_worker != patient_worker
    assert f"deployment.{quick}" in _consumed_queues(quick_worker)
    assert f"deployment.{quick}" not in _consumed_queues(patient_worker)
    assert f"deployment.{patient}" in _consumed_queues(patient_worker)

    # Each engine runs with its deployment's batch window (as its worker reports it).
    from workers.models import Worker

    def window(hostname, name):
        stats = db_read(lambda: Worker.objects.get(hostname=hostname).engine_stats)
        return (stats.get(name) or {}).get("settings", {}).get("batch_window_ms")

    wait_until(lambda: window(quick_worker, quick) == 5 and window(patient_worker, patient) == 80, timeout=10,
               message="the heartbeats to report both engines")

    answers = {}
    threads = [threading.Thread(target=lambda n=n: answers.__setitem__(n, _chat(tenant, n))) for n in (quick, patient)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(answers[n].choices[0].message.content for n in (quick, patient))

    # Deleting a deployment while a request streams: the request finishes, then the worker lets go.
    stream = iter(_client(tenant).chat.completions.create(
        model=quick, messages=[{"role": "user", "content": "Describe a forest."}], max_tokens=60, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = [next(stream)]
    with tenant.api() as api:
        assert api.delete(f"/v1/deployments/{quick}").json()["deleted"] is True
    text.extend(stream)
    assert text[-1].usage.completion_tokens == 60
    assert [c for c in text if c.choices and c.choices[0].finish_reason][0].choices[0].finish_reason == "length"
    wait_until(lambda: quick not in _engines_on_workers().get(quick_worker, {quick}), timeout=30,
               message="the deleted deployment's engine to be unloaded")
    assert f"deployment.{quick}" not in _consumed_queues(quick_worker)

    from billing.models import UsageRecord
    from workers.models import Replica

    streamed, answered = text[0].id, answers[quick].id  # the requests' ids
    wait_until(lambda: db_read(lambda: UsageRecord.objects.filter(request_id=streamed, completion_tokens=60,
                                                                  status="completed").count()) == 1,
               timeout=30, message="the request to be billed")
    wait_until(lambda: db_read(lambda: UsageRecord.objects.filter(request_id=answered).exists()), timeout=30,
               message="the request before the deletion to be billed")
    # Billed once, and nothing is left that could bill it again: the replica is released and no
    # copy of the request waits unacknowledged for a redelivery.
    wait_until(lambda: not db_read(lambda: Replica.objects.filter(deployment_name=quick).exists())
               and not _unacknowledged(quick), timeout=60,
               message="the deleted deployment's replica to be released and its request acknowledged")
    assert db_read(lambda: UsageRecord.objects.filter(request_id=streamed).count()) == 1
    # The request before the deletion and the streamed one: one record each, no other.
    assert db_read(lambda: UsageRecord.objects.filter(deployment_name=quick).count()) == 2


def test_a_broken_model_fails_with_its_reason_and_a_stopped_deployment_answers_at_once(
        fleet, tenant, deploy, db_read):
    from models_catalog.models import CatalogModel

    db_read(lambda: CatalogModel.objects.get_or_create(
        slug="broken", defaults={"display_name": "Broken", "architecture": "llama", "weights_path": "broken.gguf"}))
    broken = deploy(model="broken")["name"]
    wait_until(lambda: status_of(tenant, broken) == "failed", timeout=60, message="the load to fail")
    with tenant.api() as api:
        detail = api.get(f"/v1/deployments/{broken}").json()
    assert "failed to load" in detail["status_reason"]
    with pytest.raises(openai.APIStatusError) as refused:
        _chat(tenant, broken)
    assert refused.value.status_code == 503 and refused.value.code == "model_load_failed"

    with tenant.api() as api:
        assert api.post(f"/v1/deployments/{broken}/stop").json()["status"] == "stopped"
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        _chat(tenant, broken)
    assert refused.value.status_code == 503 and "stopped" in refused.value.message
    assert time.monotonic() - started < 15  # answered by the placement loop, not the 20 s queue timeout
    assert _replicas(db_read, broken) == []


def _running_on(hostname: str, deployment: str) -> int:
    """Requests the worker's engine for the deployment is generating for."""
    replies = app.control.broadcast("engine_stats", reply=True, timeout=3, destination=[hostname])
    return sum(reply.get("engines", {}).get(deployment, {}).get("running", 0)
               for answer in replies for reply in answer.values())


def _progress_records(deployment: str) -> list[dict]:
    from workers import fleet as broker

    r = broker.client()
    records = [r.hgetall(key) for key in r.scan_iter("inference:progress:*")]
    return [rec for rec in records if rec.get("deployment") == deployment]


def test_a_worker_paused_past_its_heartbeats_sends_and_bills_nothing_of_the_requests_handed_on(
        fleet, tenant, deploy, db_read):
    """SIGSTOP the worker serving a stream, with a second request waiting behind it (max_batch_size
    1): it is presumed dead, the stream ends with worker_lost and the waiting request is redelivered
    to a new replica. SIGCONT it while the new replica streams that request: the paused worker's
    copies must send nothing more and bill nothing. The client gets one answer, the new replica's,
    billed once for what it got."""
    import os
    import signal

    from billing.models import UsageRecord
    from workers.models import Worker

    name = deploy(min_replicas=1, max_batch_size=1)["name"]
    wait_until(lambda: status_of(tenant, name) == "ready", timeout=LOAD_TIMEOUT, interval=0.3,
               message=f"{name} to be ready")
    [(victim, _)] = _replicas(db_read, name)
    no_end = {"0": -100, "2": -100}  # only max_tokens ends these answers
    client = _client(tenant)
    first = iter(client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        max_tokens=120, temperature=0, stream=True, logit_bias=no_end))
    while not ((chunk := next(first)).choices and chunk.choices[0].delta.content):
        pass

    got: dict = {"text": "", "tokens": 0}

    def second_request():
        stream = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Count slowly to one hundred."}], max_tokens=200,
            temperature=0, stream=True, stream_options={"include_usage": True}, logit_bias=no_end)
        for part in stream:
            if part.choices and part.choices[0].delta.content:
                got["text"] += part.choices[0].delta.content
                got["tokens"] += 1
            if part.usage:
                got["usage"] = part.usage.completion_tokens

    second = threading.Thread(target=second_request)
    second.start()
    wait_until(lambda: sum(1 for rec in _progress_records(name) if rec.get("stage") == "started") == 1,
               timeout=30, message="the second request to wait in the engine")
    paused = fleet.workers[victim]
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        with pytest.raises(openai.APIError) as lost:
            for _ in first:
                pass
        assert "not billed" in lost.value.message
        wait_until(lambda: got["tokens"] >= 1, timeout=LOAD_TIMEOUT, interval=0.2,
                   message="the second request to stream from the new replica")
    finally:
        os.kill(paused.pid, signal.SIGCONT)  # back while the new replica still streams
    wait_until(lambda: db_read(lambda: Worker.objects.get(hostname=victim).status) == "alive", timeout=60,
               message="the paused worker to be back")
    second.join(timeout=LOAD_TIMEOUT)
    assert not second.is_alive()
    assert got["usage"] == 200 and got["tokens"] <= 200  # one copy's tokens, not two copies' mixed
    reference = _client(tenant).chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Count slowly to one hundred."}], max_tokens=200,
        temperature=0, logit_bias=no_end)
    # Greedy: a lone run's answer, up to where a near tie may tip another way (the reference's
    # prompt can come from the prefix cache, its sums in another order). Two copies mixed would
    # start it over: its opening shows once.
    opening = reference.choices[0].message.content[:40]
    assert got["text"].startswith(opening) and got["text"].count(opening) == 1, (got["text"], opening)

    def records():
        rows = db_read(lambda: sorted(UsageRecord.objects.filter(deployment_name=name)
                                      .values_list("status", "completion_tokens")))
        return rows if len(rows) == 3 else None

    rows = wait_until(records, timeout=60, message="the three requests to be recorded")
    assert rows == [("completed", 200), ("completed", 200), ("failed", 0)]  # the second, once, for what it got


def _finished_on(hostname: str, deployment: str) -> int:
    """Requests the worker's engine for the deployment has finished."""
    replies = app.control.broadcast("engine_stats", reply=True, timeout=3, destination=[hostname])
    return sum(reply.get("engines", {}).get(deployment, {}).get("requests_finished", 0)
               for answer in replies for reply in answer.values())


def test_a_burst_waits_on_the_queue_so_that_the_replica_added_for_it_takes_its_share(
        fleet, tenant, deploy, db_read):
    """A worker takes what its engine batches (2 here), a quarter more (1) and one per other queue it
    consumes (default, billing), not a request per thread (16): the rest of a burst waits on the
    deployment's queue, where the placement loop sees it, and the replica it adds for it serves
    part of it."""
    from workers import fleet as broker

    name = deploy(min_replicas=1, max_replicas=2, max_batch_size=2, batch_window_ms=0)["name"]
    wait_until(lambda: status_of(tenant, name) == "ready", timeout=LOAD_TIMEOUT, interval=0.3,
               message=f"{name} to be ready")
    [(first, _)] = _replicas(db_read, name)

    burst = 14
    answers: dict[int, object] = {}
    clients = [threading.Thread(target=lambda i=i: answers.__setitem__(
        i, _chat(tenant, name, f"Write a long story about lighthouse number {i}.", max_tokens=64)))
        for i in range(burst)]
    for thread in clients:
        thread.start()

    def queued() -> int:
        return broker.queue_depths([name])[name]

    held = 3 + 2
    wait_until(lambda: len(_unacknowledged(name)) == held and queued() >= burst - held - _finished_on(first, name),
               timeout=60, interval=0.05, message=f"the worker to hold {held} of the burst and the rest to wait")
    assert len(_unacknowledged(name)) <= held

    wait_until(lambda: len([s for _, s in _replicas(db_read, name) if s == "ready"]) == 2, timeout=LOAD_TIMEOUT,
               interval=0.3, message="a second replica for the burst")
    [second] = [w for w, _ in _replicas(db_read, name) if w != first]
    for thread in clients:
        thread.join(timeout=LOAD_TIMEOUT)
    assert len(answers) == burst
    assert all(a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 64 for a in answers.values())

    def served() -> dict[str, int] | None:  # the engines' figures are refreshed after their step
        counts = {first: _finished_on(first, name), second: _finished_on(second, name)}
        return counts if sum(counts.values()) == burst else None

    assert wait_until(served, timeout=30, message="both engines' figures")[second] > 0


def test_a_worker_killed_mid_request_is_replaced_and_its_requests_are_not_lost(fleet, tenant, deploy, db_read):
    """SIGKILL the worker generating two requests: one streaming (its client gets a clear error and
    it is recorded, free, as failed), one whose client does not stream (the gateway held its tokens,
    the client saw nothing): redelivered to the replacement replica and answered whole. Both billed
    exactly once."""
    from billing.models import UsageRecord
    from workers.models import FleetEvent, Worker

    name = deploy(min_replicas=1, max_batch_size=2)["name"]
    wait_until(lambda: status_of(tenant, name) == "ready", timeout=LOAD_TIMEOUT, interval=0.3,
               message=f"{name} to be ready")
    [(victim, _)] = _replicas(db_read, name)

    client = _client(tenant)
    stream = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        max_tokens=400, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    while not (first.choices and first.choices[0].delta.content):
        first = next(chunks)

    waiting: dict = {}
    second = threading.Thread(target=lambda: waiting.__setitem__("answer", _chat(tenant, name, "Count to five.", 12)))
    second.start()
    wait_until(lambda: _running_on(victim, name) == 2, timeout=30, message="both requests to be generating")
    for _ in range(3):  # a few steps of both: the second's first tokens have reached the gateway
        next(chunks)

    fleet.kill(victim)
    killed = time.monotonic()
    with pytest.raises(openai.APIError) as lost:
        for _ in chunks:
            pass
    assert "stopped" in lost.value.message and "not billed" in lost.value.message

    wait_until(lambda: db_read(lambda: Worker.objects.get(hostname=victim).status) == "gone", timeout=30,
               message="the killed worker to be marked gone")
    gone_after = time.monotonic() - killed
    wait_until(lambda: any(w != victim and s == "ready" for w, s in _replicas(db_read, name)), timeout=LOAD_TIMEOUT,
               interval=0.3, message="the deployment to be ready on another worker")
    replaced_after = time.monotonic() - killed
    second.join(timeout=LOAD_TIMEOUT)
    assert not second.is_alive() and waiting["answer"].choices[0].message.content
    print(f"\nworker killed: marked gone after {gone_after:.1f}s, ready elsewhere after {replaced_after:.1f}s")

    kinds = db_read(lambda: list(FleetEvent.objects.filter(worker=victim).values_list("kind", flat=True)))
    assert {"worker_gone", "interrupted", "redelivered"} <= set(kinds)

    def records():
        rows = db_read(lambda: list(UsageRecord.objects.filter(deployment_name=name)
                                    .values_list("status", "completion_tokens", "cost")))
        return rows if len(rows) == 2 else None

    rows = sorted(wait_until(records, timeout=60, message="both requests to be recorded"))
    (done_status, done_tokens, _), (failed_status, failed_tokens, failed_cost) = rows
    assert (done_status, failed_status) == ("completed", "failed")
    assert done_tokens > 0 and failed_tokens == 0 and failed_cost == 0
