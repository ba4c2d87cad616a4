"""One inference call through the platform, shared by the HTTP views and the WebSocket consumer:
authenticate, admit (quota, rate limits), dispatch to the deployment's queue, and relay the
worker's events back.

Everything before dispatch is blocking work (the database, the rate-limit script, the publish on
the broker) and runs in ONE trip to a thread (``gateway.admission``), with as few queries as the
checks allow: each trip and each ORM query costs CPU that every concurrent request waits for, and
the time to first token is what it adds up to.

Every refusal before dispatch raises ``ApiError``; nothing refused is billed, because only a
worker that ran the request emits usage.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Callable, NamedTuple

from channels.layers import get_channel_layer
from django.conf import settings
from django.db import InterfaceError as DatabaseInterfaceError
from django.db import OperationalError as DatabaseOperationalError
from kombu.exceptions import OperationalError as BrokerError
from redis.exceptions import RedisError

from billing.pricing import FREE, PRICE_DECIMAL_PLACES, PRICE_FIELDS, Prices
from inference_platform import read_cache
from workers import capacity, dispatch

from . import admission, ratelimit
from . import pulse as gateway_pulse
from .errors import ApiError
from .protocol import InferenceRequest
from .timing import Stages

log = logging.getLogger(__name__)


@dataclass
class Caller:
    """Who is calling: an API key, or a dashboard user (the playground) with no key."""

    api_key: object
    organization: object
    user_id: int | None = None
    session_key: str | None = None  # a dashboard user's: the session the socket was opened with

    @property
    def key_id(self):
        """What rate limits count against: the key, or the dashboard user."""
        return self.api_key.pk if self.api_key is not None else f"user-{self.user_id}"

    @property
    def org_id(self):
        return self.organization.pk


def authenticate_sync(header, *, scope: str | None = "inference") -> Caller:
    """The caller behind an ``Authorization`` header; 401 for a bad key, 403 without ``scope``."""
    from accounts.errors import ApiKeyError
    from accounts.selectors import authenticate_api_key, parse_bearer
    from accounts.services import touch_api_key

    try:
        api_key = authenticate_api_key(parse_bearer(header))
    except ApiKeyError as exc:
        raise ApiError(401, exc.message, code=exc.code) from None
    if scope and not api_key.has_scope(scope):
        raise ApiError(403, f"This API key is missing the '{scope}' scope.", code="missing_scope")
    touch_api_key(api_key=api_key)
    return Caller(api_key=api_key, organization=api_key.organization)


def session_caller(caller: Caller) -> Caller:
    """A dashboard user's caller, checked again: 401 once the user signed out, changed or reset
    their password (the session is gone or no longer matches), is deactivated or no longer belongs
    to the organization."""
    from accounts.selectors import is_active_member

    if not _session_alive(caller) or not is_active_member(user_id=caller.user_id, organization_id=caller.org_id):
        raise ApiError(401, "You no longer have access to this organization; sign in again.", code="invalid_session")
    return caller


def _session_alive(caller: Caller) -> bool:
    """Whether the caller's session still signs in its user, as Django checks a page's request
    (stored, not expired, and made with the user's current password)."""
    from importlib import import_module
    from types import SimpleNamespace

    from django.contrib.auth import get_user

    if not caller.session_key:
        return False
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key=caller.session_key)
    return get_user(SimpleNamespace(session=store)).pk == caller.user_id


# What each (organization, model name) routes to: read once per process until a
# deployment or catalog model changes (``models_catalog``'s receivers and services invalidate:
# a price changed in the catalog is in the next request's route).
_routes = read_cache.ReadCache()
# The catalog model's price columns, read with the deployment: ``price_<name>`` for each price.
_PRICE_COLUMNS = {name: f"model__price_{name}" for name in PRICE_FIELDS}


class Route(NamedTuple):
    """Where a model name sends a caller's request."""

    spec: dict  # the engine spec (shared: read only)
    ready: bool  # a replica is ready
    stopped: bool  # its owner stopped it: nothing serves it until started again
    queue_limit: int  # not part of the spec: changing it must not reload the engine
    context_length: int | None  # the catalog model's, when known
    prices: dict  # the catalog model's (Decimal strings, ``Prices.as_strings``): what the request is billed at


