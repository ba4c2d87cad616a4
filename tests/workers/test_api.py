"""The fleet's API: a deployment's live metrics (summed over the workers' heartbeats), the workers
list (operators only) and the Prometheus endpoint."""

from __future__ import annotations

import time
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from accounts.services import create_api_key, create_organization, create_user
from models_catalog.models import CatalogModel, Deployment
from models_catalog.services import create_deployment
from workers import services
from workers.models import FleetEvent, Replica, Worker

pytestmark = pytest.mark.django_db


def bearer(raw: str) -> dict:
    return {"Authorization": f"Bearer {raw}"}


@pytest.fixture
def world():
    Worker.objects.all().delete()
    model = CatalogModel.objects.create(slug=f"m-{uuid.uuid4().hex[:6]}", display_name="M", architecture="llama",
                                        weights_path="m.gguf")
    owner = create_user(email=f"{uuid.uuid4().hex[:8]}@acme.test", password=None)
    acme = create_organization(name="Acme", owner=owner)
    _, key = create_api_key(organization=acme, name="k", scopes=["manage"], created_by=owner)
    other = create_organization(name="Other", owner=create_user(email=f"{uuid.uuid4().hex[:8]}@o.test", password=None))
    mine = create_deployment(organization=acme, model=model, name=f"mine-{uuid.uuid4().hex[:6]}")
    theirs = create_deployment(organization=other, model=model, name=f"theirs-{uuid.uuid4().hex[:6]}", kind="dedicated")
    workers = []
    for label, latencies in (("a", [100, 200, 300]), ("b", [400])):
        worker = services.register_worker(hostname=f"gpu-{label}-{uuid.uuid4().hex[:4]}@host", instance=label * 8,
                                          pid=7, device_kind="cuda", device_name="NVIDIA H100", slots=1,
                                          device_memory_bytes=80 << 30, queues=["default"])
        Replica.objects.create(worker=worker, deployment=mine, deployment_name=mine.name, status="ready",
                               assigned_at=worker.started_at, ready_at=worker.started_at)
        services.record_heartbeat(hostname=worker.hostname, instance=worker.instance,
                                  queues=["default", f"deployment.{mine.name}"], queue_depths={mine.name: 0},
                                  deployments={mine.name: {
                                      "state": "ready", "deployment_id": mine.pk, "in_flight": 1, "window_s": 60,
                                      "requests": len(latencies), "failed": 0, "prompt_tokens": 100,
                                      "completion_tokens": 600, "latencies_ms": latencies, "ttft_ms": [20] * len(latencies),
                                      "steps": 100, "generated_tokens": 250,
                                      "engine": {"waiting": 2, "running": 1, "kv_blocks_used": 10, "kv_blocks_total": 64, "steps": 1000,
                                                 "kv_capacity_tokens": 40960},
                                  }})
        workers.append(worker)
    FleetEvent.objects.create(kind="ready", deployment=mine, deployment_name=mine.name, worker=workers[0].hostname,
                              cold_start=True, seconds=4.25)
    return {"key": key, "mine": mine, "theirs": theirs, "workers": workers, "owner": owner}


def await_requests(name: str, count: int) -> None:
    """``count`` admitted requests that wait for their first token, as the gateway records them."""
    from workers import dispatch, fleet

    now_ms = int(time.time() * 1000)
    fleet.client().zadd(dispatch.waiting_key(name), {uuid.uuid4().hex: now_ms for _ in range(count)})


def test_deployment_metrics_add_up_the_workers_last_minute(client, world):
    await_requests(world["mine"].name, 5)
    body = client.get(f"/v1/deployments/{world['mine'].name}/metrics", headers=bearer(world["key"])).json()
    assert body["object"] == "deployment.metrics" and body["replicas_ready"] == 2
    assert body["requests_per_minute"] == 4.0 and body["tokens_per_second"] == 20.0  # 1200 tokens / 60 s
    assert (body["latency_p50_ms"], body["latency_p99_ms"]) == (200.0, 400.0)
    assert body["average_batch_size"] == 2.5 and body["in_flight"] == 2
    assert body["queue_depth"] == 4  # nothing on the Redis queue, 2 waiting in each engine
    assert (body["cold_starts_total"], body["last_cold_start_seconds"]) == (1, 4.25)
    assert sorted(body["workers"]) == sorted(w.hostname for w in world["workers"])


def test_the_queue_depth_leaves_out_messages_nobody_waits_for(client, world):
    """A request given up on (a 503, a client gone) leaves its message on the queue until a worker
    skips it: it is not a request waiting."""
    from workers import fleet

    name = world["mine"].name
    fleet.client().lpush(fleet.deployment_queue(name), *["{}"] * 3)
    await_requests(name, 1)
    body = client.get(f"/v1/deployments/{name}/metrics", headers=bearer(world["key"])).json()
    assert body["queue_depth"] == 1


