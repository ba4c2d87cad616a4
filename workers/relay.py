"""Send events to gateways' reply channels from a worker process.

channels_redis is asyncio code with one connection pool per event loop, so the worker keeps one
loop in a background thread (``ChannelSender``) and every task thread hands its sends to it: no
loop, and no new Redis connection, per message.

Tokens do not go through the task threads at all. A ``StreamRelay`` on that loop takes the
outputs of every request straight from the engine (its ``listener``), a step at a time, and sends
them in one call to the layer: one wake-up per engine step instead of a thread per stream per
token, which on a busy host took the CPU the engine needed (a thread handing each token over,
waiting for its send, and the GIL passed between them).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
from collections import deque
from typing import Callable

from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)
_OPEN = object()  # a stream's marker in the relay's queue: the gateway knows it started
_PROGRESS = object()  # one that made progress without an output (a long prompt's chunks)
PROGRESS_MESSAGE = {"type": "inference.progress"}
# How far back a stream remembers when its tokens reached the gateway (``Stream.tokens_sent``):
# longer than a dead gateway takes to be noticed (``workers.pulse``), in steps of SENT_STEP_S.
SENT_MEMORY_S = 60.0
SENT_STEP_S = 0.25


class Superseded(Exception):
    """Another worker answers this request now: this process was presumed dead (paused past its
    heartbeats, say) and its requests were handed on. This copy sends nothing more, bills nothing."""


class ChannelSender:
    def __init__(self, layer=None):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="channel-sender", daemon=True)
        self._thread.start()
        self.layer = layer if layer is not None else get_channel_layer()

    def send(self, channel: str, message: dict, *, timeout: float = 10.0) -> None:
        """Deliver one message; raises if Redis refuses it (the channel is full or Redis is down)."""
        future = asyncio.run_coroutine_threadsafe(self.layer.send(channel, message), self.loop)
        future.result(timeout=timeout)


class Stream:
    """One request's way through the relay: pass it to ``Engine.submit`` as the listener, then
    ``open()`` it once the gateway has the request's start, and ``wait()`` for its end."""

    def __init__(self, relay: "StreamRelay", channel: str, to_message: Callable[[object], dict], ticket=None,
                 client_streams: bool = True, request_id: str | None = None):
        self.channel = channel
        # The request the client sent (of which this stream may be one answer, see
        # ``workers.choices``); None: the engine's id for it.
        self.request_id = request_id
        self.to_message = to_message  # an engine output -> the message sent for it
        self.ticket = ticket  # this run of the request (``workers.agent.Ticket``): superseded or not
        # Whether its tokens reach the client as they come: else the gateway holds them until the
        # end, and a copy redelivered after a death may run again from the start.
        self.client_streams = client_streams
        self.handle = None  # the engine's handle, for aborts (set once submitted)
        self.last = None  # the last output relayed
        self.error: BaseException | None = None  # the failure that ended the relay of this stream
        self.progressed = time.monotonic()  # when an output last arrived
        self.streaming = False  # a token has been sent
        self.lost = False  # a send of it failed: its client may lack part of its answer, the end included
        self.opened = False
        self.backlog: list = []  # outputs that came before open()
        # [step started, when, completion tokens] as the gateway received them, one per step of
        # SENT_STEP_S, over the last SENT_MEMORY_S (and the step before), latest last.
        self._sent: deque[list] = deque()
        self._relay = relay
        self._done = threading.Event()

    def __call__(self, out) -> None:
        """The engine's listener (on its thread): queue the output."""
        self._relay.put(self, out)

    def open(self) -> None:
        """From now on outputs go out (nothing may overtake the start message the caller sent)."""
        self._relay.put(self, _OPEN)

    def report_progress(self) -> None:
        """Tell the gateway the request moves, though it has no token to show (its prompt is
        computed chunk by chunk): its stall timer starts again. In order with the outputs."""
        self._relay.put(self, _PROGRESS)

    @property
    def computed_tokens(self) -> int:
        return self.handle.computed_tokens if self.handle is not None else 0

    def record_sent(self, completion_tokens: int, now: float) -> None:
        """The gateway has the output holding the first ``completion_tokens`` (on the relay's loop)."""
        sent = self._sent
        if sent and now - sent[-1][0] < SENT_STEP_S:
            sent[-1][1:] = [now, completion_tokens]  # the step goes on
        else:
            sent.append([now, now, completion_tokens])
        while len(sent) > 2 and sent[1][1] < now - SENT_MEMORY_S:
            sent.popleft()

    def tokens_sent(self, by: float | None = None) -> int:
        """The completion tokens the gateway had received (by the monotonic time ``by``, to a step:
        never more): what a streaming client can have been given."""
        for _, when, tokens in reversed(list(self._sent)):
            if by is None or when <= by:
                return tokens
        return 0

    def wait(self, stall_timeout: float, progressed: Callable[[], float] | None = None, *,
             poll: float | None = None):
        """Block until the final output was sent; return it. ``TimeoutError`` if no output came
        for ``stall_timeout`` s (since ``progressed()``, when given: the last progress of the
        request this stream is part of, asked at least every ``poll`` s); the send's error if the
        relay could not deliver."""
        progressed = progressed or (lambda: self.progressed)
        while not self._done.wait(timeout=min(poll or stall_timeout,
                                              max(0.0, progressed() + stall_timeout - time.monotonic()))):
            if time.monotonic() - progressed() >= stall_timeout:
                raise TimeoutError(f"no output for {stall_timeout} s")
        if self.error is not None:
            raise self.error
        return self.last

    def abort(self) -> None:
        if self.handle is not None:
            self.handle.abort()

    def end(self, error: BaseException | None = None) -> None:
        if not self._done.is_set():
            self.error = error
            self._done.set()

    @property
    def ended(self) -> bool:
        return self._done.is_set()


