"""At a start of the platform on a Redis that kept its data (the embedded one's append-only file),
the requests queued or held when it stopped are dropped (their clients' connections closed with
it), and the usage events waiting for billing are kept."""

from __future__ import annotations

import json

import pytest
import redis
from django.conf import settings

from workers import fleet


KEYS = ["deployment.my-model", "deployment.my-model\x06\x163", "_kombu.binding.deployment.my-model", "billing",
        "unacked", "unacked_index", "queue:waiting:my-model", "fleet:placement"]


@pytest.fixture
def spare_redis(monkeypatch):
    """The Redis database the billing queue test uses (two past the suite's, never another suite's),
    as the fleet's client; this test's keys only."""
    base, db = settings.REDIS_URL.rsplit("/", 1)
    client = redis.Redis.from_url(f"{base}/{(int(db or 0) + 2) % 16}", decode_responses=True)
    client.delete(*KEYS)
    assert not list(client.scan_iter(match="deployment.*")) and not list(client.scan_iter(match="queue:waiting:*"))
    monkeypatch.setattr(fleet, "_client", client)
    yield client
    client.delete(*KEYS)


def test_queued_and_held_requests_go_and_usage_events_stay(spare_redis):
    r = spare_redis
    r.rpush("deployment.my-model", "a request", "another")
    r.rpush("deployment.my-model\x06\x163", "a request of another priority")
    r.sadd("_kombu.binding.deployment.my-model", "binding")  # the queue's binding: kept
    r.rpush("billing", "a usage event")
    r.hset("unacked", mapping={"t1": json.dumps([{"body": "held"}, "", "deployment.my-model"]),
                               "t2": json.dumps([{"body": "an event"}, "", "billing"])})
    r.zadd("unacked_index", {"t1": 1.0, "t2": 2.0})
    r.zadd("queue:waiting:my-model", {"chatcmpl-1": 1.0})
    r.set("fleet:placement", "a holder that died")

    assert fleet.forget_requests_of_a_stopped_platform() == 4
    assert r.lrange("billing", 0, -1) == ["a usage event"] and set(r.hkeys("unacked")) == {"t2"}
    assert r.zrange("unacked_index", 0, -1) == ["t2"] and r.exists("_kombu.binding.deployment.my-model")
    assert not r.exists("deployment.my-model", "deployment.my-model\x06\x163", "queue:waiting:my-model",
                        "fleet:placement")
