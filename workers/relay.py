"""Send events to a gateway's reply channel from worker threads.

channels_redis is asyncio code with one connection pool per event loop, so the worker keeps one
loop in a background thread and every task thread hands its sends to it: no loop, and no new
Redis connection, per message.

After each engine step every running request has a token to send, all at about the same time.
channels_redis's own ``send`` makes four Redis round trips per message (trim expired messages,
check the capacity, add, refresh the expiry); here the messages that are waiting when the loop
turns go out together, in one script call that does the same four steps for each of them. The
gateway receives them with channels_redis's ordinary ``receive``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer

# For each message: drop the channel's expired messages, refuse it if the channel is full, else
# add it and refresh the channel's expiry (channels_redis's send, step for step). Returns the
# 1-based positions of the messages refused.
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
MAX_BATCH = 256  # messages per script call: one call blocks Redis while it runs


class ChannelSender:
    def __init__(self, layer=None):
        self._layer = layer if layer is not None else get_channel_layer()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="channel-sender", daemon=True)
        self._thread.start()
        self._pending: list[tuple[str, dict, Future]] = []
        self._lock = threading.Lock()
        self._scripts: dict[int, object] = {}  # per Redis host, registered on the loop
        self._last_score: dict[str, float] = {}
        self.batches = 0  # script calls made (how well sends coalesce)

    def send(self, channel: str, message: dict, *, timeout: float = 10.0) -> None:
        """Deliver one message; raises ChannelFull if the channel is full, or Redis's error."""
        if "!" not in channel:  # only process-specific channels (the gateway's replies) batch
            future = asyncio.run_coroutine_threadsafe(self._layer.send(channel, message), self._loop)
            future.result(timeout=timeout)
            return
        done: Future = Future()
        with self._lock:
            self._pending.append((channel, message, done))
            first = len(self._pending) == 1
        if first:  # the others join the flush this one schedules
            self._loop.call_soon_threadsafe(self._start_flush)
        done.result(timeout=timeout)

    def _start_flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for start in range(0, len(batch), MAX_BATCH):
            self._loop.create_task(self._flush(batch[start:start + MAX_BATCH]))

    async def _flush(self, batch: list[tuple[str, dict, Future]]) -> None:
        layer = self._layer
        by_host: dict[int, list[tuple[str, dict, Future]]] = {}
        for item in batch:
            by_host.setdefault(layer.consistent_hash(item[0]), []).append(item)
        for index, items in by_host.items():
            try:
                full = await self._run_script(index, items)
            except Exception as exc:
                for _, _, done in items:
                    done.set_exception(exc)
                continue
            for position, (channel, _, done) in enumerate(items, start=1):
                if position in full:
                    done.set_exception(ChannelFull(channel))
                else:
                    done.set_result(None)

    async def _run_script(self, index: int, items: list[tuple[str, dict, Future]]) -> set[int]:
        layer = self._layer
        script = self._scripts.get(index)
        if script is None:
            script = self._scripts[index] = layer.connection(index).register_script(SEND_SCRIPT)
        now = time.time()
        keys, args = [], [int(now) - int(layer.expiry), int(layer.expiry)]
        for channel, message, _ in items:
            keys.append(layer.prefix + layer.non_local_name(channel))
            args += [repr(self._score(channel, now)), layer.serialize({**message, "__asgi_channel__": channel}),
                     layer.get_capacity(channel)]
        self.batches += 1
        return set(await script(keys=keys, args=args))

    def _score(self, channel: str, now: float) -> float:
        """The message's place in its channel (receivers pop the lowest first): later than the
        channel's previous message even if the clock has not moved or stepped back."""
        score = max(now, self._last_score.get(channel, 0.0) + 1e-6)
        self._last_score[channel] = score
        if len(self._last_score) > 10_000:  # only the last moments matter
            self._last_score = {c: s for c, s in self._last_score.items() if s > now - 1.0}
        return score


_sender: ChannelSender | None = None
_lock = threading.Lock()


def sender() -> ChannelSender:
    global _sender
    with _lock:
        if _sender is None:
            _sender = ChannelSender()
        return _sender
