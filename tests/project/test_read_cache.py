"""The process-local read cache: one load per generation, and any write makes every process re-read."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from inference_platform import read_cache
from inference_platform.read_cache import ReadCache

pytestmark = pytest.mark.django_db


class Loader:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return f"value {self.calls}"


def test_a_value_is_loaded_once_until_a_write_invalidates_it():
    cache, load = ReadCache(), Loader()
    assert cache.get("k", load) == cache.get("k", load) == "value 1"
    read_cache.invalidate()
    assert cache.get("k", load) == "value 2" and load.calls == 2


def test_what_was_read_under_an_older_generation_is_not_served_after_it():
    cache, load = ReadCache(), Loader()
    with read_cache.pinned():  # a request that read the generation just before a write
        read_cache.invalidate()
        assert cache.get("k", load) == "value 1"
    assert cache.get("k", load) == "value 2"


def test_one_generation_read_per_pinned_block(monkeypatch):
    cache, reads = ReadCache(), []
    real = read_cache._read_generation
    monkeypatch.setattr(read_cache, "_read_generation", lambda: reads.append(1) or real())
    with read_cache.pinned():
        cache.get("a", Loader())
        cache.get("b", Loader())
    assert len(reads) == 1


def test_a_failed_load_is_not_cached():
    cache, calls = ReadCache(), []

    def load():
        calls.append(1)
        raise LookupError("no such row")

    for _ in range(2):
        with pytest.raises(LookupError):
            cache.get("k", load)
    assert len(calls) == 2


def test_an_emptied_redis_starts_a_new_generation():
    cache, load = ReadCache(), Loader()
    cache.get("k", load)
    read_cache._redis().delete(read_cache.GENERATION_KEY)
    assert cache.get("k", load) == "value 2"
    assert cache.get("k", load) == "value 2"


def test_entries_older_than_the_max_age_are_read_again(monkeypatch):
    cache, load = ReadCache(), Loader()
    cache.get("k", load)
    monkeypatch.setattr(read_cache, "MAX_AGE_S", 0.0)
    assert cache.get("k", load) == "value 2"


def test_without_redis_every_read_goes_to_the_loader_and_writes_still_succeed(monkeypatch, caplog):
    from tests.support import free_port

    down = redis.Redis(port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    monkeypatch.setattr(read_cache, "_client", down)
    cache, load = ReadCache(), Loader()
    assert cache.get("k", load) == "value 1" and cache.get("k", load) == "value 2"
    read_cache.invalidate()  # logs, does not raise: the write it follows has happened
    outage = [r for r in caplog.records if "cannot reach Redis" in r.getMessage()]
    assert len(outage) == 1 and not outage[0].exc_info  # once per outage, not a traceback per request
    assert "ConnectionError" in outage[0].getMessage()
    monkeypatch.setattr(read_cache, "_client", None)  # Redis is back
    cache.get("k", load)
    cache.get("k", load)
    assert load.calls == 3 and "reaches Redis again" in caplog.text


def test_clear_local_empties_every_cache_of_the_process():
    first, second, load = ReadCache(), ReadCache(), Loader()
    first.get("k", load)
    second.get("k", load)
    read_cache.clear_local()
    first.get("k", load)
    second.get("k", load)
    assert load.calls == 4
