"""The worker's stream relay against the real engine and the real Redis: every request's tokens
reach its reply channel in order, none before the request was opened, the first-token hook runs
before a token leaves, and a gateway that stops reading has its request aborted."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings

from inference_platform.channel_layer import RedisChannelLayer
from tests.support import wait_until
from workers.engine import Engine, SamplingParams
from workers.engine.loader import bundled_model_path
from workers.relay import ChannelSender, StreamRelay

HOSTS = settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"]


@pytest.fixture(scope="module")
def engine():
    engine = Engine(bundled_model_path(), dtype="float32", max_batch_size=8, batch_window_ms=0).start()
    yield engine
    engine.stop()


@pytest.fixture
def make_relay():
    """``make_relay(capacity, **options)``: a relay on its own sender, closed after the test."""
    made = []

    def make(capacity: int = 1000, **options) -> StreamRelay:
        made.append(StreamRelay(ChannelSender(RedisChannelLayer(hosts=HOSTS, capacity=capacity)), **options))
        return made[-1]

    yield make
    for relay in made:
        relay.close()


def _delta(out) -> dict:
    return {"type": "inference.delta", "text": out.text, "token_ids": out.token_ids, "n": out.completion_tokens}


def _receive_until_done(gateway, channel: str, tokens: int) -> list[dict]:
    async def read():
        messages = []
        while sum(len(m["token_ids"]) for m in messages) < tokens:
            messages.append(await asyncio.wait_for(gateway.receive(channel), 30))
        return messages

    return async_to_sync(read)()


def test_several_streams_arrive_whole_and_in_order_each_marked_before_its_first_token(engine, make_relay):
    gateway = RedisChannelLayer(hosts=HOSTS, capacity=1000)
    marked: list[str] = []
    relay = make_relay(mark_streaming=marked.extend)
    prompts = [f"Count from {n} upwards:" for n in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [out.text for out in engine.generate(prompts, params)]

    channels = [async_to_sync(gateway.new_channel)() for _ in prompts]
    streams, handles = [], []
    for n, (prompt, channel) in enumerate(zip(prompts, channels)):
        stream = relay.stream(channel, _delta)
        stream.handle = engine.submit(prompt, params, request_id=f"relay-{n}", listener=stream)
        streams.append(stream)
    for stream in streams:
        stream.open()
    finals = [stream.wait(60) for stream in streams]

    for n, (channel, final) in enumerate(zip(channels, finals)):
        messages = _receive_until_done(gateway, channel, 12)
        assert "".join(m["text"] for m in messages) == expected[n]
        assert [m["n"] for m in messages] == sorted(m["n"] for m in messages)
        assert final.finished and final.completion_tokens == 12
    assert sorted(marked) == sorted(f"relay-{n}" for n in range(len(prompts)))  # once each


def test_nothing_leaves_before_the_stream_is_opened(engine, make_relay):
    gateway = RedisChannelLayer(hosts=HOSTS, capacity=1000)
    relay = make_relay()
    channel = async_to_sync(gateway.new_channel)()
    stream = relay.stream(channel, _delta)
    stream.handle = engine.submit("Hello there", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                  listener=stream)
    wait_until(lambda: stream.backlog and stream.backlog[-1].finished, timeout=60,
               message="the request ran to its end, held back")
    assert not stream.ended and stream.last is None  # held, not sent

    async def nothing_yet():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(gateway.receive(channel), 0.3)

    async_to_sync(nothing_yet)()
    stream.open()
    assert stream.wait(30).completion_tokens == 5
    assert sum(len(m["token_ids"]) for m in _receive_until_done(gateway, channel, 5)) == 5


def test_progress_is_reported_in_order_between_the_start_and_the_end(make_relay):
    """A report before the stream is opened would overtake the start the gateway waits for, and
    one after the end would land in the next request's wait: neither leaves."""
    from types import SimpleNamespace

    from workers.relay import PROGRESS_MESSAGE

    gateway = RedisChannelLayer(hosts=HOSTS, capacity=1000)
    relay = make_relay()
    channel = async_to_sync(gateway.new_channel)()
    stream = relay.stream(channel, _delta)
    stream.report_progress()  # not opened yet: dropped
    stream.open()
    stream.report_progress()
    stream(SimpleNamespace(request_id="cmpl-1", token_ids=[7], text="Hi", completion_tokens=1, finished=True,
                           prompt_logprobs=None))
    stream.report_progress()  # ended: dropped
    stream.wait(30)

    async def received():
        messages = [await asyncio.wait_for(gateway.receive(channel), 30) for _ in range(2)]
        with pytest.raises(asyncio.TimeoutError):
            messages.append(await asyncio.wait_for(gateway.receive(channel), 0.3))
        return messages

    assert [m["type"] for m in async_to_sync(received)()] == [PROGRESS_MESSAGE["type"], "inference.delta"]


