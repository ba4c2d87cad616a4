"""One inference call through the platform, shared by the HTTP views and the WebSocket consumer:
authenticate, admit (quota, rate limits), dispatch to the deployment's queue, and relay the
worker's events back.

Every refusal before dispatch raises ``ApiError``; nothing refused is billed, because only a
worker that ran the request emits usage.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from workers import capacity, dispatch

from . import ratelimit
from .errors import ApiError
from .protocol import InferenceRequest


@dataclass
class Caller:
    """Who is calling: an API key, or a dashboard user (the playground) with no key."""

    api_key: object
    organization: object
    user_id: int | None = None

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


authenticate = sync_to_async(authenticate_sync)


def _resolve(caller: Caller, model: str) -> dict:
    from billing.errors import QuotaExceeded
    from billing.services import check_quota
    from models_catalog.errors import DeploymentNotFound
    from models_catalog.selectors import resolve_deployment

    try:
        deployment = resolve_deployment(organization=caller.organization, name=model)
    except DeploymentNotFound as exc:
        raise ApiError(404, exc.message, param="model", code="model_not_found") from None
    try:
        check_quota(organization=caller.organization, api_key=caller.api_key)
    except QuotaExceeded as exc:
        raise ApiError(429, exc.message, code=exc.code, type=exc.type) from None
    return dispatch.engine_spec(deployment)


resolve = sync_to_async(_resolve)


@dataclass
class Call:
    """A dispatched request: ``start()`` waits until a worker has taken it, ``events()`` relays the rest."""

    caller: Caller
    request: InferenceRequest
    spec: dict
    request_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    reply_channel: str = ""
    prompt_tokens: int = 0
    done: bool = False  # the worker's last event arrived
    cancelled: bool = False
    tokens_used: int = 0
    queue_timeout: float | None = None  # longer while a scaled-to-zero deployment cold-starts

    async def dispatch(self) -> None:
        layer = get_channel_layer()
        self.reply_channel = await layer.new_channel()
        payload = {
            **self.request.payload(),
            "request_id": self.request_id,
            "reply_channel": self.reply_channel,
            "deployment": self.spec,
            "organization_id": self.caller.org_id,
            "api_key_id": self.caller.api_key.pk if self.caller.api_key is not None else None,
            "user": self.request.user,
        }
        await sync_to_async(dispatch.enqueue, thread_sensitive=False)(payload)
        self.queue_timeout = await sync_to_async(capacity.wake)(self.spec)

    async def _receive(self, timeout: float) -> dict:
        return await asyncio.wait_for(get_channel_layer().receive(self.reply_channel), timeout)

    async def start(self) -> None:
        """Wait for a worker to accept and the engine to admit the request; raise ApiError if not."""
        try:
            event = await self._receive(self.queue_timeout or settings.GATEWAY_QUEUE_TIMEOUT)
        except asyncio.TimeoutError:
            await self.cancel()
            raise ApiError(503, f"No worker is serving '{self.spec['name']}' right now; try again shortly.",
                           code="model_unavailable") from None
        if event["type"] == "inference.accepted":
            try:
                event = await self._receive(settings.GATEWAY_START_TIMEOUT)
            except asyncio.TimeoutError:
                await self.cancel()
                raise ApiError(504, "The model did not start the request in time.", code="timeout") from None
        if event["type"] == "inference.error":
            self.done = True
            raise ApiError(event["status"], event["message"], param=event.get("param"), code=event.get("code"))
        self.prompt_tokens = event["prompt_tokens"]

    async def events(self):
        """Yield ``inference.delta`` events, then the ``inference.finished`` one."""
        while True:
            try:
                event = await self._receive(settings.GATEWAY_STALL_TIMEOUT)
            except asyncio.TimeoutError:
                await self.cancel()
                raise ApiError(504, "The model stopped producing tokens.", code="timeout") from None
            if event["type"] == "inference.error":
                self.done = True
                raise ApiError(event["status"], event["message"], param=event.get("param"), code=event.get("code"))
            if event["type"] == "inference.finished":
                self.done = True
                usage = event["usage"]
                self.tokens_used = usage["prompt_tokens"] + usage["completion_tokens"]
                await ratelimit.record_tokens(key_id=self.caller.key_id, org_id=self.caller.org_id,
                                              request_id=self.request_id, tokens=self.tokens_used)
            yield event
            if self.done:
                return

    async def cancel(self) -> None:
        """Abort the request wherever it is (queued or running); the worker bills what it produced."""
        if not self.done and not self.cancelled:
            self.cancelled = True
            await dispatch.cancel(ratelimit.client(), self.request_id)


def new_request_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


async def begin(caller: Caller, request: InferenceRequest) -> tuple[Call, dict]:
    """Admit and dispatch a request; returns the started call and the rate-limit headers."""
    spec = await resolve(caller, request.model)
    request_id = new_request_id(request.kind)
    decision = await ratelimit.admit(key_id=caller.key_id, org_id=caller.org_id, request_id=request_id)
    if not decision.allowed:
        raise ApiError(429, "Rate limit reached for requests or tokens per minute; retry after the reset.",
                       code="rate_limit_exceeded", headers=decision.headers)
    call = Call(caller=caller, request=request, spec=spec, request_id=request_id)
    await call.dispatch()
    try:
        await call.start()
    except ApiError as exc:
        exc.headers = {**decision.headers, **exc.headers}
        raise
    return call, decision.headers
