"""Runs a batch: its requests go through the same path as the API's (``calls.begin``: the key, the
model, credit and spend limits, the deployment's queue; not the per-minute limits) a few at a time,
billed at BATCH_PRICE_FACTOR of the model's prices; each outcome is kept as it comes, so that a
runner that dies is resumed (``tasks.resume_batches``) without running a finished request again.

A request refused for a moment (429 queue full, 503 no replica yet) waits and is sent
again, until the batch expires; any other error is its outcome. A cancel or the expiry lets the
requests running finish (they are billed, so their answers are kept) and starts no other.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from decimal import Decimal

from django.conf import settings
from django.db import DatabaseError, IntegrityError, InterfaceError, close_old_connections
from django.utils import timezone

from inference_platform.request_id import new_request_id

from . import admission, answers, calls, formatting, selectors, services
from .batch_input import ENDPOINTS, line_id
from .errors import ApiError
from .models import Batch
from .protocol import parse_chat, parse_completion, parse_embedding

log = logging.getLogger(__name__)
BEAT_SECONDS = 2.0  # how often the runner shows life and looks for a cancel
# Refusals of a moment: the request is sent again (backing off) until the batch expires.
RETRIED = {(429, "queue_full"), (503, "model_unavailable"), (503, "model_overloaded"), (503, "service_unavailable")}
PARSERS = {"chat": parse_chat, "completion": parse_completion, "embedding": parse_embedding}
INTERNAL = ApiError(500, "The batch runner failed on this request; it is logged.", code="internal_error")


def run(batch_id: str) -> None:
    """Run what is left of a batch and end it, unless another runner is on it. A worker that stops
    cancels the requests in flight (billed for what they made) and leaves the batch to be resumed."""
    claimed = services.claim_batch(batch_id=batch_id, lease=services.RUNNER_LEASE)
    if claimed is None:
        return
    batch, token = claimed
    try:
        held = asyncio.run_coroutine_threadsafe(_Runner(batch, token).run(), _loop()).result()
        if stopping.is_set():
            services.release_batch(batch_id=batch_id, token=token)
        elif held:
            services.finish_batch(batch_id=batch_id, token=token)
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
    def __init__(self, batch: Batch, token: str) -> None:
        self.batch = batch
        self.token = token
        self.kind = ENDPOINTS[batch.endpoint]
        self.requests = json.loads(batch.requests)
        self.price_factor = Decimal(settings.BATCH_PRICE_FACTOR)
        self.writes: set[asyncio.Task] = set()  # outcomes being recorded: awaited before the end

    async def run(self) -> bool:
        """Run the lines not done yet, until all are. After a cancel or the expiry, no line starts
        and those running finish (they are billed: their answers are kept); a stop (the worker
        shutting down) cancels them. False when the lease was lost to another runner (which then
        ends the batch)."""
        done = await _db(selectors.done_lines, batch_id=self.batch.pk)
        waiting = [line for line in range(len(self.requests)) if line not in done]
        waiting.reverse()  # popped from the end: input order
        running: set[asyncio.Task] = set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.batch.expires_at - timezone.now()).total_seconds()
        try:
            while waiting or running:
                status = await _db(services.beat_batch, batch_id=self.batch.pk, token=self.token)
                if status is None:
                    return False
                if stopping.is_set():
                    return True  # finally cancels what runs: the batch resumes elsewhere
                if status != Batch.Status.IN_PROGRESS or loop.time() >= deadline:
                    waiting.clear()  # cancelled or expired: what runs finishes, nothing starts
                while waiting and len(running) < settings.BATCH_MAX_IN_FLIGHT:
                    running.add(asyncio.create_task(self._line(waiting.pop(), deadline)))
                if running:
                    _, running = await asyncio.wait(running, timeout=BEAT_SECONDS,
                                                    return_when=asyncio.FIRST_COMPLETED)
            return True
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await asyncio.gather(*self.writes, return_exceptions=True)

    async def _line(self, line: int, deadline: float) -> None:
        """Run one line and record its outcome; nothing but a cancel escapes."""
        try:
            await self._attempt(line, deadline)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: line %d failed", self.batch.pk, line)
            await self._record(line, new_request_id(), INTERNAL.status, INTERNAL.body())

    async def _attempt(self, line: int, deadline: float) -> None:
        body = {key: value for key, value in self.requests[line]["body"].items()
                if key not in ("stream", "stream_options")}
        try:
            inference = PARSERS[self.kind](body)
        except ApiError as exc:
            return await self._record(line, new_request_id(), exc.status, exc.body())  # as the API's 400 has
        loop, backoff = asyncio.get_running_loop(), 1.0
        while True:
            try:
                batch_line = calls.BatchLine(self.price_factor, line_id(self.batch.pk, line))
                call, _ = await calls.begin(inference, caller=self._caller, batch=batch_line)
                break
            except ApiError as exc:
                wait = max(_retry_after(exc), backoff)
                if (exc.status, exc.code) not in RETRIED or loop.time() + wait >= deadline:
                    return await self._record(line, exc.headers.get("x-request-id") or new_request_id(), exc.status,
                                              exc.body())
                await asyncio.sleep(wait)
                backoff = min(60.0, backoff * 2)
        ctx = formatting.Context(kind=self.kind, id=call.request_id, created=call.created, model=inference.model,
                                 fingerprint=call.fingerprint)
        try:
            response = await answers.collect(call, ctx)
        except ApiError as exc:
            return await self._record(line, call.request_id, exc.status, exc.body())
        except BaseException:  # a cancel, the expiry, a bug: stop generating (billed for what it made)
            await asyncio.shield(call.cancel())
            raise
        await self._record(line, call.request_id, 200, response)

    def _caller(self) -> calls.Caller:
        """The batch's key, checked again for each request (on the admission thread) as the API
        checks a key: one revoked, expired or whose creator was deactivated meanwhile stops the
        rest with 401."""
        from accounts.models import ApiKey

        key = ApiKey.objects.select_related("organization", "created_by").filter(pk=self.batch.api_key_id).first()
        if (key is None or key.is_revoked or key.is_expired()
                or (key.created_by is not None and not key.created_by.is_active)):
            raise ApiError(401, "The API key that created this batch was revoked, expired, deactivated or deleted.",
                           code="invalid_api_key")
        return calls.Caller(api_key=key, organization=key.organization)

    async def _record(self, line: int, request_id: str, status_code: int, body: dict) -> None:
        """Keep an outcome, whatever comes: a cancel does not stop the write (the batch's files are
        written only after it), and a failing database is tried again until the stop."""
        write = asyncio.ensure_future(self._write(line, request_id, status_code, body))
        self.writes.add(write)
        write.add_done_callback(self.writes.discard)
        await asyncio.shield(write)

    async def _write(self, line: int, request_id: str, status_code: int, body: dict) -> None:
        while True:
            try:
                return await _db(services.record_outcome, batch_id=self.batch.pk, line=line, request_id=request_id,
                                 status_code=status_code, body=body)
            except (DatabaseError, InterfaceError) as exc:  # the database down or restarting
                if stopping.is_set() or isinstance(exc, IntegrityError):
                    raise
                log.warning("batch %s: could not record line %d (%s); trying again", self.batch.pk, line, exc)
                await asyncio.sleep(2.0)


def _retry_after(exc: ApiError) -> float:
    headers = {name.lower(): value for name, value in exc.headers.items()}
    try:
        return min(60.0, max(0.5, float(headers.get("retry-after") or 1)))
    except ValueError:
        return 1.0
