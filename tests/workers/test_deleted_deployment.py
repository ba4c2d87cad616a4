"""Deleting a deployment while requests wait on its queue (no worker has taken them): each waiting
client is answered at once with a clean 404 in OpenAI's shape (``workers.signals`` answers them
when the deletion commits), the requests are cancelled, and nothing is billed.

In process with real parts: the gateway's views called by a client in a thread (it waits on the
reply channel as a server would), the deployments API deleting in the test's thread, real Redis
queues that nobody consumes. The rows are committed (a transactional test): the two threads use
two database connections."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import pytest
from channels.layers import get_channel_layer
from django.db import connections

from tests.gateway.test_timeouts import cancel_marked
from tests.support import wait_until
from tests.workers.test_capacity import queued_ticks

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def tenant():
    """An organization, a key that may call and manage deployments, and no fleet worker."""
    from accounts import services
    from models_catalog.services import seed_catalog
    from workers.models import Worker

    seed_catalog()
    Worker.objects.all().delete()  # nobody can host anything: the requests stay queued
    tag = uuid.uuid4().hex[:8]
    user = services.create_user(email=f"{tag}@example.com", password=None)
    org = services.create_organization(name=f"org-{tag}", owner=user)
    _, plaintext = services.create_api_key(organization=org, name="t", scopes=["inference", "manage"], created_by=user)
    return org, {"HTTP_AUTHORIZATION": f"Bearer {plaintext}"}


@pytest.fixture(autouse=True)
def _no_placement_requests_left():
    """The placement-loop runs the deployment's creation and the requests asked for: nobody
    consumes them here; taken off the `default` queue afterwards."""
    from workers import fleet

    before = set(queued_ticks())
    yield
    for raw in set(queued_ticks()) - before:
        fleet.client().lrem("default", 0, raw)


def queue_depth(name: str) -> int:
    from workers import fleet

    return fleet.queue_depths([name])[name]


def wait_in_thread(path: str, body: dict, headers: dict, *, clients: int) -> tuple[threading.Thread, dict]:
    """``clients`` concurrent POSTs of ``body``, made from another thread on one event loop (the
    channel layer serves one loop at a time, as in a server process); the responses land in the
    returned dict."""
    from asgiref.sync import sync_to_async
    from django.test import AsyncClient

    result: dict = {}
    auth = {"authorization": headers["HTTP_AUTHORIZATION"]}

    async def post_all():
        try:
            return await asyncio.gather(*(AsyncClient().post(path, data=json.dumps(body), content_type="application/json",
                                                             headers=auth) for _ in range(clients)))
        finally:  # the admission trips' thread: its connection must not outlive the test
            await sync_to_async(connections.close_all)()

    def run():
        try:
            result["responses"] = asyncio.run(post_all())
        except BaseException as exc:  # reported by the test, not lost in the thread
            result["error"] = exc

    get_channel_layer()  # made here, once, not by the thread while the test's own thread sends
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}),
    ("/v1/completions", {"prompt": "Hi"}),
])
def test_requests_waiting_on_a_deleted_deployment_get_a_404_and_are_not_billed(client, settings, tenant, path, body):
    from billing.models import UsageRecord
    from workers import fleet

    settings.GATEWAY_QUEUE_TIMEOUT = 300  # only the deletion can end these waits
    settings.FLEET_COLD_START_TIMEOUT = 300
    org, headers = tenant
    name = f"doomed-{uuid.uuid4().hex[:8]}"
    created = client.post("/v1/deployments", data=json.dumps({"name": name, "model": "smollm2-135m-instruct"}),
                          content_type="application/json", **headers)
    assert created.status_code == 201, created.content
    try:
        thread, result = wait_in_thread(path, {"model": name, **body}, headers, clients=2)
        wait_until(lambda: queue_depth(name) == 2 or not thread.is_alive(), timeout=60,
                   message="both requests to wait on the deployment's queue")
        assert thread.is_alive(), result

        deleted = client.delete(f"/v1/deployments/{name}", **headers)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True

        thread.join(timeout=60)
        assert not thread.is_alive(), "a waiting client was not answered"
        assert "error" not in result, result
        for response in result["responses"]:
            assert response.status_code == 404, response.content
            assert response["Content-Type"] == "application/json"  # before any SSE byte, also when streaming
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (error["type"], error["code"]) == ("invalid_request_error", "model_not_found")
            assert name in error["message"] and "deleted" in error["message"]
            assert cancel_marked(response["x-request-id"])  # a redelivered copy would not run
        assert queue_depth(name) == 0  # taken off the queue, not left for a future namesake
        assert not UsageRecord.objects.filter(organization=org).exists()
        # The name is free again, and the next request to it is simply unknown.
        again = client.post(path, data=json.dumps({"model": name, **body}), content_type="application/json",
                            **headers)
        assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
    finally:
        fleet.client().delete(*fleet.queue_lists(f"deployment.{name}"))
