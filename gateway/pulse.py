"""This gateway process's pulse in Redis (``workers.dispatch.pulse_key``): set now, then again
every PULSE_EVERY_S on the process's event loop, for as long as the loop runs."""

from __future__ import annotations

import asyncio
import logging

from workers import dispatch

from . import ratelimit

log = logging.getLogger(__name__)
_beats: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}


async def keep(reply_channel: str) -> str:
    """Make sure this process's pulse beats (started by its first request); its key."""
    key = dispatch.pulse_key(reply_channel)
    loop = asyncio.get_running_loop()
    beat = _beats.get(loop)
    if beat is None or beat.done():
        await ratelimit.client().set(key, "1", ex=dispatch.PULSE_TTL_S)
        _beats[loop] = loop.create_task(_beat(key), name="gateway-pulse")
    return key


async def _beat(key: str) -> None:
    while True:
        await asyncio.sleep(dispatch.PULSE_EVERY_S)
        try:
            await ratelimit.client().set(key, "1", ex=dispatch.PULSE_TTL_S)
        except Exception as exc:  # Redis down: its requests fail anyway; beat again once it is back
            log.warning("the gateway's pulse missed a beat: %s", exc)
