"""A request to a scaled-to-zero deployment waits, bounded, for a worker to load it: when no
replica ever comes, the client gets a 503 in OpenAI's shape after that bound, the request is
cancelled where it waits, and nothing is billed. In process: the real views, real Redis (the
request really is queued on the deployment's queue, which nobody consumes), short bounds."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.gateway.conftest import own_deployment
from tests.gateway.test_timeouts import cancel_marked

pytestmark = pytest.mark.django_db
QUEUE_TIMEOUT, COLD_START_TIMEOUT = 0.2, 1.0


@pytest.fixture
def scaled_to_zero(seeded, org_key):
    """An organization's serverless deployment at zero replicas, and its key."""
    from models_catalog.models import Deployment

    with own_deployment(org_key, seeded, prefix="cold", status=Deployment.Status.SCALED_TO_ZERO) as made:
        yield made


@pytest.fixture
def waits(monkeypatch):
    """The bounds ``capacity.wake`` chose, and those the gateway then waited on the reply channel
    with (the real functions, observed)."""
    from gateway.calls import Call
    from workers import capacity

    chosen: list[float] = []
    waited: list[float] = []
    real_wake, real_receive = capacity.wake, Call._receive

    def wake(spec):
        chosen.append(real_wake(spec))
        return chosen[-1]

    async def receive(self, timeout):
        waited.append(timeout)
        return await real_receive(self, timeout)

    monkeypatch.setattr(capacity, "wake", wake)
    monkeypatch.setattr(Call, "_receive", receive)
    return chosen, waited


def register_worker(*, slots: int) -> None:
    """An alive worker as the database knows it; no process behind it, so nothing ever loads."""
    from workers import services

    services.register_worker(
        hostname=f"test-cold-{uuid.uuid4().hex[:6]}@nowhere", instance=uuid.uuid4().hex[:16], pid=1,
        device_kind="cpu", device_name="cpu", device_memory_bytes=8 << 30, slots=slots, queues=["default"])


@pytest.mark.parametrize("path,body,stream", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, True),
    ("/v1/completions", {"prompt": "Hi"}, False),
])
@pytest.mark.parametrize("worker_free", [True, False], ids=["a-worker-could-load-it", "no-worker"])
def test_a_cold_start_that_never_comes_is_a_503_and_not_billed(client, settings, scaled_to_zero, waits,
                                                                 path, body, stream, worker_free):
    from billing.models import UsageRecord
    from workers.models import Worker

    settings.GATEWAY_QUEUE_TIMEOUT = QUEUE_TIMEOUT
    settings.FLEET_COLD_START_TIMEOUT = COLD_START_TIMEOUT
    org, key, name = scaled_to_zero
    Worker.objects.all().delete()
    if worker_free:
        register_worker(slots=1)

    response = client.post(path, data=json.dumps({"model": name, "stream": stream, **body}),
                           content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}")

    # The wait was the cold-start bound only when a worker could have loaded the model.
    bound = COLD_START_TIMEOUT if worker_free else QUEUE_TIMEOUT
    assert waits == ([bound], [bound])
    assert response.status_code == 503, response.content
    assert response["Content-Type"] == "application/json"  # before any SSE byte, also when streaming
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("server_error", "model_unavailable", None)
    assert name in error["message"]
    request_id = response["x-request-id"]
    assert cancel_marked(request_id)  # a worker that loads the model later must not run it for nobody
    assert not UsageRecord.objects.filter(organization=org).exists()
    assert not UsageRecord.objects.filter(request_id=request_id).exists()


def test_a_stopped_deployment_is_refused_at_once_not_queued(client, scaled_to_zero, waits, caplog):
    """As the owner stopped it: 503 model_unavailable before anything is queued or waited on (a
    full queue's "retry shortly" would have clients retry a deployment nothing will serve), and
    logged as the warning it is, not as Django's ERROR for a 5xx."""
    from billing.models import UsageRecord
    from models_catalog.models import Deployment
    from models_catalog.services import set_deployment_status
    from workers import fleet

    org, key, name = scaled_to_zero
    set_deployment_status(deployment=Deployment.objects.get(name=name), status=Deployment.Status.STOPPED,
                          reason="Stopped because your organization cannot pay for more.")
    with caplog.at_level("INFO"):
        response = client.post("/v1/chat/completions", data=json.dumps(
            {"model": name, "messages": [{"role": "user", "content": "Hi"}]}),
            content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 503, response.content
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert any(r.levelname == "WARNING" and "model_unavailable" in r.getMessage() for r in caplog.records)
    error = response.json()["error"]
    assert error["code"] == "model_unavailable"
    assert error["message"] == (f"The deployment '{name}' is stopped (Stopped because your organization cannot pay "
                                "for more); start it to send it requests.")
    assert waits == ([], [])  # no wait at all
    assert fleet.client().llen(f"deployment.{name}") == 0 and not UsageRecord.objects.filter(organization=org).exists()
