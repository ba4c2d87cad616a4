"""The inference endpoints skip the site's middleware but keep its security checks and headers;
every other path still goes through all of it."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from asgiref.testing import ApplicationCommunicator
from django.test import override_settings

from gateway import admission
from inference_platform.api_handler import ApiHandler

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def application():
    """The server's ASGI application, imported without making this process a server: a server's
    admission trips run on long-lived threads with connections of their own, which would not see
    the tests' transactions and would keep the test database open."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(admission, "use_threads", lambda count=4: None)
        from inference_platform.asgi import application
    return application


async def _call(app, method: str, path: str, body: bytes = b"") -> dict:
    """One HTTP request through the ASGI application, as a server would make it."""
    scope = {"type": "http", "http_version": "1.1", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http", "headers": [(b"host", b"localhost")],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80)}
    communicator = ApplicationCommunicator(app, scope)
    await communicator.send_input({"type": "http.request", "body": body, "more_body": False})
    start = await communicator.receive_output(30)
    response = {"status": start["status"], "headers": start["headers"], "body": b""}
    while True:
        message = await communicator.receive_output(30)
        response["body"] += message.get("body", b"")
        if not message.get("more_body"):
            return response


def _headers(response) -> dict:
    return {name.decode().lower(): value.decode() for name, value in response["headers"]}


@pytest.mark.parametrize("method,path", [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/embeddings"), ("POST", "/v1/responses"),
                                         ("GET", "/v1/responses/resp_1"), ("GET", "/v1/responses/resp_1/input_items"),
                                         ("GET", "/v1/models"), ("GET", "/v1/models/anything")])
def test_an_inference_endpoint_answers_with_the_security_headers_and_no_session_machinery(application, method, path):
    response = async_to_sync(_call)(application, method, path, b"{}")
    headers = _headers(response)
    assert response["status"] == 401
    assert json.loads(response["body"])["error"]["code"] == "invalid_api_key"
    assert headers["x-content-type-options"] == "nosniff" and headers["referrer-policy"] == "same-origin"
    assert "x-frame-options" not in headers and "vary" not in headers  # no clickjacking or session middleware
    prefix = {"/v1/chat/completions": "chatcmpl-", "/v1/completions": "cmpl-", "/v1/embeddings": "embd-",
              "/v1/responses": "resp_"}.get(path, "req_")
    assert headers["x-request-id"].startswith(prefix) and len(headers["x-request-id"]) > len(prefix) + 16


def test_other_paths_keep_the_whole_middleware_stack(application):
    response = async_to_sync(_call)(application, "GET", "/v1/openapi.json")
    headers = _headers(response)
    assert response["status"] == 200
    assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/models"])
def test_an_inference_endpoint_refuses_a_host_not_allowed(application, path):
    async def call():
        scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "scheme": "http", "headers": [(b"host", b"evil.example")],
                 "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80)}
        communicator = ApplicationCommunicator(application, scope)
        await communicator.send_input({"type": "http.request", "body": b"{}", "more_body": False})
        status = (await communicator.receive_output(30))["status"]
        return status, json.loads((await communicator.receive_output(30))["body"])

    status, body = async_to_sync(call)()
    assert status == 400 and body["error"]["code"] == "invalid_host"


def test_the_security_redirect_still_applies_to_inference_endpoints(application):
    with override_settings(SECURE_SSL_REDIRECT=True):
        handler = ApiHandler()  # the security checks read their settings once, as the site's do
    response = async_to_sync(_call)(handler, "POST", "/v1/completions", b"{}")
    assert response["status"] == 301
    assert _headers(response)["location"].startswith("https://")


def test_an_unexpected_error_is_a_json_500_not_djangos_page(application, monkeypatch):
    from gateway import views

    def bug(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(views, "_list_models", bug)
    response = async_to_sync(_call)(application, "GET", "/v1/models")
    assert response["status"] == 500 and _headers(response)["content-type"] == "application/json"
    assert json.loads(response["body"])["error"]["code"] == "internal_error"
    assert _headers(response)["x-request-id"].startswith("req_")