def test_a_gateway_that_stops_reading_has_its_request_aborted(engine, make_relay):
    gateway = RedisChannelLayer(hosts=HOSTS, capacity=2)
    relay = make_relay(capacity=2)
    channel = async_to_sync(gateway.new_channel)()
    stream = relay.stream(channel, _delta)
    stream.handle = engine.submit("Tell me a long story", SamplingParams(max_tokens=200, ignore_eos=True),
                                  listener=stream)
    stream.open()
    final = stream.wait(60)
    assert final.finish_reason == "abort" and final.completion_tokens < 200


def test_a_stream_with_no_output_times_out(make_relay):
    stream = make_relay().stream("specific.nobody!x", _delta)
    with pytest.raises(TimeoutError):
        stream.wait(0.2)


def test_a_stream_another_worker_took_over_sends_nothing_more_and_is_aborted(engine, make_relay):
    """A paused worker presumed dead, whose request was handed on: nothing of it may leave."""
    from workers.agent import Ticket
    from workers.relay import Superseded

    gateway = RedisChannelLayer(hosts=HOSTS, capacity=1000)
    handed_on = {"now": False}

    def check(tickets):
        for ticket in tickets:
            ticket.superseded = ticket.superseded or handed_on["now"]

    relay = make_relay(check_tickets=check)
    channel = async_to_sync(gateway.new_channel)()
    ticket = Ticket("handed-on")
    stream = relay.stream(channel, _delta, ticket)
    stream.handle = engine.submit("Tell me a long story", SamplingParams(max_tokens=400, ignore_eos=True),
                                  request_id="handed-on", listener=stream)
    stream.open()
    received = _receive_until_done(gateway, channel, 3)  # streaming, as the worker was paused
    handed_on["now"] = True
    with pytest.raises(Superseded):
        stream.wait(60)
    assert ticket.superseded
    wait_until(lambda: engine.stats()["running"] == 0, timeout=30, message="the aborted request to leave the engine")

    async def drain():  # whatever was sent before the hand-over: nothing after it
        messages = []
        while True:
            try:
                messages.append(await asyncio.wait_for(gateway.receive(channel), 0.5))
            except asyncio.TimeoutError:
                return messages

    late = async_to_sync(drain)()
    assert len(late) <= 2, late  # at most what was already on its way when the request was handed on
    assert stream.last.completion_tokens < 400 and received


def test_a_request_whose_client_does_not_stream_is_not_marked_streaming(engine, make_relay):
    """Its tokens wait in the gateway: a copy redelivered after a death may still run from the start."""
    gateway = RedisChannelLayer(hosts=HOSTS, capacity=1000)
    marked: list[str] = []
    relay = make_relay(mark_streaming=marked.extend)
    channel = async_to_sync(gateway.new_channel)()
    stream = relay.stream(channel, _delta, client_streams=False)
    stream.handle = engine.submit("Say hi", SamplingParams(max_tokens=4, ignore_eos=True), request_id="held",
                                  listener=stream)
    stream.open()
    assert stream.wait(30).completion_tokens == 4
    assert sum(len(m["token_ids"]) for m in _receive_until_done(gateway, channel, 4)) == 4
    assert marked == []