class StreamRelay:
    """Sends the outputs of every stream of this worker, in order per stream, a batch at a time.

    ``mark_streaming`` is called (on the relay's loop, blocking it briefly) with the request ids
    whose first token is about to leave for a streaming client, before it does: a copy of the
    request redelivered after this must not run again (the client has seen tokens).
    ``check_tickets`` is called with the tickets of the streams about to send, and marks superseded
    those another worker took over: their requests are aborted here instead, and nothing of them
    leaves."""

    def __init__(self, sender: ChannelSender, *, mark_streaming: Callable[[list[str]], None] | None = None,
                 check_tickets: Callable[[list], None] | None = None):
        self._sender = sender
        self._mark_streaming = mark_streaming
        self._check_tickets = check_tickets
        self._pending: list[tuple[Stream, object]] = []
        self._lock = threading.Lock()
        self._wakeup = asyncio.Event()  # bound to the sender's loop on first use there
        self._pumping = asyncio.run_coroutine_threadsafe(self._pump(), sender.loop)

    def close(self) -> None:
        """Stop relaying (the streams not ended stay so)."""
        self._pumping.cancel()

    def stream(self, channel: str, to_message: Callable[[object], dict], ticket=None,
               client_streams: bool = True, request_id: str | None = None) -> Stream:
        return Stream(self, channel, to_message, ticket, client_streams, request_id)

    def put(self, stream: Stream, item) -> None:
        with self._lock:
            self._pending.append((stream, item))
            first = len(self._pending) == 1
        if first:  # the rest of a step's outputs join this wake-up
            self._sender.loop.call_soon_threadsafe(self._wakeup.set)

    async def _pump(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            with self._lock:
                batch, self._pending = self._pending, []
            try:
                await self._relay(batch)
            except Exception as exc:  # never leave a stream waiting on a relay that stopped
                log.exception("relaying %d outputs failed", len(batch))
                for stream, _ in batch:
                    stream.lost = True
                    stream.abort()
                    stream.end(exc)

    async def _relay(self, batch: list) -> None:
        outgoing: list[tuple[Stream, dict]] = []
        tokens: list[int | None] = []  # per message: the completion tokens it brings the gateway to
        finishing: list[Stream] = []
        first_tokens: dict[str, None] = {}  # request ids, once each, in order
        self._drop_superseded(batch)
        for stream, item in batch:
            if item is _PROGRESS:  # before the start, or after the end (maybe in this batch): nothing
                if stream.opened and not stream.ended and not (stream.last is not None and stream.last.finished):
                    outgoing.append((stream, PROGRESS_MESSAGE))
                    tokens.append(None)
                continue
            if item is _OPEN:
                stream.opened = True
                outputs, stream.backlog = stream.backlog, []
            elif not stream.opened:
                stream.backlog.append(item)
                continue
            else:
                outputs = [item]
            for out in outputs:
                if stream.ended:
                    continue  # its relay failed: the rest goes nowhere
                stream.last, stream.progressed = out, time.monotonic()
                if out.token_ids or out.text or out.prompt_logprobs is not None or getattr(out, "embedding", None) is not None:
                    try:
                        outgoing.append((stream, stream.to_message(out)))
                        tokens.append(getattr(out, "completion_tokens", None))
                    except Exception as exc:
                        log.exception("could not build the message for %s", stream.channel)
                        stream.abort()
                        stream.end(exc)
                        continue
                    if not stream.streaming:
                        stream.streaming = True
                        if stream.client_streams:
                            first_tokens[stream.request_id or out.request_id] = None
                if out.finished:
                    finishing.append(stream)
        if first_tokens and self._mark_streaming is not None:
            try:
                self._mark_streaming(list(first_tokens))
            except Exception:  # the answer matters more than the record of its progress
                log.exception("could not record that %d requests are streaming", len(first_tokens))
        results = await send_many(self._sender.layer, [(s.channel, m) for s, m in outgoing])
        sent_at = time.monotonic()
        for (stream, _), count, error in zip(outgoing, tokens, results):
            if error is None and count is not None:
                stream.record_sent(count, sent_at)
        for (stream, _), error in zip(outgoing, results):
            if error is not None:
                stream.lost = True
            if isinstance(error, ChannelFull):
                stream.abort()  # the gateway stopped reading: stop generating for nobody
            elif error is not None:
                stream.abort()
                stream.end(error)
        for stream in finishing:
            stream.end()

    def _drop_superseded(self, batch: list) -> None:
        tickets = list({id(s.ticket): s.ticket for s, _ in batch if s.ticket is not None and not s.ended}.values())
        if tickets and self._check_tickets is not None:
            try:
                self._check_tickets(tickets)
            except Exception:  # Redis unreachable: the sends that follow fail the same way
                log.exception("could not check whether %d requests are still this worker's", len(tickets))
        for stream, _ in batch:
            if stream.ticket is not None and stream.ticket.superseded and not stream.ended:
                stream.abort()
                stream.end(Superseded(stream.ticket.request_id))


async def send_many(layer, messages: list[tuple[str, dict]]) -> list[BaseException | None]:
    """Send messages in order; per message, None or the exception that refused it. The
    platform's layer sends them together; another layer, one after the other."""
    if hasattr(layer, "send_many"):
        return await layer.send_many(messages)
    results: list[BaseException | None] = []
    for channel, message in messages:
        try:
            await layer.send(channel, message)
            results.append(None)
        except Exception as exc:
            results.append(exc)
    return results


_sender: ChannelSender | None = None
_relay: StreamRelay | None = None
_lock = threading.Lock()


def sender() -> ChannelSender:
    global _sender
    with _lock:
        if _sender is None:
            _sender = ChannelSender()
        return _sender


def relay() -> StreamRelay:
    """This process's relay, recording first tokens in the fleet's request progress."""
    global _relay
    channel_sender = sender()  # before the lock: sender() takes it too
    with _lock:
        if _relay is None:
            from . import fleet
            from .agent import agent

            _relay = StreamRelay(channel_sender,
                                 mark_streaming=lambda ids: fleet.set_stages(ids, fleet.STAGE_STREAMING),
                                 check_tickets=agent.check_tickets)
            atexit.register(_relay.close)
        return _relay