def test_a_public_deployments_metrics_leave_its_workers_out_for_tenants(client, world):
    public = create_deployment(organization=None, model=world["mine"].model, name=f"pub-{uuid.uuid4().hex[:6]}",
                               is_public=True)
    Replica.objects.create(worker=world["workers"][0], deployment=public, deployment_name=public.name,
                           status="ready", assigned_at=world["workers"][0].started_at,
                           ready_at=world["workers"][0].started_at)
    body = client.get(f"/v1/deployments/{public.name}/metrics", headers=bearer(world["key"])).json()
    assert body["replicas_ready"] == 1 and "workers" not in body
    operator = create_user(email=f"ops-{uuid.uuid4().hex[:6]}@platform.test", password=None)
    operator.is_staff = True
    operator.save(update_fields=["is_staff"])
    client.force_login(operator)
    assert "workers" in client.get(f"/v1/deployments/{public.name}/metrics").json()


def test_another_organizations_metrics_do_not_exist(client, world):
    response = client.get(f"/v1/deployments/{world['theirs'].name}/metrics", headers=bearer(world["key"]))
    assert response.status_code == 404 and response.json()["error"]["code"] == "deployment_not_found"


def test_only_operators_see_the_workers(client, world):
    response = client.get("/v1/fleet/workers", headers=bearer(world["key"]))
    assert response.status_code == 403 and response.json()["error"]["type"] == "invalid_request_error"
    assert client.get("/v1/fleet/workers").status_code == 401

    operator = create_user(email="ops@platform.test", password=None)
    operator.is_staff = True
    operator.save(update_fields=["is_staff"])
    client.force_login(operator)
    data = client.get("/v1/fleet/workers").json()["data"]
    assert {w["id"] for w in data} == {w.hostname for w in world["workers"]}
    first = data[0]
    assert first["device"] == {"kind": "cuda", "name": "NVIDIA H100", "memory_bytes": 80 << 30}
    assert first["serving"][0]["deployment"] == world["mine"].name and first["status"] == "alive"
    assert "latencies_ms" not in first["engines"][world["mine"].name]


def _families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_prometheus_metrics_with_the_token(client, world, settings):
    settings.METRICS_TOKEN = "scrape-me"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=bearer("wrong")).status_code == 401
    response = client.get("/metrics", headers=bearer("scrape-me"))
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain")
    families = _families(response.content.decode())
    name = world["mine"].name

    def value(family, **labels):
        for sample in families[family].samples:
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
        raise AssertionError(f"no {family} with {labels}")

    assert value("inference_deployment_requests_per_minute", deployment=name, organization="acme") == 4.0
    assert value("inference_deployment_latency_ms", deployment=name, quantile="0.99") == 400.0
    assert value("inference_deployment_status", deployment=name, status="pending") == 1.0
    assert value("inference_deployment_cold_starts", deployment=name) == 1.0
    assert value("inference_worker_up", worker=world["workers"][0].hostname) == 1.0
    assert value("inference_engine_waiting", worker=world["workers"][1].hostname, deployment=name) == 2.0
    assert value("inference_engine_steps", worker=world["workers"][1].hostname, deployment=name) == 1000.0
    assert value("inference_engine_kv_capacity_tokens", worker=world["workers"][1].hostname, deployment=name) == 40960
    assert value("inference_engine_kv_blocks_capacity", worker=world["workers"][1].hostname, deployment=name) == 64
    assert not [f for f in families.values() if f.type == "gauge" and f.name.endswith("_total")]


def test_prometheus_metrics_for_an_operator_without_a_token(client, world, settings):
    settings.METRICS_TOKEN = ""
    client.force_login(world["owner"])
    assert client.get("/metrics").status_code == 401  # not staff
    world["owner"].is_staff = True
    world["owner"].save(update_fields=["is_staff"])
    assert client.get("/metrics").status_code == 200
    assert Deployment.objects.count() >= 2


def test_prometheus_metrics_while_redis_is_unreachable_keep_the_databases_figures(client, world, settings,
                                                                                 monkeypatch):
    """A scrape during an incident is when the figures matter: the queue depth is left out, not a 500."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from workers import fleet

    def unreachable(names):
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(fleet, "queue_depths", unreachable)
    settings.METRICS_TOKEN = "scrape-me"
    response = client.get("/metrics", headers=bearer("scrape-me"))
    assert response.status_code == 200
    families = _families(response.content.decode())
    name = world["mine"].name
    assert any(s.labels.get("deployment") == name and s.value == 4.0
               for s in families["inference_deployment_requests_per_minute"].samples)
    assert not families.get("inference_deployment_queue_depth") or \
        not families["inference_deployment_queue_depth"].samples
    detail = client.get(f"/v1/deployments/{name}/metrics", headers=bearer(world["key"]))
    assert detail.status_code == 200 and detail.json()["queue_depth"] is None
    assert detail.json()["requests_per_minute"] == 4.0