def _load_route(organization, model: str) -> Route:
    from models_catalog.errors import DeploymentNotFound
    from models_catalog.models import Deployment, billed_by_the_hour
    from models_catalog.selectors import deployments_visible_to

    visible = deployments_visible_to(organization=organization)
    row = (visible.filter(name=model)
           .values(*dispatch.SPEC_FIELDS, "queue_limit", "model__context_length", *_PRICE_COLUMNS.values(),
                   "kind", "organization_id", "model__price_per_replica_hour").first())
    if row is None:  # raised, so not cached: made-up names cannot crowd out the real ones
        raise ApiError(404, DeploymentNotFound(model).message, param="model", code="model_not_found")
    prices = Prices(**{name: row[column] for name, column in _PRICE_COLUMNS.items()})
    if billed_by_the_hour(kind=row["kind"], organization_id=row["organization_id"],
                          price_per_replica_hour=row["model__price_per_replica_hour"]):
        prices = FREE  # its replicas are billed by the hour, not its tokens
    return Route(dispatch.spec_from_row(row), row["status"] == Deployment.Status.READY,
                 row["status"] == Deployment.Status.STOPPED, row["queue_limit"], row["model__context_length"],
                 prices.as_strings())


def _deployment_spec(caller: Caller, model: str) -> Route:
    """The route of the deployment ``model`` names for the caller; 404 when the caller has no such
    deployment."""
    return _routes.get((caller.org_id, model), lambda: _load_route(caller.organization, model))


def _check_max_tokens(request: InferenceRequest, context_length: int | None) -> None:
    """No request can generate more tokens than the model's context holds: an asked-for maximum
    beyond it is refused, as OpenAI does, rather than let one request hold a worker that long."""
    wanted = request.sampling.get("max_tokens")
    if wanted is not None and context_length and wanted > context_length:
        name = request.max_tokens_param
        raise ApiError(400, f"{name} is too large: {wanted}. This model's context holds at most {context_length} "
                            "tokens, prompt included.", param=name, code="invalid_value")


