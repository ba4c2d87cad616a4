"""A gateway that dies takes its clients' connections along: the workers running its requests
notice its pulse is gone and cancel them, rather than run them to their end for nobody and bill
them whole. A pulse missing only for a moment (Redis restarted and lost it) is not a death."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from workers import dispatch, fleet, pulse
from workers.pulse import GatewayPulse


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(pulse.time, "monotonic", fake)
    return fake


def test_a_pulse_gone_past_its_grace_is_a_dead_gateway_and_a_moment_is_not(clock):
    key = dispatch.pulse_key(f"specific.{uuid.uuid4().hex}!abc")
    watch = GatewayPulse(key, grace_s=6)
    fleet.client().set(key, "1", ex=60)
    assert not watch.gone()
    fleet.client().delete(key)  # Redis restarted: the gateway sets it again within its beat
    clock.now += pulse.CHECK_EVERY_S  # a check sooner says what the last one said
    assert not watch.gone()
    clock.now += 3
    fleet.client().set(key, "1", ex=60)
    assert not watch.gone()
    fleet.client().delete(key)  # for good, now
    clock.now += 1
    assert not watch.gone()
    clock.now += 5
    assert not watch.gone() and not watch.abandoned
    clock.now += pulse.CHECK_EVERY_S  # 6 s after it was first missing
    assert watch.gone() and watch.abandoned


def test_a_pulse_that_cannot_be_checked_is_no_death(clock, monkeypatch):
    from redis.exceptions import ConnectionError as RedisConnectionError

    class Down:
        def exists(self, key):
            raise RedisConnectionError("Connection refused")

    watch = GatewayPulse("gateway:pulse:specific.x", grace_s=0)
    monkeypatch.setattr(fleet, "client", Down)
    assert not watch.gone()


def test_the_pulse_key_is_the_gateway_processes_whoever_the_request():
    assert dispatch.pulse_key("specific.4f2a!b1") == dispatch.pulse_key("specific.4f2a!c2") == \
        "gateway:pulse:specific.4f2a"


def test_a_gateway_process_keeps_one_pulse_beating():
    from gateway import pulse as gateway_pulse

    async def scenario():
        channel = f"specific.{uuid.uuid4().hex}!r1"
        key = await gateway_pulse.keep(channel)
        first = gateway_pulse._beats[asyncio.get_running_loop()]
        assert await gateway_pulse.keep(channel.replace("!r1", "!r2")) == key
        assert gateway_pulse._beats[asyncio.get_running_loop()] is first  # one beat per process
        return key

    key = asyncio.run(scenario())
    assert 0 < fleet.client().ttl(key) <= dispatch.PULSE_TTL_S


def test_a_request_whose_gateway_is_gone_is_aborted_as_a_cancel():
    from types import SimpleNamespace

    from workers import choices
    from workers.relay import Stream

    class Relay:
        def put(self, stream, item):
            pass

    aborted = []
    stream = Stream(Relay(), "reply", lambda out: {})

    def abort():
        aborted.append(True)
        stream.progressed = pulse.time.monotonic()
        stream.end()

    stream.handle = SimpleNamespace(computed_tokens=0, abort=abort)
    answers = choices.Choices([stream])
    answers.handles = [stream.handle]
    answers.wait(30, report_every=0.01, abandoned=lambda: True)
    assert aborted
