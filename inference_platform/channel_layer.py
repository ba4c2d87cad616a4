"""channels_redis's layer, with process-specific channels served in batches.

Every streamed token is one message on a gateway process's reply channel. channels_redis moves
each message on its own: four Redis round trips to send it, three or four to receive it, and a
turn of its receive lock among the coroutines waiting in that process. With 32 streams on a
2-core machine that was 1.5-2 ms of the gateway's CPU per token. Here:

- ``send`` to a process-specific channel queues the message; the messages queued when the event
  loop turns go out in one script call that does channels_redis's steps for each (drop expired
  messages, refuse a full channel with ``ChannelFull``, add, refresh the expiry).
- ``receive`` on a process-specific channel waits for that channel's messages; one reader per
  process pops what has arrived for all its channels in one call and sorts it. A popped batch
  stays in a backup key until it is sorted, as channels_redis keeps each message, so a reader
  cancelled mid-pop loses nothing: the next one puts the batch back first. Messages for a channel
  nobody asks for within the expiry are dropped, as Redis drops them unread.

The keys, the wire format and the capacity and expiry rules are channels_redis's, so either side
can be plain channels_redis (``group_send`` to these channels included). Other channels are left
to it unchanged. As with channels_redis, one event loop at a time receives on a layer.

A Redis call on a process-specific channel that fails on a dead connection is made once more on a
fresh one (``retry_once``): after Redis restarts, every pooled connection is dead.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer as BaseRedisChannelLayer
from redis.exceptions import ConnectionError as RedisConnectionError

log = logging.getLogger(__name__)

# KEYS: the channels' keys. ARGV: expired-before cutoff, expiry, then per message its score, its
# payload and its channel's capacity. Returns the 1-based positions of the messages refused.
SEND_SCRIPT = """
local cutoff, expiry = tonumber(ARGV[1]), tonumber(ARGV[2])
local full = {}
for i, key in ipairs(KEYS) do
    local at = 3 * i
    redis.call('ZREMRANGEBYSCORE', key, 0, cutoff)
    if redis.call('ZCARD', key) >= tonumber(ARGV[at + 2]) then
        full[#full + 1] = i
    else
        redis.call('ZADD', key, ARGV[at], ARGV[at + 1])
        redis.call('EXPIRE', key, expiry)
    end
end
return full
"""
# KEYS: the channel, its backup. ARGV: how many, whether the backup's batch was handed out, the
# expiry. A batch not handed out (its reader was cancelled before sorting it) goes back first;
# then the oldest messages move to the backup until they are sorted, and are returned, oldest first.
POP_SCRIPT = """
if ARGV[2] == '0' then
    local left = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
    for i = 1, #left, 2 do
        redis.call('ZADD', KEYS[1], left[i + 1], left[i])
    end
end
redis.call('DEL', KEYS[2])
local popped = redis.call('ZPOPMIN', KEYS[1], tonumber(ARGV[1]))
local members = {}
for i = 1, #popped, 2 do
    redis.call('ZADD', KEYS[2], popped[i + 1], popped[i])
    members[#members + 1] = popped[i]
end
if #members > 0 then
    redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
end
return members
"""
SEND_BATCH = 256  # messages per script call: a call holds Redis while it runs
RECEIVE_BATCH = 256


async def retry_once(client, call):
    """Await ``call()``, a call on the asyncio Redis ``client``; if it fails on a connection error,
    drop the pool's idle connections and make it once more, on a fresh one.

    A Redis that restarted leaves every pooled connection dead, and redis-py's asyncio pool (8.1,
    over TCP) hands them out unchecked: each one's first call would fail though Redis is back. A
    second failure is Redis really down (or refusing): raised, as before."""
    try:
        return await call()
    except RedisConnectionError as exc:
        log.info("a Redis connection failed (%s); trying once more on a fresh one", exc)
        await client.connection_pool.disconnect(inuse_connections=False)  # they died together
        return await call()


@dataclass(eq=False)
class _LoopState:
    """What one event loop has going on this layer (channels_redis's pools are per loop, too).
    The messages received are the layer's, not a loop's: a loop that ends (``async_to_sync``)
    leaves them to the next."""

    outgoing: list = field(default_factory=list)  # (channel, payload, capacity, future) not sent yet
    waiters: dict = field(default_factory=dict)  # channel -> futures of the receivers waiting on it
    waiting: int = 0  # receivers waiting now
    reader: asyncio.Task | None = None
    sending: set = field(default_factory=set)  # batches in flight (the loop holds tasks weakly)
    last_score: dict = field(default_factory=dict)  # channel -> score of its last message sent


class RedisChannelLayer(BaseRedisChannelLayer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._inboxes: dict[str, _Inbox] = {}  # channel -> messages received, not yet taken
        self._backup_handed_out = False  # the backup's batch reached the inboxes: drop, not restore
        self._scripts: dict = {}  # (loop, host index, script) -> registered script
        self.send_calls = 0  # script calls made to send (how well sends batch)
        self.receive_calls = 0  # pops made to receive

    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._states.get(loop)
        if state is None:
            state = self._states[loop] = _LoopState()
        return state

    def _script(self, index: int, source: str):
        key = (asyncio.get_running_loop(), index, source)
        script = self._scripts.get(key)
        if script is None:
            self._scripts = {k: s for k, s in self._scripts.items() if not k[0].is_closed()}
            script = self._scripts[key] = self.connection(index).register_script(source)
        return script

    # -- sending ---------------------------------------------------------------------------------

    async def send(self, channel, message):
        if "!" not in channel:
            return await super().send(channel, message)
        await self._queue_send(channel, message)

    async def send_many(self, messages) -> list:
        """Send ``(channel, message)`` pairs in order; those to process-specific channels go out
        in one script call. Returns, per message, None or the exception that refused it
        (``ChannelFull`` for a full channel): one refusal does not stop the others."""
        queued: list = []
        for channel, message in messages:
            try:
                if "!" in channel:
                    queued.append(self._queue_send(channel, message))
                else:  # channels_redis's own way, one at a time to keep the order
                    await super().send(channel, message)
                    queued.append(None)
            except Exception as exc:  # refused, or a message that cannot be serialized
                queued.append(exc)
        results = []
        for item in queued:
            if isinstance(item, asyncio.Future):
                try:
                    await item
                    item = None
                except Exception as exc:
                    item = exc
            results.append(item)
        return results

    def _queue_send(self, channel, message) -> asyncio.Future:
        """Queue a message for this turn's batch; the future settles when Redis took or refused it."""
        assert isinstance(message, dict), "message is not a dict"
        assert self.require_valid_channel_name(channel), "Channel name not valid"
        assert "__asgi_channel__" not in message
        payload = self.serialize({**message, "__asgi_channel__": channel})  # its own error, not the batch's
        state = self._state()
        done = asyncio.get_running_loop().create_future()
        state.outgoing.append((channel, payload, self.get_capacity(channel), done))
        if len(state.outgoing) == 1:  # the first one waiting sends for all who join it this turn
            asyncio.get_running_loop().call_soon(self._send_outgoing, state)
        return done

    def _send_outgoing(self, state: _LoopState) -> None:
        batch, state.outgoing = state.outgoing, []
        for start in range(0, len(batch), SEND_BATCH):
            task = asyncio.ensure_future(self._send_batch(state, batch[start:start + SEND_BATCH]))
            state.sending.add(task)
            task.add_done_callback(state.sending.discard)

    async def _send_batch(self, state: _LoopState, batch: list) -> None:
        by_host: dict[int, list] = {}
        for item in batch:
            by_host.setdefault(self.consistent_hash(item[0]), []).append(item)
        for index, items in by_host.items():
            try:
                # A retried script call adds the same members again: no message is doubled.
                full = await retry_once(self.connection(index), lambda: self._run_send_script(state, index, items))
            except Exception as exc:
                for *_, done in items:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for position, (channel, _, _, done) in enumerate(items, start=1):
                if done.done():
                    continue  # its sender was cancelled; the message went out all the same
                if position in full:
                    done.set_exception(ChannelFull(channel))
                else:
                    done.set_result(None)

    async def _run_send_script(self, state: _LoopState, index: int, items: list) -> set[int]:
        now = time.time()
        keys, args = [], [int(now) - int(self.expiry), int(self.expiry)]
        for channel, payload, capacity, _ in items:
            keys.append(self.prefix + self.non_local_name(channel))
            args += [repr(self._score(state, channel, now)), payload, capacity]
        self.send_calls += 1
        return set(await self._script(index, SEND_SCRIPT)(keys=keys, args=args))

    def _score(self, state: _LoopState, channel: str, now: float) -> float:
        """The message's place in its channel (receivers pop the lowest first): after the
        channel's previous message even when the clock has not moved."""
        score = max(now, state.last_score.get(channel, 0.0) + 1e-6)
        state.last_score[channel] = score
        if len(state.last_score) > 10_000:  # only the last moments matter
            state.last_score = {c: s for c, s in state.last_score.items() if s > now - 1.0}
        return score

    async def flush(self):
        self._inboxes.clear()
        self._backup_handed_out = False
        await super().flush()

    # -- receiving -------------------------------------------------------------------------------

    async def receive(self, channel):
        if "!" not in channel:
            return await super().receive(channel)
        assert self.require_valid_channel_name(channel)
        process_channel = self.non_local_name(channel)
        assert process_channel.endswith(self.client_prefix + "!"), "Wrong client prefix"
        state = self._state()
        inbox = self._inboxes.get(channel)
        if inbox is None:
            inbox = self._inboxes[channel] = _Inbox()
        inbox.touched = time.monotonic()
        while not inbox.messages:
            if state.reader is None or state.reader.done():  # its end is reported a turn later
                state.reader = asyncio.ensure_future(self._read(state, process_channel))
                state.reader.add_done_callback(functools.partial(_reader_ended, state))
            waiter = asyncio.get_running_loop().create_future()
            state.waiters.setdefault(channel, []).append(waiter)
            state.waiting += 1
            try:
                await waiter  # set when a message arrives, or the reader's error
            finally:
                state.waiting -= 1
                inbox.touched = time.monotonic()
                _discard_waiter(state, channel, waiter)
            inbox = self._inboxes.setdefault(channel, inbox)  # flush() may have cleared it meanwhile
        message = inbox.messages.popleft()  # no await since the check: nobody else took it
        if not inbox.messages and channel not in state.waiters:
            self._inboxes.pop(channel, None)
        return message

    async def _read(self, state: _LoopState, process_channel: str) -> None:
        """Pop the process's messages while anyone waits, and sort them into their channels."""
        key = self.prefix + process_channel
        backup = self._backup_channel_name(key)
        index = self.consistent_hash(process_channel)
        pop = self._script(index, POP_SCRIPT)
        redis = self.connection(index)
        while state.waiting:
            self.receive_calls += 1
            # Cleared before the call: a reader cancelled during it must not have the next one
            # drop a batch that this call may have popped and never sorted.
            handed_out, self._backup_handed_out = self._backup_handed_out, False
            # Retried with the same arguments: a call that failed on a connection that died with the
            # old Redis never reached the new one.
            members = await retry_once(redis, lambda: pop(
                keys=[key, backup], args=[RECEIVE_BATCH, int(handed_out), int(self.expiry)]))
            if not members:
                # Nothing there: block until something is, and keep it in the backup until it
                # is sorted, as channels_redis does.
                self.receive_calls += 1
                popped = await retry_once(redis, lambda: redis.bzpopmin(key, timeout=self.brpop_timeout))
                if popped is None:
                    continue
                _, member, score = popped
                await retry_once(redis, lambda: redis.zadd(backup, {member: float(score)}))
                members = [member]
            for member in members:
                self._sort(state, process_channel, member)
            self._backup_handed_out = True  # the next pop drops the backup instead of restoring it
            self._drop_abandoned(state)
            # Let the receivers just served run before counting who still waits: otherwise the
            # reader blocks in Redis for nobody (and an ending loop waits for it).
            await asyncio.sleep(0)

    def _sort(self, state: _LoopState, process_channel: str, member: bytes) -> None:
        try:
            message = self.deserialize(member)
        except Exception:
            message = None
        if not isinstance(message, dict):  # one bad message must not block those behind it
            log.error("dropped a message on %s that is not a channel layer message", process_channel)
            return
        target = message.pop("__asgi_channel__", process_channel)
        group = isinstance(target, list)  # group_send names every channel of the process it reaches
        for channel in target if group else [target]:
            inbox = self._inboxes.get(channel)
            if inbox is None:
                inbox = self._inboxes[channel] = _Inbox()
            inbox.messages.append(dict(message) if group else message)
            for waiter in state.waiters.pop(channel, ()):
                if not waiter.done():
                    waiter.set_result(None)

    def _drop_abandoned(self, state: _LoopState) -> None:
        """Messages for a channel nobody has asked for within the layer's expiry are dropped, as
        Redis would drop them unread (the last tokens sent to a client that left)."""
        cutoff = time.monotonic() - self.expiry
        for channel, inbox in list(self._inboxes.items()):
            if channel not in state.waiters and inbox.touched < cutoff:
                del self._inboxes[channel]


class _Inbox:
    """One channel's received messages, not yet taken."""

    __slots__ = ("messages", "touched")

    def __init__(self):
        self.messages: deque = deque()
        self.touched = time.monotonic()  # when a receiver last asked for this channel


def _discard_waiter(state: _LoopState, channel: str, waiter: asyncio.Future) -> None:
    waiters = state.waiters.get(channel)
    if waiters and waiter in waiters:
        waiters.remove(waiter)
        if not waiters:
            del state.waiters[channel]


def _reader_ended(state: _LoopState, reader: asyncio.Task) -> None:
    """A reader that failed fails its waiting receivers (the next receive starts another)."""
    if state.reader is reader:
        state.reader = None
    if not reader.cancelled() and reader.exception() is None:
        return
    error = ConnectionError("the channel layer's reader was cancelled") if reader.cancelled() else reader.exception()
    for waiters in state.waiters.values():
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)
    state.waiters.clear()
