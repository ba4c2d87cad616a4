"""A streamed response whose request ends when the response does, however it ends.

Django iterates a streaming response's content through wrappers of its own, and closes only
those: the frames' generator is left to asyncio's finalizer, which runs when the generator is
collected (later, or never while a reference cycle holds it). A generator that never started
has no cleanup to run at all. So a client that left before its first frame, or while one was
being written, would have its request generate on, and be billed, for nobody. Django does call
``close()`` on the content of every response it began to send: here that closes the frames'
generator at once, on the event loop it runs on, which cancels the request (and stores a
Responses reply as the model left it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncGenerator

log = logging.getLogger(__name__)

# The closings under way: the loop keeps only weak references to its tasks.
_closing: set[asyncio.Task] = set()


class EventStream:
    """The content of a ``StreamingHttpResponse``: the frames of ``frames``, closed with it."""

    def __init__(self, frames: AsyncGenerator[str, None]):
        self._frames = frames
        self._started = False
        self._loop = asyncio.get_running_loop()

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        self._started = True
        return await anext(self._frames)

    def close(self) -> None:
        """Called by Django, on a thread of its own, once the response is over: sent whole, or
        given up on when its client left."""
        if self._frames.ag_frame is None:  # it ran to its end: nothing left to clean up
            return
        try:
            self._loop.call_soon_threadsafe(self._start_closing)
        except RuntimeError:  # the loop is gone (a test client's, which ran the view only)
            pass

    def _start_closing(self) -> None:
        task = self._loop.create_task(self._end())
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    async def _end(self) -> None:
        try:
            if not self._started:  # started, so that closing it runs its cleanup (its first frame is at hand)
                await anext(self._frames, None)
            await self._frames.aclose()
        except Exception:
            log.exception("closing a stream its client left failed")
