"""The WebSocket API at ``/v1/ws``: the HTTP API's JSON bodies in, the same stream chunks out.

Client frames:
    {"request_id": "r1", "endpoint": "chat.completions" | "completions", ...the HTTP body...}
    {"type": "cancel", "request_id": "r1"}
Server frames: each OpenAI chunk with the client's ``request_id`` added, then
``{"type": "done", "request_id": ...}``; or ``{"type": "error", "request_id": ..., "error": {...}}``.
A request cancelled before it started ends with ``{"type": "done", "request_id": ..., "cancelled": true}``.
Several requests can run at once on one connection. Closing the socket aborts them all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from accounts.middleware import scope_header
from inference_platform import jsonbody

from . import calls, formatting
from .errors import ApiError
from .protocol import parse_chat, parse_completion
from .answers import stream_chunks
from .views import INTERNAL_ERROR

log = logging.getLogger(__name__)
PARSERS = {"chat.completions": parse_chat, "completions": parse_completion}
MAX_REQUEST_ID = 200
WEBSOCKET_ENDPOINT = "/v1/ws"  # what usage reports name the requests of a socket (the playground's too)


def _request_id(message: dict) -> str | int | ApiError:
    """The client's id for a request (a string or an integer, sent back as it came), or a new one."""
    value = message.pop("request_id", None)
    if value is None or value == "":
        return uuid.uuid4().hex
    if isinstance(value, bool) or not isinstance(value, (str, int)) or len(str(value)) > MAX_REQUEST_ID:
        return ApiError(400, f"request_id must be a string of at most {MAX_REQUEST_ID} characters",
                        param="request_id", code="invalid_value")
    return value


class InferenceConsumer(AsyncWebsocketConsumer):
    gone = False  # the client closed the connection: frames for it are dropped

    async def connect(self):
        self.running: dict[str, tuple[asyncio.Task, list]] = {}  # by str(request_id): 7 and "7" are one
        await self.accept()
        error = self._auth_error()
        if error:
            await self._send(error.body() | {"type": "error", "request_id": None})
            await self.close(code=4000 + error.status)
            return
        user = self.scope.get("user")
        self.caller = calls.Caller(api_key=self.scope["api_key"], organization=self.scope["organization"],
                                   user_id=getattr(user, "pk", None),
                                   session_key=getattr(self.scope.get("session"), "session_key", None))

    def _auth_error(self) -> ApiError | None:
        scope = self.scope
        if scope.get("auth_error") or scope.get("organization") is None:
            return ApiError(scope.get("auth_status", 401), scope.get("auth_error") or "Authentication required.",
                            code=scope.get("auth_code", "invalid_api_key"))
        api_key = self.scope.get("api_key")
        if api_key is not None and not api_key.has_scope("inference"):
            return ApiError(403, "This API key is missing the 'inference' scope.", code="missing_scope")
        return None

    def _current_caller(self) -> calls.Caller:
        """The caller, checked again for every request (on an admission thread): a key revoked or
        expired, or a member removed, while the socket stays open is refused from its next request."""
        if self.caller.api_key is not None:
            return calls.authenticate_sync(scope_header(self.scope, b"authorization"))
        return calls.session_caller(self.caller)

    async def receive(self, text_data=None, bytes_data=None):
        frame = text_data.encode("utf-8", "surrogatepass") if text_data is not None else bytes_data
        if len(frame) > settings.GATEWAY_MAX_BODY_BYTES:  # as an HTTP body of that size would be
            return await self._error(None, ApiError(
                413, f"The frame is larger than {settings.GATEWAY_MAX_BODY_BYTES} bytes.", code="request_too_large"))
        try:
            message = jsonbody.loads(frame)
        except (TypeError, ValueError):
            return await self._error(None, ApiError(400, "Frames must be JSON objects.", code="invalid_json"))
        if not isinstance(message, dict):
            return await self._error(None, ApiError(400, "Frames must be JSON objects.", code="invalid_json"))
        request_id = _request_id(message)
        if isinstance(request_id, ApiError):
            return await self._error(None, request_id)
        kind = message.pop("type", None)
        if kind == "cancel":
            return await self._cancel(request_id)
        if kind is not None:
            return await self._error(request_id, ApiError(
                400, "type must be \"cancel\", or left out for a request.", param="type", code="invalid_value"))
        message["stream"] = True  # a WebSocket always streams
        endpoint = message.pop("endpoint", "chat.completions")
        if not isinstance(endpoint, str) or endpoint not in PARSERS:
            return await self._error(request_id, ApiError(400, "endpoint must be chat.completions or completions",
                                                          param="endpoint", code="invalid_value"))
        if str(request_id) in self.running:
            return await self._error(request_id, ApiError(400, "request_id is already running", param="request_id",
                                                          code="duplicate_request_id"))
        try:
            inference = PARSERS[endpoint](message)
        except ApiError as exc:
            return await self._error(request_id, exc)
        holder: list = []  # the Call, once dispatched
        task = asyncio.create_task(self._run(request_id, inference, holder))
        self.running[str(request_id)] = (task, holder)

    async def _run(self, request_id: str | int, inference, holder: list):
        call = None
        try:
            call, _ = await calls.begin(inference, caller=self._current_caller, endpoint=WEBSOCKET_ENDPOINT)
            holder.append(call)
            ctx = formatting.Context(kind=inference.kind, id=call.request_id, created=call.created, model=inference.model,
                                     fingerprint=call.fingerprint)
            async for chunk in stream_chunks(call, ctx, inference.include_usage):
                if not await self._send({**chunk, "request_id": request_id}):
                    return  # the client is gone: the request is cancelled below
            await self._send({"type": "done", "request_id": request_id})
        except ApiError as exc:
            await self._error(request_id, exc)
        except Exception:  # a bug: answer this request, keep the connection and the others
            log.exception("WebSocket request %s failed", request_id)
            await self._error(request_id, INTERNAL_ERROR)
        finally:
            if call is not None:
                await asyncio.shield(call.cancel())
            self.running.pop(str(request_id), None)

    async def _cancel(self, request_id: str | int):
        entry = self.running.get(str(request_id))
        if entry is None:
            return await self._error(request_id, ApiError(404, "No running request with that request_id.",
                                                          param="request_id", code="request_not_found"))
        task, holder = entry
        if holder:
            await holder[0].cancel()  # the stream then ends with finish_reason "stop" and usage
        else:
            task.cancel()  # still being admitted: nothing ran, nothing is billed
            await self._send({"type": "done", "request_id": request_id, "cancelled": True})

    async def disconnect(self, code):
        self.gone = True
        for task, holder in list(getattr(self, "running", {}).values()):
            if holder:
                await holder[0].cancel()
            task.cancel()

    async def _error(self, request_id, exc: ApiError):
        await self._send({"type": "error", "request_id": request_id, **exc.body()})

    async def _send(self, frame: dict) -> bool:
        """Send a frame; False once the client is gone (then nothing more reaches it)."""
        text = json.dumps(frame, ensure_ascii=False)
        if self.gone:
            return False
        try:
            await self.send(text_data=text)
        except (OSError, RuntimeError):  # closed: the server's ClientDisconnected, or a send after the close
            self.gone = True
            return False
        return True
