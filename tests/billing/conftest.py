"""Billing fixtures: organizations with keys, a priced catalog model, usage events, and the real
outside parts (localstripe, a uvicorn ASGI server on the test database)."""

from __future__ import annotations

import itertools
import subprocess
import sys
import uuid
from datetime import datetime, timezone
from decimal import Decimal

import httpx
import pytest

from tests.conftest import child_env
from tests.support import REPO_ROOT, free_port, wait_until

WEBHOOK_SECRET = "whsec_billing_tests_secret"
STRIPE_SECRET_KEY = "sk_test_billing_tests"
STRIPE_PUBLISHABLE_KEY = "pk_test_billing_tests"

# Sample prices (USD): per million input / cached input / output tokens, per request.
PRICES = {
    "price_input_per_mtok": Decimal("0.150000"),
    "price_cached_input_per_mtok": Decimal("0.075000"),
    "price_output_per_mtok": Decimal("0.600000"),
    "price_per_request": Decimal("0.000100"),
}

_emails = itertools.count()


def make_organization(name: str = "Acme"):
    from accounts.services import create_organization, create_user

    owner = create_user(email=f"owner{next(_emails)}-{uuid.uuid4().hex[:8]}@example.com", password=None, validate=False)
    return create_organization(name=name, owner=owner)


def make_key(organization, scopes=("inference", "read_usage"), name="test key", origin="command_line"):
    """A key with no creator: the operator's command line's by default, which acts as the organization."""
    from accounts.services import create_api_key

    api_key, plaintext = create_api_key(organization=organization, name=name, scopes=list(scopes), origin=origin)
    return api_key, plaintext


def make_catalog_model(slug: str = "tiny-llama", **prices):
    from models_catalog.models import CatalogModel

    return CatalogModel.objects.create(
        slug=slug, display_name=slug, architecture="llama", weights_path=f"bundled:{slug}", **{**PRICES, **prices}
    )


def usage_event(organization, *, request_id: str | None = None, api_key=None, deployment=None, model="tiny-llama",
                prompt_tokens=1000, cached_prompt_tokens=200, completion_tokens=500, status="completed",
                queue_ms=5, ttft_ms=40, latency_ms=900, finished_at: datetime | None = None) -> dict:
    return {
        "request_id": request_id or f"req-{uuid.uuid4().hex}",
        "organization_id": organization.pk,
        "api_key_id": api_key.pk if api_key is not None else None,
        "deployment_id": deployment.pk if deployment is not None else None,
        "model": model,
        "deployment": deployment.name if deployment is not None else "",
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached_prompt_tokens,
        "completion_tokens": completion_tokens,
        "status": status,
        "queue_ms": queue_ms,
        "ttft_ms": ttft_ms,
        "latency_ms": latency_ms,
        "finished_at": (finished_at or datetime.now(timezone.utc)).isoformat(),
    }


@pytest.fixture
def catalog_model(db):
    return make_catalog_model()


@pytest.fixture
def organization(db):
    return make_organization("Acme")


@pytest.fixture
def other_organization(db):
    return make_organization("Globex")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=1.0)
    except httpx.HTTPError:
        return False
    return True


@pytest.fixture(scope="session")
def localstripe():
    """A localstripe process (fresh store) on a free port; yields its base URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "localstripe", "--port", str(port), "--from-scratch"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO_ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or _answers(f"{base}/js.stripe.com/v3/"), timeout=30,
                   message="localstripe to listen")
        assert proc.poll() is None, "localstripe exited at start"
        yield base
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def asgi_server(django_db_setup, django_db_blocker, localstripe):
    """The platform's ASGI app under uvicorn on 127.0.0.1, against the test database, with the
    Stripe settings pointing at localstripe; localstripe's webhooks are registered to it."""
    port = free_port()
    env = child_env(STRIPE_SECRET_KEY=STRIPE_SECRET_KEY, STRIPE_PUBLISHABLE_KEY=STRIPE_PUBLISHABLE_KEY,
                    STRIPE_WEBHOOK_SECRET=WEBHOOK_SECRET, STRIPE_API_BASE=localstripe, LOG_LEVEL="WARNING")
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "inference_platform.asgi:application", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning", "--no-access-log"],
        cwd=REPO_ROOT, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or _answers(f"{base}/healthz"), timeout=60,
                   message="uvicorn to serve /healthz")
        assert proc.poll() is None, "uvicorn exited at start"
        response = httpx.post(f"{localstripe}/_config/webhooks/billing-tests",
                              data={"url": f"{base}/billing/stripe/webhook", "secret": WEBHOOK_SECRET})
        assert response.status_code == 200, response.text
        yield base
    finally:
        _stop(proc)


@pytest.fixture
def stripe_settings(settings, localstripe):
    """This process talks to the same localstripe with the same secrets as the server."""
    from billing import stripe_api

    settings.STRIPE_SECRET_KEY = STRIPE_SECRET_KEY
    settings.STRIPE_PUBLISHABLE_KEY = STRIPE_PUBLISHABLE_KEY
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    settings.STRIPE_API_BASE = localstripe
    yield settings
    stripe_api._client.cache_clear()


