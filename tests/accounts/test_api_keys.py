"""API keys: format, hash-only storage, resolution, revocation, expiry, scopes, last use."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from accounts import selectors
from accounts.errors import ApiKeyError, ExpiredApiKey, InvalidApiKey, InvalidInput, MissingApiKey, RevokedApiKey
from accounts.models import ApiKey
from accounts.selectors import authenticate_api_key, parse_bearer
from accounts.services import create_api_key, create_organization, create_user, revoke_api_key, touch_api_key
from inference_platform import read_cache

pytestmark = pytest.mark.django_db


@pytest.fixture
def owner():
    return create_user(email="Owner@Example.com", password="a-long-pass-phrase-42")


@pytest.fixture
def org(owner):
    return create_organization(name="Acme", owner=owner)


def test_a_key_has_the_documented_shape_and_only_its_hash_is_stored(org, owner):
    api_key, raw = create_api_key(organization=org, name="ci", scopes=["inference"], created_by=owner)
    assert raw.startswith("sk-") and raw[3:15] == api_key.prefix and raw[15] == "_"
    assert len(raw) > 50
    assert api_key.secret_hash == hashlib.sha256(raw.encode()).hexdigest()
    secret = raw[16:]
    # Nothing in the stored row (read back raw from the database) holds the secret part.
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {ApiKey._meta.db_table} WHERE id = %s", [api_key.pk])
        row = " ".join(str(value) for value in cursor.fetchone())
    assert secret not in row and raw not in row
    assert secret[:12] not in row


def test_two_keys_never_share_prefix_or_secret(org):
    keys = [create_api_key(organization=org, name=f"k{i}", scopes=["inference"]) for i in range(20)]
    assert len({k.prefix for k, _ in keys}) == 20
    assert len({raw for _, raw in keys}) == 20


def test_authenticate_returns_the_key_with_its_organization(org, owner):
    api_key, raw = create_api_key(organization=org, name="ci", scopes=["inference", "manage"], created_by=owner)
    found = authenticate_api_key(f"  {raw} ")
    assert found.pk == api_key.pk
    assert found.organization == org and found.created_by == owner
    assert found.scopes == ["inference", "manage"]


@pytest.mark.parametrize("raw", ["", "   ", "sk-", "hello", "Bearer sk-abc", "sk-short_abc", "pk-" + "a" * 12 + "_" + "b" * 43])
def test_missing_and_malformed_keys_are_invalid(raw):
    with pytest.raises(InvalidApiKey) as info:
        authenticate_api_key(raw)
    assert info.value.code == "invalid_api_key"


def test_a_missing_key_says_how_to_send_one():
    with pytest.raises(MissingApiKey, match="Authorization"):
        authenticate_api_key("")
    assert issubclass(MissingApiKey, InvalidApiKey) and issubclass(InvalidApiKey, ApiKeyError)


def test_a_right_prefix_with_a_wrong_secret_is_invalid(org):
    api_key, raw = create_api_key(organization=org, name="ci", scopes=["inference"])
    forged = raw[:16] + ("A" if raw[16] != "A" else "B") + raw[17:]
    with pytest.raises(InvalidApiKey):
        authenticate_api_key(forged)
    unknown = "sk-" + "Z" * 12 + raw[15:]
    with pytest.raises(InvalidApiKey):
        authenticate_api_key(unknown)


def test_the_secret_is_compared_in_constant_time_for_known_and_unknown_prefixes(org, monkeypatch):
    """Both a wrong secret and an unknown prefix go through hmac.compare_digest (same cost)."""
    real = selectors.hmac.compare_digest
    calls = []

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(selectors.hmac, "compare_digest", spy)
    api_key, raw = create_api_key(organization=org, name="ci", scopes=["inference"])
    authenticate_api_key(raw)
    with pytest.raises(InvalidApiKey):
        authenticate_api_key(raw[:-1] + ("x" if raw[-1] != "x" else "y"))
    with pytest.raises(InvalidApiKey):
        authenticate_api_key("sk-" + "Q" * 12 + raw[15:])
    assert len(calls) == 3
    assert all(len(a) == len(b) == 64 for a, b in calls)


def test_a_revoked_key_fails_at_once_and_revoking_twice_keeps_the_first_time(org):
    api_key, raw = create_api_key(organization=org, name="ci", scopes=["inference"])
    authenticate_api_key(raw)
    revoke_api_key(api_key=api_key)
    with pytest.raises(RevokedApiKey) as info:
        authenticate_api_key(raw)
    assert "revoked" in info.value.message
    first = ApiKey.objects.get(pk=api_key.pk).revoked_at
    revoke_api_key(api_key=api_key)
    assert ApiKey.objects.get(pk=api_key.pk).revoked_at == first


def test_an_expired_key_fails(org):
    api_key, raw = create_api_key(
        organization=org, name="ci", scopes=["inference"], expires_at=timezone.now() + timedelta(hours=1)
    )
    authenticate_api_key(raw)
    api_key.expires_at = timezone.now() - timedelta(seconds=1)
    api_key.save(update_fields=["expires_at"])  # as the admin would; the cached key is dropped
    with pytest.raises(ExpiredApiKey, match="expired"):
        authenticate_api_key(raw)


def test_create_refuses_bad_scopes_names_and_past_expiry(org):
    for kwargs, field in [
        ({"scopes": []}, "scopes"),
        ({"scopes": ["inference", "root"]}, "scopes"),
        ({"scopes": "inference"}, "scopes"),
        ({"name": "  "}, "name"),
        ({"expires_at": timezone.now() - timedelta(minutes=1)}, "expires_at"),
    ]:
        args = {"organization": org, "name": "k", "scopes": ["inference"], **kwargs}
        with pytest.raises(InvalidInput) as info:
            create_api_key(**args)
        assert info.value.field == field
    assert not ApiKey.objects.exists()


def test_scopes_are_stored_once_each_in_canonical_order(org):
    api_key, _ = create_api_key(organization=org, name="k", scopes=["manage", "inference", "manage"])
    api_key.refresh_from_db()
    assert api_key.scopes == ["inference", "manage"]


def test_touch_writes_last_used_at_most_once_a_minute(org, django_assert_num_queries):
    api_key, raw = create_api_key(organization=org, name="k", scopes=["inference"])
    touch_api_key(api_key=api_key)
    first = ApiKey.objects.get(pk=api_key.pk).last_used_at
    assert first is not None
    with django_assert_num_queries(0):
        touch_api_key(api_key=api_key)
    # Another process holding an older copy of the row does not write again within the minute either.
    stale = authenticate_api_key(raw)
    stale.last_used_at = None
    touch_api_key(api_key=stale)
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at == first
    # Two minutes later (the row as a process that reads it afresh sees it), it writes again.
    ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=first - timedelta(minutes=2))
    read_cache.invalidate()
    touch_api_key(api_key=authenticate_api_key(raw))
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at > first


@pytest.mark.parametrize(
    ("header", "expected"),
    [("Bearer sk-abc", "sk-abc"), (b"bearer   sk-abc ", "sk-abc"), ("Basic dXNlcjpwYXNz", None), ("Bearer", None), ("", None)],
)
def test_parse_bearer(header, expected):
    if expected is None:
        with pytest.raises(InvalidApiKey):
            parse_bearer(header)
    else:
        assert parse_bearer(header) == expected
