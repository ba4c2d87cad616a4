"""Dashboard fixtures: organizations with an owner signed up through the dashboard's own service,
the seeded catalog, and usage recorded through billing's service (the real write path)."""

from __future__ import annotations

import itertools
import uuid
from datetime import datetime, timezone

import pytest

PASSWORD = "a-long-test-password-42"
_seq = itertools.count()


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """Passwords here are test data: a fast hasher keeps each test fast (the real one is PBKDF2)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def console_mail(settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"


def sign_up(name: str = "Ada", organization: str = "Acme"):
    from accounts.selectors import organizations_for_user
    from dashboard.services import sign_up as service

    from accounts.services import verify_email

    email = f"{name.lower()}{next(_seq)}-{uuid.uuid4().hex[:6]}@example.com"
    user = service(email=email, password=PASSWORD, name=name, organization_name=organization)
    verify_email(user=user)  # they opened the link mailed to them: the sign-up credit is theirs
    return user, organizations_for_user(user=user).get()


@pytest.fixture
def catalog(db):
    """The bundled model and its public serverless deployment."""
    from models_catalog.models import CatalogModel, Deployment
    from models_catalog.services import BUNDLED_SLUG, seed_catalog

    seed_catalog()
    return CatalogModel.objects.get(slug=BUNDLED_SLUG), Deployment.objects.get(name=BUNDLED_SLUG)


@pytest.fixture
def acme(db):
    return sign_up("Ada", "Acme")


@pytest.fixture
def globex(db):
    return sign_up("Grace", "Globex")


@pytest.fixture
def ada(client, acme):
    """A client logged in as Acme's owner."""
    client.force_login(acme[0])
    return client


def record(organization, deployment, *, api_key=None, prompt_tokens=100, completion_tokens=50, latency_ms=800,
           ttft_ms=40, status="completed", finished_at: datetime | None = None, request_id: str | None = None,
           batch_size: float | None = None, endpoint: str | None = None):
    """A usage record written by billing's own service, as the worker's usage event does."""
    from billing.services import record_usage

    return record_usage(event={
        **({"endpoint": endpoint} if endpoint else {}),
        "request_id": request_id or f"chatcmpl-{uuid.uuid4().hex}",
        "organization_id": organization.pk,
        "api_key_id": api_key.pk if api_key is not None else None,
        "deployment_id": deployment.pk,
        "model": deployment.model.slug,
        "deployment": deployment.name,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": 0,
        "completion_tokens": completion_tokens,
        "status": status,
        "queue_ms": 3,
        "ttft_ms": ttft_ms,
        "latency_ms": latency_ms,
        "batch_size": batch_size,
        "finished_at": (finished_at or datetime.now(timezone.utc)).isoformat(),
    })