def _admit(caller: Caller, spec: dict, queue_limit: int, request_id: str, *, batch: bool = False) -> ratelimit.Decision:
    """Count the request against its rate limits and among its deployment's waiting requests,
    unless those are at the queue limit (a full queue turns requests away rather than let them
    wait past any use) or a limit is reached: one script in Redis. A batch's request counts
    against no limit of the caller's, and finds the queue full at BATCH_QUEUE_PERCENT of its
    limit: the rest is the API's."""
    if batch:
        queue_limit = max(1, queue_limit * settings.BATCH_QUEUE_PERCENT // 100)
    decision = ratelimit.admit(key_id=caller.key_id, org_id=caller.org_id, request_id=request_id,
                               waiting=dispatch.waiting_key(spec["name"]), queue_limit=queue_limit,
                               waiting_s=dispatch.longest_wait(), windows=not batch)
    if decision.queue_full:  # the platform's capacity, not the caller's limits
        raise ApiError(429, f"The deployment '{spec['name']}' has {queue_limit} requests waiting, its limit; "
                            "retry shortly.", code="queue_full", type="server_error",
                       headers={"Retry-After": "1"})
    if not decision.allowed:
        raise _rate_limited(caller, decision)
    return decision


def _rate_limited(caller: Caller, decision: ratelimit.Decision) -> ApiError:
    """OpenAI's 429: which limit was reached, how much of it is used, and when to try again; its
    ``type`` is the unit (``requests`` or ``tokens``)."""
    window = decision.exhausted
    wait = ratelimit.duration(decision.retry_after_ms)
    if window is None:  # a window freed up between the check and this read: cannot say which
        return ApiError(429, f"Rate limit reached; please try again in {wait}.", code="rate_limit_exceeded",
                        headers=decision.headers)
    whose = ("your organization" if window.scope == "organization"
             else "this API key" if caller.api_key is not None else "your account")
    per = "RPM" if window.unit == "requests" else "TPM"
    return ApiError(429, f"Rate limit reached for {window.unit} per min ({per}) on {whose}: limit {window.limit}, "
                         f"used {window.used}. Please try again in {wait}.", code="rate_limit_exceeded",
                    type=window.unit, headers=decision.headers)


def _check_quota(caller: Caller) -> None:
    from billing.errors import QuotaExceeded
    from billing.services import check_quota

    try:
        check_quota(organization=caller.organization, api_key=caller.api_key)
    except QuotaExceeded as exc:
        raise ApiError(429, exc.message, code=exc.code, type=exc.type) from None


# Redis failing (the broker, the rate limits, the reply channels): the client may retry. The
# channel layer fails its waiters with the built-in ConnectionError when its reader loses Redis.
REDIS_FAILURES = (RedisError, BrokerError, ConnectionError)


def unavailable(exc: BaseException, *, part: str = "message broker") -> ApiError:
    """Redis, or the database, down or restarting (a connection error, not a bug): the client may retry."""
    log.warning("the gateway cannot reach its %s: %s: %s", part, type(exc).__name__, exc)
    return ApiError(503, f"The platform cannot reach its {part} right now; retry shortly.",
                    code="service_unavailable", headers={"Retry-After": "2"})


def ended_badly(event: dict, *, cancelled: bool) -> ApiError | None:
    """The error a finished request reports instead of a normal end: its engine failed, or it was
    aborted by something other than this client (its worker stopped serving the model)."""
    reason = event.get("finish_reason")
    if reason == "error":
        return ApiError(500, f"The model failed while generating: {event.get('error') or 'engine error'}.",
                        code="engine_error")
    if reason == "abort" and not cancelled:
        return ApiError(503, "The request was interrupted before it finished (its worker stopped serving "
                             "the model); retry.", code="interrupted")
    return None


# A worker's events after which the request no longer waits: its first token, its end.
NO_LONGER_WAITING = frozenset({"inference.delta", "inference.finished", "inference.error"})


@dataclass
class Call:
    """A dispatched request: ``start()`` waits until a worker has taken it, ``events()`` relays the rest."""

    caller: Caller
    request: InferenceRequest
    spec: dict
    request_id: str
    reply_channel: str
    headers: dict  # the rate-limit headers every response carries
    stages: Stages
    created: int = field(default_factory=lambda: int(time.time()))
    admitted_at: float = field(default_factory=time.time)  # usage's timings count from here
    prompt_tokens: int = 0
    done: bool = False  # the worker's last event arrived
    cancelled: bool = False
    tokens_used: int = 0
    finished: dict | None = None  # the worker's last event, once it finished (its usage is what billing records)
    completion_seen: int = 0  # tokens relayed so far
    tokens_counted: bool = False  # against the token rate limits: once per request (a batch's: never)
    queue_timeout: float | None = None  # longer while a scaled-to-zero deployment cold-starts
    cold_start: bool = False  # no replica was ready: the wait for a worker is the model's load
    prices: dict | None = None  # the route's at admission, for billing (None: the catalog's when billed)
    billing_id: str | None = None  # what billing records it under (None: ``request_id``)
    waiting: bool = True  # among its deployment's waiting requests (``ratelimit.leave_queue``)
    endpoint: str = ""  # the API it came through, for usage reports
    pulse: str | None = None  # this process's pulse key (``gateway.pulse``); None: a batch runner's
    fingerprint: str | None = None  # the engine's configuration (``system_fingerprint``), once started

    def payload(self) -> dict:
        """The task's argument: what the worker runs, and where to send the events."""
        return {
            **self.request.payload(),
            "request_id": self.request_id,
            "reply_channel": self.reply_channel,
            "deployment": self.spec,
            "organization_id": self.caller.org_id,
            "api_key_id": self.caller.api_key.pk if self.caller.api_key is not None else None,
            "user": self.request.user,
            "prices": self.prices,
            # Billing is idempotent by this id: a batch line run again (its runner died) is its own
            # request, yet one charge.
            "billing_id": self.billing_id or self.request_id,
            "endpoint": self.endpoint,
            "admitted_at": self.admitted_at,
            # A client that does not stream sees nothing until the end: a copy redelivered after
            # its worker died may then run again from the start (``inference.restarted``).
            "stream": self.request.stream,
            # Its worker cancels it if this process dies (a batch runner's line is run again).
            "gateway_pulse": self.pulse,
        }

    async def _receive(self, timeout: float) -> dict:
        try:
            async with asyncio.timeout(timeout):  # not wait_for: no task per token
                event = await get_channel_layer().receive(self.reply_channel)
        except REDIS_FAILURES as exc:  # the layer already tried a fresh connection: Redis is down
            await self.cancel(void=True)  # the worker must not generate (and bill) for nobody
            raise unavailable(exc) from None
        if self.waiting and event["type"] in NO_LONGER_WAITING:
            await self._leave_queue()
        return event

    async def _leave_queue(self) -> None:
        self.waiting = False
        try:
            await ratelimit.leave_queue(dispatch.waiting_key(self.spec["name"]), self.request_id)
        except REDIS_FAILURES as exc:  # it leaves by itself after the longest wait
            log.warning("%s still counts among the waiting requests: %s", self.request_id, exc)

    async def start(self) -> None:
        """Wait for a worker to accept and the engine to admit the request; raise ApiError if not."""
        event = await self._wait_in_queue()
        if self.cold_start:  # the wait was the model's load: the same stages, in the same order
            self.stages.durations.setdefault("queue", 0.0)
            self.stages.mark("load")
        else:
            self.stages.mark("queue")
        if event["type"] == "inference.accepted":  # the worker has to load the model first
            try:
                event = await self._receive(settings.GATEWAY_START_TIMEOUT)
            except asyncio.TimeoutError:
                await self.cancel(void=True)
                raise ApiError(504, "The model did not start the request in time.", code="timeout") from None
        if event["type"] == "inference.error":
            self.done = True
            raise ApiError(event["status"], event["message"], param=event.get("param"), code=event.get("code"))
        self.prompt_tokens = event["prompt_tokens"]
        self.fingerprint = event.get("fingerprint")  # None from a worker older than fingerprints
        self.stages.mark("load")  # after "queue": zero unless the worker had to load the model

    async def events(self):
        """Yield ``inference.delta`` events, then the ``inference.finished`` one; and, for a client
        that does not stream, ``inference.restarted`` if its worker died and a copy starts over."""
        while True:
            try:
                event = await self._receive(settings.GATEWAY_STALL_TIMEOUT)
            except asyncio.TimeoutError:
                await self.cancel(void=True)
                stalled = f"no progress for {settings.GATEWAY_STALL_TIMEOUT:g} s"
                raise ApiError(504, f"The model stopped producing tokens ({stalled}).", code="timeout") from None
            if event["type"] == "inference.progress":  # a long prompt, computed chunk by chunk: not stalled
                continue
            if event["type"] == "inference.error":
                self.done = True
                raise ApiError(event["status"], event["message"], param=event.get("param"), code=event.get("code"))
            if event["type"] == "inference.delta":
                self.completion_seen += len(event.get("token_ids") or ())
            elif event["type"] == "inference.restarted":  # a redelivered copy: what came before is void
                self.completion_seen = 0
            elif event["type"] == "inference.finished":
                self.done = True
                self.finished = event
                usage = event["usage"]
                self.tokens_used = usage["prompt_tokens"] + usage["completion_tokens"]
                await self._count_tokens(self.tokens_used)
                failure = ended_badly(event, cancelled=self.cancelled)
                if failure is not None:
                    raise failure
            yield event
            if self.done:
                return

    async def _wait_in_queue(self) -> dict:
        """The first event of a worker that took the request. After its first wait (the queue
        timeout, or a cold start's), it waits on for busy replicas while a live worker hosts the
        deployment (``dispatch.serving_key``), checked every GATEWAY_QUEUE_TIMEOUT, up to
        GATEWAY_STALL_TIMEOUT more; with none, 503 at once."""
        name = self.spec["name"]
        loop = asyncio.get_running_loop()
        wait, deadline = self.queue_timeout or settings.GATEWAY_QUEUE_TIMEOUT, None
        while True:
            try:
                return await self._receive(wait)
            except asyncio.TimeoutError:
                pass
            now = loop.time()
            if deadline is not None and now >= deadline:
                await self.cancel(void=True)
                raise ApiError(503, f"'{name}' is busy: this request waited too long for a replica; try again "
                                    "shortly.", code="model_overloaded", expected=True) from None
            try:
                served = await dispatch.served(ratelimit.client(), name)
            except REDIS_FAILURES as exc:
                await self.cancel(void=True)
                raise unavailable(exc) from None
            if not served:
                await self.cancel(void=True)
                why = await self._status_reason() or "none is running it right now"
                raise ApiError(503, f"No worker took this request for '{name}': {why}; try again shortly.",
                               code="model_unavailable") from None
            deadline = deadline or now + settings.GATEWAY_STALL_TIMEOUT
            wait = max(0.01, min(settings.GATEWAY_QUEUE_TIMEOUT, deadline - now))

    async def _status_reason(self) -> str:
        """What the placement loop says of the deployment (e.g. that it waits for a free slot), or
        "" when it cannot be read: a 503 should say why nobody took the request."""
        from models_catalog.selectors import status_reason

        if self.spec.get("id") is None:
            return ""
        try:
            return await admission.run(lambda: status_reason(deployment_id=self.spec["id"]))
        except (DatabaseOperationalError, DatabaseInterfaceError) as exc:
            log.warning("could not read why %s has no worker: %s", self.spec["name"], exc)
            return ""

    async def cancel(self, *, void: bool = False) -> None:
        """Abort the request wherever it is (queued or running). The client's cancel bills what the
        worker produced; a ``void`` one is the gateway giving up (a timeout, Redis failing) with an
        error the client may retry, so a client that does not stream pays nothing for it. A cancel
        Redis refuses is tried again in the background until it goes through or no longer matters."""
        if self.waiting:
            await self._leave_queue()
        if not self.done and not self.cancelled:
            self.cancelled = True  # before the publish: the abort it causes may come back first
            if not await _send_cancel(self.request_id, void=void):
                _cancel_later(self.request_id, void=void)
            # A client that leaves before the end still spent what it got: leaving just before the
            # last token must not dodge the token limits. (One that cancels and reads on is
            # counted here too, a few tokens short.)
            await self._count_tokens(self.prompt_tokens + self.completion_seen)

    async def _count_tokens(self, tokens: int) -> None:
        if self.tokens_counted or tokens <= 0:
            return
        self.tokens_counted = True
        try:
            await ratelimit.record_tokens(key_id=self.caller.key_id, org_id=self.caller.org_id,
                                          request_id=self.request_id, tokens=tokens)
        except REDIS_FAILURES as exc:  # the answer is what matters: deliver it, uncounted
            log.warning("tokens of %s not counted against rate limits: %s", self.request_id, exc)


async def _send_cancel(request_id: str, *, void: bool = False) -> bool:
    """Abort ``request_id`` wherever it is; False (logged) when Redis is failing. Its client's
    pool checks a connection before handing it out, so that a request given up on with a 503 right
    after a Redis restart is still cancelled (and does not run, and get billed, anyway)."""
    try:
        await dispatch.cancel(ratelimit.client(), request_id, void=void)
    except REDIS_FAILURES as exc:
        log.warning("could not cancel %s yet: %s", request_id, exc)
        return False
    return True


CANCEL_RETRY_S = 1.0
_retrying: set[asyncio.Task] = set()  # the loop keeps only weak references to its tasks


def _cancel_later(request_id: str, *, void: bool) -> None:
    """Send a cancel Redis refused once it is back (every CANCEL_RETRY_S, for as long as a worker
    may still run the request): else a worker that outlived the outage runs it to its end."""
    async def retry():
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.GATEWAY_STALL_TIMEOUT
        while loop.time() < deadline:
            await asyncio.sleep(CANCEL_RETRY_S)
            if await _send_cancel(request_id, void=void):
                log.info("cancelled %s once Redis was back", request_id)
                return
        log.warning("gave up cancelling %s: Redis stayed down", request_id)

    task = asyncio.get_running_loop().create_task(retry())
    _retrying.add(task)
    task.add_done_callback(_retrying.discard)


ID_PREFIXES = {"chat": "chatcmpl-", "completion": "cmpl-", "response": "resp_", "embedding": "embd-"}
ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "response": "/v1/responses",
             "embedding": "/v1/embeddings"}
