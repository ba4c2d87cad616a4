"""The playground's socket bills the organization its page shows: the page's URL names it
(``/v1/ws?organization=<id>``), and the server holds to it even after the session's current
organization changed in another tab, or refuses the socket when the user does not belong to it.

Driven through the real handshake (Channels' session and user, then ``ApiKeyAuthMiddleware``) into
``InferenceConsumer``; admission is a stand-in that records which organization each request
would bill, then stops it."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.testing import ApplicationCommunicator
from channels.db import database_sync_to_async
from django.db import connections

from accounts.middleware import ApiKeyAuthMiddlewareStack
from accounts.services import add_member, create_organization, create_user, remove_member
from gateway import calls
from gateway.consumers import InferenceConsumer
from gateway.errors import ApiError

# The middleware queries on asgiref's worker thread, which sees committed data only.
pytestmark = pytest.mark.django_db(transaction=True)

APP = ApiKeyAuthMiddlewareStack(InferenceConsumer.as_asgi())
REQUEST = {"request_id": "r1", "model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def converse(client, query: str, frames: list[dict], outputs: int) -> tuple[list[dict], list[int]]:
    """Open the socket with ``client``'s session cookie and ``query``, send ``frames``; the first
    ``outputs`` ASGI messages after the accept, and the organization each admitted request billed."""
    billed: list[int] = []

    async def begin(request, *, caller, endpoint):
        billed.append((await database_sync_to_async(caller)()).org_id)
        raise ApiError(429, "stopped by the test before dispatch", code="test_stop")

    scope = {"type": "websocket", "path": "/v1/ws", "query_string": query.encode(), "subprotocols": [],
             "headers": [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())]}

    async def run():
        communicator = ApplicationCommunicator(APP, scope)
        await communicator.send_input({"type": "websocket.connect"})
        assert (await communicator.receive_output(5))["type"] == "websocket.accept"
        for frame in frames:
            await communicator.send_input({"type": "websocket.receive", "text": json.dumps(frame)})
        out = [await communicator.receive_output(5) for _ in range(outputs)]
        await communicator.send_input({"type": "websocket.disconnect", "code": 1000})
        await communicator.wait(2)
        return out

    original = calls.begin
    calls.begin = begin
    try:
        return asyncio.run(run()), billed
    finally:
        calls.begin = original
        asyncio.run(database_sync_to_async(connections.close_all)())


@pytest.fixture(autouse=True)
def memory_channel_layer(settings):
    """Nothing here reaches a worker: an in-memory layer spares each socket's close the Redis
    layer's pending 5 s blocking pop."""
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.fixture
def ada():
    return create_user(email="ada@example.com", password=None)


@pytest.fixture
def page_org(ada):
    return create_organization(name="Acme", owner=ada)


@pytest.fixture
def switched(client, ada, page_org):
    """Ada's session, whose current organization became another one of hers (another tab)."""
    other = create_organization(name="Second", owner=ada)
    client.force_login(ada)
    session = client.session
    session["organization_id"] = other.pk
    session.save()
    return client, other


def test_the_socket_bills_the_organization_its_url_names_not_the_sessions_new_one(switched, page_org):
    client, other = switched
    [frame], billed = converse(client, f"organization={page_org.pk}", [REQUEST], 1)
    assert json.loads(frame["text"])["error"]["code"] == "test_stop"
    assert billed == [page_org.pk]
    # Without the parameter (an API client on a session), the session's current one, as before.
    _, billed = converse(client, "", [REQUEST], 1)
    assert billed == [other.pk]


@pytest.mark.parametrize("named", ["foreign", "removed", "garbage"])
def test_an_organization_the_user_is_not_in_is_refused_at_the_handshake_and_nothing_is_billed(
        switched, ada, page_org, named):
    client, _ = switched
    if named == "foreign":
        organization = create_organization(name="Globex", owner=create_user(email="grace@example.com", password=None))
        query = f"organization={organization.pk}"
    elif named == "removed":  # the page was opened before the user left it
        add_member(organization=page_org, user=create_user(email="owner2@example.com", password=None), role="owner")
        remove_member(organization=page_org, user=ada)
        query = f"organization={page_org.pk}"
    else:
        query = "organization=not-a-number"
    (error, close), billed = converse(client, query, [], 2)
    body = json.loads(error["text"])
    assert body["type"] == "error" and body["request_id"] is None
    assert body["error"]["code"] == "not_a_member"
    assert "not a member of the organization this page was opened for" in body["error"]["message"]
    assert "Reload the page" in body["error"]["message"]
    assert close["type"] == "websocket.close" and close["code"] == 4403
    assert billed == []
