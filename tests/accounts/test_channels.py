"""ApiKeyAuthMiddleware over a real ASGI WebSocket handshake.

``channels.testing`` imports daphne (a server we do not use), so the handshake is driven with
asgiref's ApplicationCommunicator, which channels' WebsocketCommunicator is a thin layer over.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.testing import ApplicationCommunicator
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.db import connections

from accounts.middleware import ApiKeyAuthMiddlewareStack
from accounts.models import ApiKey
from accounts.services import create_api_key, create_organization, create_user, revoke_api_key

# The middleware queries on asgiref's worker thread, which sees committed data only.
pytestmark = pytest.mark.django_db(transaction=True)


class Echo(AsyncJsonWebsocketConsumer):
    channel_layer_alias = "no-layer"  # this consumer needs no channel layer
    async def connect(self):
        await self.accept()
        key = self.scope["api_key"]
        org = self.scope["organization"]
        user = self.scope.get("user")
        await self.send_json({
            "key_id": key.pk if key else None,
            "organization": org.slug if org else None,
            "auth_error": self.scope["auth_error"],
            "user": str(user) if user is not None and user.is_authenticated else None,
        })


APP = ApiKeyAuthMiddlewareStack(Echo.as_asgi())


def handshake(headers):
    async def run():
        scope = {"type": "websocket", "path": "/v1/ws", "query_string": b"", "headers": headers, "subprotocols": []}
        communicator = ApplicationCommunicator(APP, scope)
        await communicator.send_input({"type": "websocket.connect"})
        assert (await communicator.receive_output(5))["type"] == "websocket.accept"
        frame = await communicator.receive_output(5)
        assert frame["type"] == "websocket.send"
        await communicator.send_input({"type": "websocket.disconnect", "code": 1000})
        await communicator.wait(1)
        return json.loads(frame["text"])

    try:
        return asyncio.run(run())
    finally:
        # The middleware queried on asgiref's worker thread: close that thread's connection.
        asyncio.run(database_sync_to_async(connections.close_all)())


@pytest.fixture
def owner():
    return create_user(email="ada@example.com", password="a-long-pass-phrase-42")


@pytest.fixture
def org(owner):
    return create_organization(name="Acme", owner=owner)


def test_a_bearer_key_in_the_handshake_sets_key_and_organization(org, owner):
    api_key, raw = create_api_key(organization=org, name="k", scopes=["inference"], created_by=owner)
    message = handshake([(b"authorization", f"Bearer {raw}".encode())])
    assert message == {"key_id": api_key.pk, "organization": "acme", "auth_error": None, "user": "ada@example.com"}
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at is not None


def test_a_revoked_key_gives_an_auth_error_and_no_organization(org):
    api_key, raw = create_api_key(organization=org, name="k", scopes=["inference"])
    revoke_api_key(api_key=api_key)
    message = handshake([(b"authorization", f"Bearer {raw}".encode())])
    assert message["key_id"] is None and message["organization"] is None
    assert "revoked" in message["auth_error"]


@pytest.mark.parametrize("loss", ["deactivated", "deleted"])
def test_a_key_whose_creator_lost_access_gives_an_auth_error(org, owner, loss):
    _, raw = create_api_key(organization=org, name="k", scopes=["inference"], created_by=owner)
    if loss == "deactivated":
        owner.is_active = False
        owner.save(update_fields=["is_active"])
    else:
        owner.delete()
    message = handshake([(b"authorization", f"Bearer {raw}".encode())])
    assert message["key_id"] is None and message["organization"] is None
    assert {"deactivated": "deactivated user", "deleted": "revoked"}[loss] in message["auth_error"]


def test_a_garbage_header_gives_an_auth_error():
    message = handshake([(b"authorization", b"Bearer sk-garbage")])
    assert message["organization"] is None and "Incorrect API key" in message["auth_error"]


def test_no_credentials_says_how_to_send_a_key():
    message = handshake([])
    assert message["organization"] is None and "Authorization" in message["auth_error"]


def test_a_session_user_gets_the_session_organization_or_the_first(client, owner, org):
    other = create_organization(name="Second", owner=owner)
    client.force_login(owner)
    cookie = [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())]
    message = handshake(cookie)
    assert message == {"key_id": None, "organization": "acme", "auth_error": None, "user": "ada@example.com"}

    session = client.session
    session["organization_id"] = other.pk
    session.save()
    assert handshake(cookie)["organization"] == "second"


def test_a_session_user_without_organization_gets_an_auth_error(client):
    loner = create_user(email="loner@example.com", password="a-long-pass-phrase-42")
    client.force_login(loner)
    message = handshake([(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())])
    assert message["organization"] is None and "organization" in message["auth_error"]