BATCH_ENDPOINT = "/v1/batches"


def new_request_id(kind: str) -> str:
    return f"{ID_PREFIXES[kind]}{uuid.uuid4().hex}"


def _open(identify: Callable[[], tuple[Caller, InferenceRequest]], endpoint: str, request_id: str,
          reply_channel: str, stages: Stages, batch: BatchLine | None, pulse: str | None = None) -> Call:
    """Admit and dispatch, blocking (one trip to a thread). Refusals come in the order clients see
    them: the key and the body (``identify``), the model (404; 503 when it is stopped), a max_tokens beyond its context, credit and spend limits (429
    insufficient_quota), a full deployment queue (429 queue_full), then rate limits (429), which
    count the request only once it passed the rest."""
    with read_cache.pinned():  # the key and the deployment, read at one generation
        caller, request = identify()
        spec, ready, stopped, queue_limit, context_length, prices = _deployment_spec(caller, request.model)
    if stopped:  # refused at once: waiting, or a full queue's "retry shortly", would mislead
        from models_catalog.selectors import status_reason

        why = status_reason(deployment_id=spec["id"]).rstrip(".")  # its owner's, or billing's ("cannot pay")
        detail = f" ({why})" if why else ""
        raise ApiError(503, f"The deployment '{spec['name']}' is stopped{detail}; start it to send it requests.",
                       code="model_unavailable", expected=True)
    _check_max_tokens(request, context_length)
    _check_quota(caller)
    decision = _admit(caller, spec, queue_limit, request_id, batch=batch is not None)
    stages.mark("admit")
    call = Call(caller=caller, request=request, spec=spec, request_id=request_id, reply_channel=reply_channel,
                headers={**decision.headers, "x-request-id": request_id}, stages=stages, prices=prices,
                endpoint=endpoint, pulse=pulse)
    if batch is not None:
        call.prices, call.billing_id = _scaled(prices, batch.price_factor), batch.billing_id
        call.tokens_counted = True  # outside the caller's limits
    dispatch.enqueue(call.payload())
    # A deployment with no ready replica: have the fleet load it, and wait as long as that takes.
    call.queue_timeout = float(settings.GATEWAY_QUEUE_TIMEOUT) if ready else capacity.wake(spec)
    call.cold_start = not ready
    stages.mark("dispatch")
    return call


