"""Send events to a gateway's reply channel from worker threads.

channels_redis is asyncio code with one connection pool per event loop, so the worker keeps one
loop in a background thread and every task thread hands its sends to it: no loop, and no new
Redis connection, per message. The layer (``inference_platform.channel_layer``) sends what the
threads handed over in the same turn of that loop together.
"""

from __future__ import annotations

import asyncio
import threading

from channels.layers import get_channel_layer


class ChannelSender:
    def __init__(self, layer=None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="channel-sender", daemon=True)
        self._thread.start()
        self._layer = layer if layer is not None else get_channel_layer()

    def send(self, channel: str, message: dict, *, timeout: float = 10.0) -> None:
        """Deliver one message; raises if Redis refuses it (the channel is full or Redis is down)."""
        future = asyncio.run_coroutine_threadsafe(self._layer.send(channel, message), self._loop)
        future.result(timeout=timeout)


_sender: ChannelSender | None = None
_lock = threading.Lock()


def sender() -> ChannelSender:
    global _sender
    with _lock:
        if _sender is None:
            _sender = ChannelSender()
        return _sender
