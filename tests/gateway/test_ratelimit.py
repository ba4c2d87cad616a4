"""Rate limits in Redis: a key gets exactly its limit per sliding minute, tokens count once per
request and leave the window on time, and a token sum that was lost is rebuilt from the window."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis
from django.conf import settings

from gateway import ratelimit
from gateway.ratelimit import Limits

BIG = 10**9


@pytest.fixture
def ids():
    """A fresh key and organization id, and their windows deleted after the test."""
    key_id, org_id = f"test-{uuid.uuid4().hex}", f"test-{uuid.uuid4().hex}"
    yield key_id, org_id
    redis.Redis.from_url(settings.REDIS_URL).delete(*ratelimit._keys(key_id, org_id))


def admit(ids, limits, now_ms, request_id=None):
    key_id, org_id = ids
    return ratelimit.admit(key_id=key_id, org_id=org_id, request_id=request_id or uuid.uuid4().hex,
                           limits=limits, now_ms=now_ms)


def record(ids, request_id, tokens, now_ms):
    key_id, org_id = ids
    asyncio.run(ratelimit.record_tokens(key_id=key_id, org_id=org_id, request_id=request_id, tokens=tokens,
                                        now_ms=now_ms))


def test_a_key_gets_exactly_its_request_limit(ids):
    limits, now = Limits(key_rpm=3, org_rpm=BIG, key_tpm=BIG, org_tpm=BIG), int(time.time() * 1000)
    answers = [admit(ids, limits, now + i) for i in range(4)]
    assert [a.allowed for a in answers] == [True, True, True, False]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers[:3]] == ["2", "1", "0"]
    assert answers[3].retry_after_ms == ratelimit.WINDOW_MS - 3 and answers[3].headers["retry-after"] == "60"
    assert answers[3].exhausted == ratelimit.Window("requests", "key", 3, 3, ratelimit.WINDOW_MS - 3)
    assert answers[2].exhausted is None
    assert admit(ids, limits, now + ratelimit.WINDOW_MS).allowed  # the first one left the window


def test_the_headers_describe_the_window_that_binds_first(ids):
    """A fresh key in a busy organization: remaining and reset both come from the organization's
    window when it is the tighter one, and both from the key's when that is."""
    key_id, org_id = ids
    now = int(time.time() * 1000)
    loose_key = Limits(key_rpm=100, org_rpm=5, key_tpm=BIG, org_tpm=BIG)
    other_key = f"test-{uuid.uuid4().hex}"
    ratelimit.admit(key_id=other_key, org_id=org_id, request_id="r0", limits=loose_key,
                    now_ms=now - 20_000)  # the organization's window started 20 s ago, by another key
    headers = admit(ids, loose_key, now).headers
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("5", "3")
    assert headers["x-ratelimit-reset-requests"] == "40s"  # when the organization's oldest leaves
    tight_key = Limits(key_rpm=3, org_rpm=100, key_tpm=BIG, org_tpm=BIG)
    headers = admit(ids, tight_key, now + 10_000).headers
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("3", "1")
    assert headers["x-ratelimit-reset-requests"] == "50s"  # the key's own oldest, admitted at now
    redis.Redis.from_url(settings.REDIS_URL).delete(*ratelimit._keys(other_key, org_id))


def test_tokens_count_once_per_request_and_leave_the_window_on_time(ids):
    limits, now = Limits(key_rpm=BIG, org_rpm=BIG, key_tpm=100, org_tpm=BIG), int(time.time() * 1000)
    record(ids, "req-old", 60, now - 59_000)
    record(ids, "req-new", 50, now - 30_000)
    record(ids, "req-new", 50, now - 30_000)  # delivered twice: counted once
    refused = admit(ids, limits, now)
    assert not refused.allowed and refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert 0 < refused.retry_after_ms <= 1000  # when req-old leaves the window
    assert refused.exhausted == ratelimit.Window("tokens", "key", 100, 110, refused.retry_after_ms)
    later = admit(ids, limits, now + 1500)
    assert later.allowed and later.headers["x-ratelimit-remaining-tokens"] == "50"


def test_a_lost_token_sum_is_rebuilt_from_the_window(ids):
    limits, now = Limits(key_rpm=BIG, org_rpm=BIG, key_tpm=1000, org_tpm=1000), int(time.time() * 1000)
    record(ids, "req-1", 300, now - 1000)
    record(ids, "req-2", 200, now - 500)
    key_sum, org_sum = ratelimit._keys(*ids)[4:]
    redis.Redis.from_url(settings.REDIS_URL).delete(key_sum)  # evicted, or written before sums existed
    answer = admit(ids, limits, now)
    assert answer.headers["x-ratelimit-remaining-tokens"] == "500"
    record(ids, "req-3", 100, now)
    assert admit(ids, limits, now + 1).headers["x-ratelimit-remaining-tokens"] == "400"


def test_a_sum_that_cannot_be_right_is_rebuilt(ids):
    limits, now = Limits(key_rpm=BIG, org_rpm=BIG, key_tpm=1000, org_tpm=BIG), int(time.time() * 1000)
    windows = redis.Redis.from_url(settings.REDIS_URL)
    keys = ratelimit._keys(*ids)
    key_set, key_sum = keys[2], keys[4]
    record(ids, "req-1", 300, now - 1000)
    windows.delete(key_set)  # the set evicted, its sum left: the sum counts nothing
    record(ids, "req-2", 10, now - 500)
    assert admit(ids, limits, now).headers["x-ratelimit-remaining-tokens"] == "990"
    windows.set(key_sum, -500)  # below zero: rebuilt from the members
    assert admit(ids, limits, now + 1).headers["x-ratelimit-remaining-tokens"] == "990"
    assert int(windows.get(key_sum)) == 10 and windows.pttl(key_sum) > 0
