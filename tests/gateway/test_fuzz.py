"""Property-based fuzzing of the inference endpoints from their OpenAPI document: whatever the body,
the answer is a well-formed OpenAI error or a refusal, never a 500 (the caller's balance is zero, so
no valid body reaches a worker)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pytestmark = pytest.mark.django_db

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=10)


def bodies(schema: dict):
    names = sorted(schema["properties"])
    known = st.dictionaries(st.sampled_from(names), values, max_size=len(names))
    required = st.fixed_dictionaries({
        "model": st.one_of(st.just("smollm2-135m-instruct"), values),
        **_content(names),
    })
    return st.builds(lambda a, b: {**b, **a}, known, required) | values


def _content(names: list[str]) -> dict:
    """What the request asks about: chat's messages, a completion's prompt, or a response's input
    items (or an embedding's input)."""
    messages = st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": values}), max_size=3)
    if "messages" in names:
        return {"messages": st.one_of(values, messages)}
    if "prompt" in names:
        return {"prompt": st.one_of(values, st.text(max_size=30))}
    items = st.lists(st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "x"]), "content": values}),
        st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "x"]),
                               "call_id": values, "name": values, "arguments": values, "output": values})),
        max_size=3)
    return {"input": st.one_of(values, st.text(max_size=30), items)}


@pytest.fixture(scope="module")
def schemas():
    from gateway.openapi import CHAT_REQUEST, COMPLETION_REQUEST, EMBEDDING_REQUEST, RESPONSES_REQUEST

    return {"/v1/chat/completions": CHAT_REQUEST, "/v1/completions": COMPLETION_REQUEST,
            "/v1/responses": RESPONSES_REQUEST, "/v1/embeddings": EMBEDDING_REQUEST}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"])
def test_no_body_makes_the_gateway_fail(client, seeded, broke_org_key, schemas, path):
    org, key, plaintext = broke_org_key

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(body=bodies(schemas[path]))
    def check(body):
        response = client.post(path, data=json.dumps(body), content_type="application/json",
                               HTTP_AUTHORIZATION=f"Bearer {plaintext}")
        assert response.status_code in (400, 404, 429), (response.status_code, body, response.content)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}

    check()


def test_no_batch_request_makes_the_gateway_fail(client, seeded, broke_org_key):
    """The Batch API's body, fuzzed from its schema: a 400 or 404 in OpenAI's shape, never a 500
    (an input file that exists is among the values, so some bodies reach the file's reading)."""
    from gateway import services
    from gateway.openapi import BATCH_REQUEST

    org, key, plaintext = broke_org_key
    uploaded = services.create_file(organization_id=org.pk, purpose="batch", filename="in.jsonl",
                                    content=b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                                            b'"body": {"model": "nobodys-model"}}\n')
    names = sorted(BATCH_REQUEST["properties"])
    body = st.dictionaries(st.sampled_from(names), values | st.sampled_from(
        [uploaded.pk, "/v1/chat/completions", "/v1/completions", "24h"]), max_size=len(names))

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(body=body | values)
    def check(body):
        response = client.post("/v1/batches", data=json.dumps(body), content_type="application/json",
                               HTTP_AUTHORIZATION=f"Bearer {plaintext}")
        assert response.status_code in (400, 404), (response.status_code, body, response.content)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()
