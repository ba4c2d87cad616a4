"""Every refusal before dispatch, through the real URL routing and views, in OpenAI's error shape."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

pytestmark = pytest.mark.django_db
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def post(client, path, body, key=None, **extra):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.post(path, data=data, content_type="application/json", **headers, **extra)


def assert_error(response, status, *, type_=None, param=None, code=None):
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if type_:
        assert error["type"] == type_
    assert error["param"] == param
    if code:
        assert error["code"] == code
    return error


def no_usage(org):
    from billing.models import UsageRecord

    return not UsageRecord.objects.filter(organization=org).exists()


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ASK = {"role": "user", "content": "x"}
CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
ANSWER = {"role": "tool", "tool_call_id": "call_1", "content": "done"}


def chat(model="smollm2-135m-instruct", **extra):
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **extra}


def test_missing_and_bad_keys_are_401(client, seeded):
    assert_error(post(client, CHAT, chat()), 401, type_="invalid_request_error", code="invalid_api_key")
    assert_error(post(client, CHAT, chat(), key="sk-not-a-real-key"), 401, code="invalid_api_key")


def test_revoked_and_expired_keys_fail_at_once(client, seeded, org_key):
    from accounts.services import revoke_api_key

    org, key, plaintext = org_key()
    revoke_api_key(api_key=key)
    assert "revoked" in assert_error(post(client, CHAT, chat(), key=plaintext), 401)["message"].lower()
    org, key, plaintext = org_key(expires_at=timezone.now() + timedelta(days=1))
    key.expires_at = timezone.now() - timedelta(seconds=1)
    key.save(update_fields=["expires_at"])
    assert "expired" in assert_error(post(client, CHAT, chat(), key=plaintext), 401)["message"].lower()


def test_a_key_without_the_inference_scope_is_403(client, seeded, org_key):
    org, key, plaintext = org_key(scopes=["read_usage"])
    assert_error(post(client, CHAT, chat(), key=plaintext), 403, type_="invalid_request_error", code="missing_scope")
    assert no_usage(org)


def test_unknown_model_is_404(client, seeded, broke_org_key):
    org, key, plaintext = broke_org_key
    assert_error(post(client, CHAT, chat(model="no-such-model"), key=plaintext), 404, param="model",
                 code="model_not_found")


def test_another_organizations_dedicated_deployment_is_404(client, seeded, org_key):
    from models_catalog.models import CatalogModel
    from models_catalog.services import create_deployment

    owner_org, _, _ = org_key()
    create_deployment(organization=owner_org, model=CatalogModel.objects.get(slug=seeded), name="private-one",
                      kind="dedicated", min_replicas=1, max_replicas=1)
    org, key, plaintext = org_key()
    error = assert_error(post(client, CHAT, chat(model="private-one"), key=plaintext), 404, param="model")
    assert "private-one" in error["message"]
    for stream in (False, True):
        error = assert_error(post(client, COMPLETIONS, {"model": "private-one", "prompt": "Hi", "stream": stream},
                                  key=plaintext), 404, type_="invalid_request_error", param="model", code="model_not_found")
        assert "private-one" in error["message"]
    listed = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {plaintext}").json()["data"]
    assert "private-one" not in [m["id"] for m in listed]
    assert client.get("/v1/models/private-one", HTTP_AUTHORIZATION=f"Bearer {plaintext}").status_code == 404
    assert no_usage(org) and no_usage(owner_org)


@pytest.fixture(scope="module")
def asgi_application():
    """The server's ASGI application (HTTP and the WebSocket API behind its key authentication),
    imported without making this process a server (see tests/project/test_api_handler.py)."""
    from gateway import admission

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(admission, "use_threads", lambda count=4: None)
        from inference_platform.asgi import application
    return application


def websocket_replies(application, plaintext: str, frames: list[dict], replies: int) -> list[dict]:
    """Open ``/v1/ws`` with ``plaintext`` as the Bearer key, send ``frames``, return the first
    ``replies`` frames the server sends."""
    import asyncio

    from asgiref.testing import ApplicationCommunicator
    from channels.db import database_sync_to_async
    from django.db import connections

    scope = {"type": "websocket", "path": "/v1/ws", "raw_path": b"/v1/ws", "query_string": b"", "subprotocols": [],
             "headers": [(b"host", b"localhost"), (b"authorization", f"Bearer {plaintext}".encode())]}

    async def run():
        communicator = ApplicationCommunicator(application, scope)
        try:
            await communicator.send_input({"type": "websocket.connect"})
            assert (await communicator.receive_output(10))["type"] == "websocket.accept"
            for frame in frames:
                await communicator.send_input({"type": "websocket.receive", "text": json.dumps(frame)})
            out = [json.loads((await communicator.receive_output(30))["text"]) for _ in range(replies)]
            await communicator.send_input({"type": "websocket.disconnect", "code": 1000})
            await communicator.wait(5)
            return out
        finally:  # the key was checked on asgiref's worker thread: close that thread's connection
            await database_sync_to_async(connections.close_all)()

    return asyncio.run(run())


@pytest.mark.django_db(transaction=True)  # the handshake reads the key on another thread
def test_another_organizations_dedicated_deployment_cannot_be_called_over_the_websocket(asgi_application, settings):
    """The other organization gets 404 model_not_found for either endpoint, as if the name did not
    exist; the owner reaches the deployment (no worker serves it here: 503 after the short wait)."""
    from accounts import services
    from django.core.management import call_command
    from models_catalog.models import CatalogModel
    from models_catalog.services import create_deployment
    from tests.workers.test_capacity import queued_ticks
    from workers import fleet

    ticks_before = set(queued_ticks())  # the placement-loop runs asked for below: nobody runs them here
    settings.GATEWAY_QUEUE_TIMEOUT = settings.FLEET_COLD_START_TIMEOUT = 0.2
    call_command("seed_catalog", verbosity=0)
    keys = {}
    for who in ("owner", "other"):
        user = services.create_user(email=f"{who}-{uuid.uuid4().hex[:8]}@example.com", password=None)
        org = services.create_organization(name=f"{who}-{uuid.uuid4().hex[:8]}", owner=user)
        _, keys[who] = services.create_api_key(organization=org, name="t", scopes=["inference"], created_by=user)
        keys[f"{who}_org"] = org
    name = f"private-{uuid.uuid4().hex[:8]}"
    create_deployment(organization=keys["owner_org"], model=CatalogModel.objects.get(slug="smollm2-135m-instruct"),
                      name=name, kind="dedicated", min_replicas=1, max_replicas=1)
    frames = [{"request_id": "chat", "model": name, "messages": [{"role": "user", "content": "Hi"}]},
              {"request_id": "text", "endpoint": "completions", "model": name, "prompt": "Hi"}]
    try:
        refused = {f["request_id"]: f for f in websocket_replies(asgi_application, keys["other"], frames, 2)}
        served = {f["request_id"]: f for f in websocket_replies(asgi_application, keys["owner"], frames, 2)}
    finally:
        fleet.client().delete(*fleet.queue_lists(f"deployment.{name}"))
        for raw in set(queued_ticks()) - ticks_before:
            fleet.client().lrem("default", 0, raw)
    for request_id in ("chat", "text"):
        frame = refused[request_id]
        assert frame["type"] == "error" and set(frame["error"]) == {"message", "type", "param", "code"}, frame
        assert (frame["error"]["type"], frame["error"]["code"], frame["error"]["param"]) == \
            ("invalid_request_error", "model_not_found", "model")
        assert name in frame["error"]["message"]
        assert served[request_id]["error"]["code"] == "model_unavailable", served[request_id]
    assert no_usage(keys["other_org"]) and no_usage(keys["owner_org"])


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"messages": [{"role": "user", "content": "x"}]}, "model"),
    (CHAT, {"model": "smollm2-135m-instruct"}, "messages"),
    (CHAT, chat(messages=[]), "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (CHAT, chat(temperature=2.5), "temperature"),
    (CHAT, chat(temperature="hot"), "temperature"),
    (CHAT, chat(top_p=-0.1), "top_p"),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_completion_tokens=-3), "max_completion_tokens"),
    (CHAT, chat(n=0), "n"),
    (CHAT, chat(n=129), "n"),
    (CHAT, chat(n=1.5), "n"),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (CHAT, chat(presence_penalty=3), "presence_penalty"),
    (CHAT, chat(logit_bias={"abc": 1}), "logit_bias"),
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias"),
    (CHAT, chat(top_logprobs=2), "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options"),
    (CHAT, chat(tools=[{"type": "function"}]), "tools[0]"),
    (CHAT, chat(tools={"type": "function", "function": {"name": "f"}}), "tools"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools[0]"),
    (CHAT, chat(tools=[TOOL, TOOL]), "tools"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"when": {"type": "string", "format": "password"}}}}}]), "tools"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), "tools"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "description": "cut \ud83d"}}]),
     "tools[0].function.description"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "description": "\udc00"}}}}}]), "tools[0].function.parameters"),
    (CHAT, chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": "\ud800"}'}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    (CHAT, chat(messages=[ASK, CALLED, {"role": "user", "content": "and?"}]), "messages[1].tool_calls"),
    (CHAT, chat(messages=[ASK, CALLED]), "messages[1].tool_calls"),
    (CHAT, chat(messages=[ASK, CALLED, ANSWER, ANSWER]), "messages[3].tool_call_id"),
    (CHAT, chat(messages=[ASK, {**CALLED, "tool_calls": CALLED["tool_calls"] * 2}, ANSWER]), "messages[1].tool_calls[1]"),
    (CHAT, chat(messages=[ASK, {**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "id": ""}]}]),
     "messages[1].tool_calls[0]"),
    (CHAT, chat(messages=[ASK, CALLED, {**ANSWER, "tool_call_id": 7}]), "messages[2].tool_call_id"),
    (CHAT, chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (CHAT, chat(tools=[TOOL], tool_choice="always"), "tool_choice"),
    (CHAT, chat(tools=[TOOL], parallel_tool_calls="yes"), "parallel_tool_calls"),
    (CHAT, chat(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}]),
     "messages[1].tool_call_id"),
    (CHAT, chat(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "18 C"}]),
     "messages[1].tool_call_id"),
    (CHAT, chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"city": "Paris"}}}]}]),
     "messages[1].tool_calls[0]"),
    (CHAT, chat(response_format={"type": "xml"}), "response_format"),
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
     "response_format"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object", "properties": {"e": {"type": "string", "format": "password"}}}}}),
     "response_format"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object", "required": ["a"]}}}), "response_format"),
    (CHAT, chat(response_format={"type": "json_object", "schema": {}}), "response_format"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": ["\ud800"]}}}),
     "response_format"),
    (CHAT, b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "response_format": '
           b'{"type": "json_schema", "json_schema": {"name": "s", "schema": {"const": [NaN]}}}}', "response_format"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "integer", "maximum": 10**400}}}), "response_format"),  # no float holds it
    (CHAT, chat(tool_choice="required"), "tool_choice"),
    (CHAT, chat(metadata={"a": 1}), "metadata"),
    (CHAT, chat(logit_bias={"²": 1}), "logit_bias"),  # a digit to str.isdigit, no token id to int()
    (CHAT, chat(stream="yes"), "stream"),
    (CHAT, chat(max_tokens=5, max_completion_tokens=5), "max_tokens"),
    (CHAT, chat(messages=[{"role": "user", "content": "cut \ud83d"}]), "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]), "messages[0].content"),
    (CHAT, chat(stop=["ok", "\ud800"]), "stop"),
    (CHAT, chat(prompt_cache_key=7), "prompt_cache_key"),
    (CHAT, chat(modalities=["text", "audio"]), "modalities"),
    (CHAT, chat(stream=True, stream_options={"include_obfuscation": "no"}), "stream_options.include_obfuscation"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": "\ud800 cut"}, "prompt"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct"}, "prompt"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": ""}, "prompt"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": ["a", ""]}, "prompt"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": ["a", [1, -2]]}, "prompt"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": ["a", 5]}, "prompt"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": []}, "prompt"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": ["a"] * 3, "n": 43}, "n"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": "x", "logprobs": True}, "logprobs"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": "x", "logprobs": 6}, "logprobs"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": "x", "echo": "yes"}, "echo"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": "x", "best_of": 2}, "best_of"),
])
def test_invalid_parameters_are_400_naming_the_parameter(client, seeded, org_key, path, body, param):
    org, key, plaintext = org_key()
    assert_error(post(client, path, body, key=plaintext), 400, type_="invalid_request_error", param=param)
    assert no_usage(org)


def test_openais_parameters_that_ask_for_nothing_are_accepted():
    """SDKs and frameworks send them at their neutral values; refusing those broke them."""
    from gateway.protocol import parse_chat

    request = parse_chat(chat(response_format={"type": "text"}, tools=[], tool_choice="none", parallel_tool_calls=False,
                              store=False, metadata={"team": "search"}, service_tier="auto", modalities=["text"],
                              prompt_cache_key="conversation-42", safety_identifier="user-hash",
                              verbosity="medium", reasoning_effort="none", audio=None, prediction=None,
                              web_search_options=None, prompt_cache_retention="24h",
                              stream=True, stream_options={"include_usage": True, "include_obfuscation": False}))
    assert request.messages == [{"role": "user", "content": "Hi"}] and request.include_usage
    # An assistant's refusal, replayed as OpenAI returned it, is what it said.
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]}
    assert parse_chat(chat(messages=[ASK, refused, ASK])).messages[1]["content"] == "I can't help with that."
    # Tools the model may not call: their definitions change nothing.
    parse_chat(chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none"))
    # Calls answered, then the conversation goes on.
    assert [m["role"] for m in parse_chat(chat(messages=[ASK, CALLED, ANSWER, ASK])).messages] == \
        ["user", "assistant", "tool", "user"]
    assert parse_chat(chat(logprobs=False, top_logprobs=0)).sampling["logprobs"] is False
    assert 0 < parse_chat(chat(top_p=0)).sampling["top_p"] < 1e-3  # OpenAI's "only the likeliest token"


def test_an_unsupported_value_says_so_and_what_is_accepted(client, seeded, org_key):
    _, _, plaintext = org_key()
    response = post(client, CHAT, chat(service_tier="flex"), key=plaintext)
    error = response.json()["error"]
    assert error["code"] == "unsupported_value" and '"auto" or "default"' in error["message"], error
    error = post(client, CHAT, chat(reasoning_effort="low"), key=plaintext).json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_value", "reasoning_effort")
    assert error["message"].endswith('leave it out or send "none"'), error
    tools = [{"type": "function", "function": {"name": "f"}}]
    subset = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": tools}}
    error = post(client, CHAT, chat(tools=tools, tool_choice=subset), key=plaintext).json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_value", "tool_choice")
    error = post(client, CHAT, chat(messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]),
                 key=plaintext).json()["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "messages[0].content[0]")  # a user's: no
    error = post(client, CHAT, chat(audio={"voice": "alloy", "format": "mp3"}), key=plaintext).json()["error"]
    assert error["code"] == "unsupported_value" and error["message"].endswith("leave it out"), error
    response = post(client, COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": "x", "suffix": "y"}, key=plaintext)
    assert response.json()["error"]["code"] == "unsupported_value"


def test_a_body_that_is_not_json_is_400(client, seeded, org_key):
    org, key, plaintext = org_key()
    assert_error(post(client, CHAT, b"{not json", key=plaintext), 400, code="invalid_json")
    assert_error(post(client, CHAT, b"[1, 2]", key=plaintext), 400)


def test_a_body_nested_too_deeply_for_the_parser_is_400_not_a_crash(client, seeded, org_key):
    org, key, plaintext = org_key()
    deep = b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert_error(post(client, CHAT, deep, key=plaintext), 400, code="invalid_json")
    assert_error(post(client, COMPLETIONS, deep, key=plaintext), 400, code="invalid_json")
    # The REST API's parser too (DRF's would let the RecursionError through as a 500 page).
    response = client.put("/v1/billing/limits", data=deep, content_type="application/json",
                          HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert_error(response, 400)
    assert no_usage(org)


@pytest.mark.parametrize("path, body, param", [
    (CHAT, chat(max_tokens=10**30), "max_tokens"),
    (CHAT, chat(max_completion_tokens=8193), "max_completion_tokens"),
    (COMPLETIONS, {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 8193}, "max_tokens"),
])
def test_a_max_tokens_beyond_the_models_context_is_400(client, seeded, org_key, path, body, param):
    org, key, plaintext = org_key()
    error = assert_error(post(client, path, body, key=plaintext), 400, param=param, code="invalid_value")
    assert "8192" in error["message"]  # the bundled model's context, from the catalog
    assert no_usage(org)


def test_an_oversized_body_is_413(client, seeded, org_key, settings):
    settings.GATEWAY_MAX_BODY_BYTES = 10_000
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10_001
    org, key, plaintext = org_key()
    body = chat(messages=[{"role": "user", "content": "x" * 20_000}])
    assert_error(post(client, CHAT, body, key=plaintext), 413, code="request_too_large")
    assert no_usage(org)


def test_zero_balance_is_refused_with_insufficient_quota(client, seeded, broke_org_key):
    org, key, plaintext = broke_org_key
    error = assert_error(post(client, CHAT, chat(), key=plaintext), 429, code="insufficient_quota")
    assert error["type"] == "insufficient_quota"
    assert no_usage(org)


def test_get_on_an_inference_endpoint_is_405(client, seeded, org_key):
    org, key, plaintext = org_key()
    assert_error(client.get(CHAT, HTTP_AUTHORIZATION=f"Bearer {plaintext}"), 405)


@pytest.mark.parametrize("path", [CHAT, "/v1/responses", "/v1/batches"])
@pytest.mark.parametrize("body, kind", [([1, 2], "an array"), ("hi", "a string"), (None, "null"), (3, "a number")])
def test_a_body_that_is_not_a_json_object_says_what_it_is(client, seeded, org_key, path, body, kind):
    org, key, plaintext = org_key()
    error = assert_error(post(client, path, json.dumps(body), key=plaintext), 400, code="invalid_type")
    assert error["message"] == f"The request body must be a JSON object, not {kind}."
    assert no_usage(org)


def test_a_rest_endpoint_says_which_methods_it_takes(client, seeded, org_key):
    org, key, plaintext = org_key()
    response = client.get("/v1/deployments/anything/scale", HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    error = assert_error(response, 405, code="method_not_allowed")
    assert error["message"] == "Use POST for /v1/deployments/anything/scale."
    response = client.delete("/v1/billing/limits", HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert assert_error(response, 405, code="method_not_allowed")["message"] == "Use GET or PUT for /v1/billing/limits."


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/smollm2-135m-instruct"])
def test_the_models_endpoints_answer_get_only(client, seeded, org_key, path):
    org, key, plaintext = org_key()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {plaintext}"}
    assert client.get(path, **auth).status_code == 200
    for method in (client.delete, client.post, client.put):
        assert_error(method(path, **auth), 405, code="method_not_allowed")


@pytest.mark.parametrize("method, path", [("post", "/v1/moderations"), ("post", "/v1/chat/completions/"),
                                          ("get", "/v1/models/a/b"), ("get", "/v1/nothing"), ("get", "/v1")])
def test_an_unknown_api_path_is_a_json_404(client, method, path):
    response = client.post(path, data="{}", content_type="application/json") if method == "post" else client.get(path)
    error = assert_error(response, 404, code="unknown_url")
    assert path in error["message"]


def test_the_openapi_document_describes_the_inference_api(client):
    document = client.get("/v1/openapi.json").json()
    assert document["openapi"].startswith("3.")
    chat_schema = document["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat_schema["required"])
    # Every route of the inference API is described, path parameters named as the route names them.
    import re

    from gateway.urls import urlpatterns

    for route in urlpatterns:
        path = "/" + re.sub(r"<str:(\w+)>", r"{\1}", str(route.pattern))
        assert path in document["paths"] or path == "/v1/openapi.json", path
    assert set(document["paths"]["/v1/responses/{response_id}"]) >= {"get", "delete"}
    # Every keyed endpoint says how to send the key (the REST ones too, not only the session cookie).
    for path in ("/v1/usage", "/v1/deployments", "/v1/billing/limits"):
        for operation in document["paths"][path].values():
            assert {"bearer": []} in operation["security"], (path, operation["security"])


def test_a_bug_behind_a_rest_endpoint_is_a_json_500(client, seeded, org_key, monkeypatch, caplog):
    from billing import selectors

    def broken(**kwargs):
        raise RuntimeError("a bug in the balance")

    monkeypatch.setattr(selectors, "balance", broken)
    org, key, plaintext = org_key()
    response = client.get("/v1/billing/balance", HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    error = assert_error(response, 500, type_="server_error", code="internal_error")
    assert "a bug in the balance" not in error["message"]  # the traceback goes to the log only
    assert "a bug in the balance" in caplog.text


def test_the_database_down_is_a_503_to_retry_not_a_500(client, seeded, org_key, monkeypatch):
    from django.db import OperationalError

    from gateway import calls

    org, key, plaintext = org_key()

    def database_gone(caller, model):
        raise OperationalError("connection to server at 127.0.0.1, port 5432 failed: Connection refused")

    monkeypatch.setattr(calls, "_deployment_spec", database_gone)
    response = post(client, CHAT, chat(), key=plaintext)
    assert_error(response, 503, code="service_unavailable")
    assert response["Retry-After"] == "2"


@pytest.mark.parametrize("body, param, said", [
    (chat(model=["smollm2-135m-instruct"]), "model", "model must be a string (the name of a deployment"),
    (chat(model=""), "model", "model is required"),
    (chat(logit_bias={"5": "5"}), "logit_bias", "logit_bias for token 5 must be a number, not a string"),
])
def test_a_value_of_the_wrong_type_is_called_what_it_is(body, param, said):
    from gateway.errors import ApiError
    from gateway.protocol import parse_chat

    with pytest.raises(ApiError) as refused:
        parse_chat(body)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert said in refused.value.message, refused.value.message


@pytest.mark.parametrize("fmt, param, said", [
    # Chat's json_schema may go without a schema (any JSON value); the Responses API's may not.
    ({"type": "json_schema", "name": "reply"}, "text.format.schema", "text.format.schema is required"),
    ({"type": "json_schema", "schema": {"type": "object"}}, "text.format.name", "text.format.name is required"),
    # Chat's checks, in this API's words: its format has no json_schema object.
    ({"type": "json_schema", "name": "a reply", "schema": {}}, "text.format", "text.format.name must be 1 to 64"),
    ({"type": "json_schema", "name": "r", "schema": {}, "examples": []}, "text.format", "text.format takes no"),
])
def test_a_responses_json_schema_format_is_checked_in_its_own_words(fmt, param, said):
    from gateway.errors import ApiError
    from gateway.responses import parse_response_request

    with pytest.raises(ApiError) as refused:
        parse_response_request({"model": "m", "input": "Hi", "text": {"format": fmt}}, can_store=True)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert said in refused.value.message and "json_schema." not in refused.value.message, refused.value.message



def test_every_api_response_names_itself_in_x_request_id(client, seeded, org_key):
    """As OpenAI's do: a client quotes it in a support ticket (the openai package's _request_id)."""
    _, _, plaintext = org_key()
    auth = {"HTTP_AUTHORIZATION": f"Bearer {plaintext}"}
    seen = set()
    for path in ("/v1/files", "/v1/batches", "/v1/models", "/v1/no-such-endpoint"):
        response = client.get(path, **auth)
        assert response["x-request-id"].startswith("req_") and response["x-request-id"] not in seen, path
        seen.add(response["x-request-id"])
    assert client.get("/v1/models")["x-request-id"].startswith("req_")  # refused (no key): named too
    assert "x-request-id" not in client.get("/login/")  # the dashboard's pages are not the API
    response = post(client, CHAT, chat(n=0), key=plaintext)  # an inference request: its completion id
    assert response["x-request-id"].startswith("chatcmpl-")
