"""Refusals that need the running stack: no worker (503), a prompt over the context (400 from the
engine), rate limits (429 with OpenAI's headers) — none of them billed."""

from __future__ import annotations

import subprocess
import sys
import uuid

import httpx
import pytest

from tests.support import REPO_ROOT, free_port, wait_until

from .conftest import DEPLOYMENT, _answers, _stop

pytestmark = pytest.mark.slow


def chat(tenant, body, base=None):
    return httpx.post(f"{base or tenant.base_url}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {tenant.api_key}"})


def usage_count(db_read, tenant) -> int:
    from billing.models import UsageRecord

    return db_read(lambda: UsageRecord.objects.filter(organization_id=tenant.organization_id).count())


def wait_for_usage(db_read, tenant, count: int) -> None:
    wait_until(lambda: usage_count(db_read, tenant) >= count, timeout=60, message=f"{count} usage record(s)")


def test_a_prompt_longer_than_the_context_is_400_and_not_billed(tenant, db_read):
    long = "hello " * 9000  # > 8192 tokens
    response = chat(tenant, {"model": DEPLOYMENT, "messages": [{"role": "user", "content": long}], "max_tokens": 4})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    # A prompt that fits, with a max_tokens the rest of the context cannot hold: refused, not cut short.
    fits = "hello " * 8000
    response = chat(tenant, {"model": DEPLOYMENT, "messages": [{"role": "user", "content": fits}], "max_tokens": 1000})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "1000 to generate" in error["message"]
    # A request that runs afterwards is billed; the refused ones never are.
    ok = chat(tenant, {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert ok.status_code == 200
    wait_for_usage(db_read, tenant, 1)
    assert usage_count(db_read, tenant) == 1


def test_a_model_nobody_serves_is_503_after_a_bounded_wait(tenant, db_read, django_db_blocker):
    from models_catalog.models import CatalogModel, Deployment

    name = f"unserved-{uuid.uuid4().hex[:8]}"
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}]}
    assert chat(tenant, body).status_code == 404
    # Created in this process: the gateway, which remembers what each name routes to, sees it at once.
    with django_db_blocker.unblock():
        Deployment.objects.create(name=name, model=CatalogModel.objects.get(slug=DEPLOYMENT), is_public=True,
                                  kind="serverless", status="ready")
    response = chat(tenant, body)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "model_unavailable"
    assert usage_count(db_read, tenant) == 0


def test_a_key_revoked_in_another_process_fails_on_its_next_request(make_tenant, django_db_blocker):
    from accounts.models import ApiKey
    from accounts.services import revoke_api_key

    tenant = make_tenant()
    models = f"{tenant.base_url}/v1/models"
    headers = {"Authorization": f"Bearer {tenant.api_key}"}
    assert httpx.get(models, headers=headers).status_code == 200  # the gateway now holds the key
    with django_db_blocker.unblock():
        revoke_api_key(api_key=ApiKey.objects.get(pk=tenant.api_key_id))
    refused = httpx.get(models, headers=headers)
    assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"]


@pytest.fixture(scope="module")
def limited_server(server_env):
    """A second gateway process with a tiny per-key limit of 3 requests a minute."""
    port = free_port()
    env = {**server_env, "RATE_LIMIT_KEY_RPM": "3"}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "inference_platform.asgi:application",
                             "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--lifespan", "off"],
                            cwd=REPO_ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(f"{base}/healthz"), timeout=60, message="the limited gateway")
        yield base
    finally:
        _stop(proc)


def test_a_key_gets_exactly_its_request_limit(tenant, limited_server, db_read):
    body = {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    answers = [chat(tenant, body, base=limited_server) for _ in range(4)]
    assert [r.status_code for r in answers] == [200, 200, 200, 429]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers[:3]] == ["2", "1", "0"]
    assert all(r.headers["x-ratelimit-limit-requests"] == "3" for r in answers)
    refused = answers[3]
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")  # OpenAI's: the unit
    assert "for requests per min (RPM) on this API key: limit 3, used 3. Please try again in" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1 and refused.headers["x-ratelimit-reset-requests"] != "0s"
    assert "x-ratelimit-remaining-tokens" in refused.headers
    wait_for_usage(db_read, tenant, 3)
    assert usage_count(db_read, tenant) == 3