def _scaled(prices: dict, factor: Decimal) -> dict:
    """The route's prices (Decimal strings) times ``factor`` (a batch's discount)."""
    step = Decimal(1).scaleb(-PRICE_DECIMAL_PLACES)  # as fine as a usage record keeps a price
    return Prices(**{name: (Decimal(value) * factor).quantize(step) for name, value in prices.items()}).as_strings()


class BatchLine(NamedTuple):
    """A Batch API request: billed at ``price_factor`` of the prices, under its line's id (each run
    of the line is a new request, charged once), and admitted outside the caller's per-minute
    limits (a batch must not starve the API's requests of its key, nor they the batch) while its
    deployment's queue is below BATCH_QUEUE_PERCENT of its limit."""

    price_factor: Decimal
    billing_id: str


async def _begin(kind: str, identify: Callable[[], tuple[Caller, InferenceRequest]],
                 stages: Stages, batch: BatchLine | None = None,
                 endpoint: str | None = None) -> tuple[Call, InferenceRequest, dict]:
    request_id = new_request_id(kind)
    reply_channel = await get_channel_layer().new_channel()  # a name only: no I/O
    try:
        try:
            endpoint = BATCH_ENDPOINT if batch is not None else endpoint or ENDPOINTS[kind]
            pulse = None if batch is not None else await gateway_pulse.keep(reply_channel)
            call = await admission.run(_open, identify, endpoint, request_id, reply_channel, stages, batch, pulse)
        except REDIS_FAILURES as exc:
            raise unavailable(exc) from None
        except (DatabaseOperationalError, DatabaseInterfaceError) as exc:
            raise unavailable(exc, part="database") from None
    except ApiError as exc:  # refused: the id still names the request (in logs, in a support ticket)
        exc.headers = {**exc.headers, "x-request-id": request_id}
        raise
    except asyncio.CancelledError:  # the client left; the thread may still dispatch: abort it there
        await asyncio.shield(_send_cancel(request_id))
        raise
    try:
        await call.start()
    except ApiError as exc:
        exc.headers = {**call.headers, **exc.headers}
        raise
    except asyncio.CancelledError:
        await asyncio.shield(call.cancel())
        raise
    return call, call.request, {**call.headers, "server-timing": stages.header()}


async def begin(request: InferenceRequest, *, caller: Callable[[], Caller],
                batch: BatchLine | None = None, endpoint: str | None = None) -> tuple[Call, dict]:
    """Admit, dispatch and start a parsed request (the WebSocket API, batches); ``caller()`` says who
    calls, on the admission thread (raising ApiError to refuse); ``batch``: a Batch API request's
    line; ``endpoint``: the API it came through (for usage reports; the request's own by
    default). Returns the call and the response headers (rate limits and the ``Server-Timing`` of
    the stages so far)."""
    call, _, headers = await _begin(request.kind, lambda: (caller(), request), Stages(), batch, endpoint)
    return call, headers


async def begin_http(header, read_request: Callable[[Caller], InferenceRequest], *,
                     kind: str) -> tuple[Call, InferenceRequest, dict]:
    """:func:`begin` for an HTTP request: the key in ``header`` is checked first (401/403), then the
    body is read by ``read_request(caller)`` (400/413), in the same trip to an admission thread."""
    stages = Stages()

    def identify():
        caller = authenticate_sync(header)
        stages.mark("auth")
        return caller, read_request(caller)

    return await _begin(kind, identify, stages)
