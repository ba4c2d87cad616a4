"""The WebSocket handshake refuses pages of other sites: a browser sends their Origin, and would
carry the dashboard's session cookie along; API clients send no Origin and pass with their key."""

from __future__ import annotations

import json

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from .conftest import DEPLOYMENT
from .test_websocket import frames_until_done, ws_url

pytestmark = pytest.mark.slow


def _connect(tenant, **headers):
    return connect(ws_url(tenant), additional_headers={"Authorization": f"Bearer {tenant.api_key}", **headers},
                   open_timeout=30, close_timeout=5)


@pytest.mark.parametrize("origin", ["http://evil.example", "https://127.0.0.1.evil.example", "null",
                                    "http://127.0.0.1:1", "http://localhost:{port}"])
def test_a_handshake_from_another_origin_is_refused(tenant, origin):
    """Another site, or another port or name of this host (the session cookie goes to every port)."""
    with pytest.raises(InvalidStatus) as refused:
        _connect(tenant, Origin=origin.format(port=tenant.base_url.rsplit(":", 1)[1]))
    assert refused.value.response.status_code == 403


def test_the_dashboards_own_origin_and_api_clients_are_served(tenant):
    own = tenant.base_url  # http://127.0.0.1:<port>: the host is in ALLOWED_HOSTS
    for headers in ({"Origin": own}, {}):
        with _connect(tenant, **headers) as ws:
            ws.send(json.dumps({"request_id": "o", "model": DEPLOYMENT, "max_tokens": 2,
                                "messages": [{"role": "user", "content": "Hi"}]}))
            assert frames_until_done(ws, "o")[-1] == {"type": "done", "request_id": "o"}
