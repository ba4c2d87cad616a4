"""Runs a batch: its requests go through the same path as the API's (``calls.begin``: the key, the
model, credit and spend limits, the deployment's queue, the rate limits) a few at a time, billed at
BATCH_PRICE_FACTOR of the model's prices; each outcome is kept as it comes, so that a runner that
dies is resumed (``tasks.resume_batches``) without running a finished request again.

A request refused for a moment (429 queue or rate limit, 503 no replica yet) waits and is sent
again, until the batch expires; any other error is its outcome.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.db import close_old_connections

from . import admission, answers, calls, formatting, selectors, services
from .batch_input import ENDPOINTS
from .errors import ApiError
from .models import Batch
from .protocol import parse_chat, parse_completion

log = logging.getLogger(__name__)
LEASE = timedelta(seconds=60)  # a runner silent this long is taken for dead
BEAT_SECONDS = 2.0  # how often the runner shows life and looks for a cancel
RETRIED = {(429, "queue_full"), (429, "rate_limit_exceeded"), (503, None)}
PARSERS = {"chat": parse_chat, "completion": parse_completion}


def run(batch_id: str) -> None:
    """Run what is left of a batch and end it, unless another runner is on it. A worker that stops
    cancels the requests in flight (billed for what they made) and leaves the batch to be resumed."""
    batch = services.claim_batch(batch_id=batch_id, lease=LEASE)
    if batch is None:
        return
    try:
        asyncio.run_coroutine_threadsafe(_Runner(batch).run(), _loop()).result()
        if stopping.is_set():
            services.release_batch(batch_id=batch_id)
        else:
            services.finish_batch(batch_id=batch_id)
    finally:
        close_old_connections()


stopping = threading.Event()  # the worker is shutting down (``tasks``' signal sets it)


_shared: asyncio.AbstractEventLoop | None = None
_shared_lock = threading.Lock()


def _loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for runners: the channel layer receives its replies on one
    loop only, and a worker may run several batches at once (one per thread)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            admission.use_threads()  # the database work of admission and of the runners
            _shared = asyncio.new_event_loop()
            threading.Thread(target=_shared.run_forever, name="batch-runners", daemon=True).start()
        return _shared


def _db(fn, **kwargs):
    """A database call from the runners' loop, on an admission thread."""
    return admission.run(functools.partial(fn, **kwargs))


class _Runner:
    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.kind = ENDPOINTS[batch.endpoint]
        self.requests = json.loads(batch.requests)
        self.price_factor = Decimal(settings.BATCH_PRICE_FACTOR)

    async def run(self) -> None:
        done = await _db(selectors.done_lines, batch_id=self.batch.pk)
        waiting = [line for line in range(len(self.requests)) if line not in done]
        waiting.reverse()  # popped from the end: input order
        running: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.batch.expires_at - _now()).total_seconds()
        try:
            while waiting or running:
                status = await _db(services.beat_batch, batch_id=self.batch.pk)
                if status != Batch.Status.IN_PROGRESS or loop.time() >= deadline or stopping.is_set():
                    return  # cancelled, expired or stopped: finally stops what runs
                while waiting and len(running) < settings.BATCH_MAX_IN_FLIGHT:
                    running.add(asyncio.create_task(self._line(waiting.pop(), deadline)))
                finished, running = await asyncio.wait(running, timeout=BEAT_SECONDS,
                                                       return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    task.result()  # a bug surfaces here rather than vanish
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _line(self, line: int, deadline: float) -> None:
        request = self.requests[line]
        body = {key: value for key, value in request["body"].items() if key not in ("stream", "stream_options")}
        try:
            inference = PARSERS[self.kind](body)
        except ApiError as exc:
            return await self._record(line, "", exc.status, exc.body())
        loop = asyncio.get_running_loop()
        while True:
            try:
                call, _ = await calls.begin(inference, caller=self._caller, price_factor=self.price_factor)
            except ApiError as exc:
                retry = (exc.status, exc.code if exc.status == 429 else None) in RETRIED
                if retry and loop.time() + 1 < deadline:
                    await asyncio.sleep(_retry_after(exc))
                    continue
                return await self._record(line, exc.headers.get("x-request-id", ""), exc.status, exc.body())
            break
        ctx = formatting.Context(kind=self.kind, id=call.request_id, created=call.created, model=inference.model)
        try:
            response = await answers.collect(call, ctx)
        except ApiError as exc:
            return await self._record(line, call.request_id, exc.status, exc.body())
        except asyncio.CancelledError:  # a cancel or the expiry: stop generating (billed for what it made)
            await asyncio.shield(call.cancel())
            raise
        await self._record(line, call.request_id, 200, response)

    def _caller(self) -> calls.Caller:
        """The batch's key, checked again for each request (on the admission thread): one revoked or
        expired meanwhile stops the rest with 401."""
        from accounts.models import ApiKey

        key = ApiKey.objects.select_related("organization").filter(pk=self.batch.api_key_id).first()
        if key is None or key.is_revoked or key.is_expired():
            raise ApiError(401, "The API key that created this batch was revoked, expired or deleted.",
                           code="invalid_api_key")
        return calls.Caller(api_key=key, organization=key.organization)

    async def _record(self, line: int, request_id: str, status_code: int, body: dict) -> None:
        await _db(services.record_outcome, batch_id=self.batch.pk, line=line, request_id=request_id,
                  status_code=status_code, body=body)


def _retry_after(exc: ApiError) -> float:
    try:
        return min(30.0, max(0.5, float(exc.headers.get("retry-after") or exc.headers.get("Retry-After") or 1)))
    except ValueError:
        return 1.0


def _now():
    from django.utils import timezone

    return timezone.now()
