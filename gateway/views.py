"""The OpenAI-compatible HTTP API. Thin: parse, call ``gateway.calls``, render with
``gateway.formatting``. Async, so that a stream holds no thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from inference_platform import jsonbody

from . import admission, answers, calls, formatting, pages, response_events, selectors, services
from .errors import ApiError, invalid
from .event_stream import EventStream
from .protocol import MAX_MODEL_NAME, parse_chat, parse_completion, parse_embedding
from .responses import parse_response_request, renamed

log = logging.getLogger(__name__)
INTERNAL_ERROR = ApiError(500, "The server failed while streaming this response; it is logged.", code="internal_error")


def read_json(request) -> object:
    length = request.headers.get("Content-Length")
    if length and length.isdigit() and int(length) > settings.GATEWAY_MAX_BODY_BYTES:
        raise ApiError(413, f"The request body is larger than {settings.GATEWAY_MAX_BODY_BYTES} bytes.",
                       code="request_too_large")
    try:
        body = request.body
    except RequestDataTooBig:
        body = b"x" * (settings.GATEWAY_MAX_BODY_BYTES + 1)
    if len(body) > settings.GATEWAY_MAX_BODY_BYTES:
        raise ApiError(413, f"The request body is larger than {settings.GATEWAY_MAX_BODY_BYTES} bytes.",
                       code="request_too_large")
    try:
        return jsonbody.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "The request body is not valid JSON.", code="invalid_json") from None


def _with_headers(response, headers: dict):
    for name, value in headers.items():
        response[name] = value
    return response


async def _inference(request, parse, kind: str):
    if request.method != "POST":
        return ApiError(405, f"Use POST for {request.path}.", code="method_not_allowed").response()
    try:
        call, inference, headers = await calls.begin_http(
            request.headers.get("Authorization"), lambda caller: parse(read_json(request)), kind=kind)
    except ApiError as exc:
        return exc.response()
    ctx = formatting.Context(kind=inference.kind, id=call.request_id, created=call.created, model=inference.model,
                             fingerprint=call.fingerprint)
    if inference.stream:
        return _event_stream(_sse(call, ctx, inference.include_usage), headers)
    return await _whole(call, answers.collect(call, ctx), headers)


def _event_stream(events, headers: dict) -> StreamingHttpResponse:
    response = StreamingHttpResponse(EventStream(events), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return _with_headers(response, headers)


async def _whole(call: calls.Call, body, headers: dict):
    """The JSON response of a call whose client does not stream, once ``body`` has it."""
    try:
        body = await body
    except ApiError as exc:
        return _with_headers(exc.response(), headers)
    except asyncio.CancelledError:  # the client went away: stop generating
        await call.cancel()
        raise
    if call.request.kind == "embedding":  # up to 2048 vectors: written off the loop every stream shares
        content = await asyncio.to_thread(lambda: json.dumps(body).encode())
        return _with_headers(HttpResponse(content, content_type="application/json"), headers)
    return _with_headers(JsonResponse(body), headers)


async def _sse(call: calls.Call, ctx: formatting.Context, include_usage: bool):
    try:
        async for chunk in answers.stream_chunks(call, ctx, include_usage):
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    except ApiError as exc:  # after the first byte the status is sent: report in-band
        yield f"data: {json.dumps(exc.body())}\n\n"
    except Exception:  # a bug: the client still gets an end it can parse, the log the traceback
        log.exception("streaming %s failed", call.request_id)
        yield f"data: {json.dumps(INTERNAL_ERROR.body())}\n\n"
    finally:  # normal end, error, or the client disconnected (CancelledError / GeneratorExit)
        await asyncio.shield(call.cancel())


@csrf_exempt
async def responses(request):
    """OpenAI's Responses API, on the chat path (``gateway.responses``); a response is stored
    unless it asks not to be (``gateway.services``)."""
    if request.method != "POST":
        return ApiError(405, f"Use POST for {request.path}.", code="method_not_allowed").response()
    parsed = []  # the parsed request, once read: its errors name the input items its messages came from

    def read(caller: calls.Caller):
        parsed.append(parse_response_request(
            read_json(request), can_store=settings.RESPONSES_RETENTION_DAYS > 0,
            history=lambda rid: selectors.conversation_after(organization_id=caller.org_id, response_id=rid)))
        return parsed[0].inference

    try:
        call, inference, headers = await calls.begin_http(request.headers.get("Authorization"), read, kind="response")
    except ApiError as exc:  # one the worker raised names chat's messages: name the input items
        return renamed(exc, parsed[0].inference.extra["origins"]).response() if parsed else exc.response()
    asked = parsed[0]

    def new_builder():
        return response_events.ResponseBuilder(response_id=call.request_id, created=call.created,
                                               model=inference.model, sampling=inference.sampling,
                                               settings=asked.settings)

    async def keep(response: dict) -> bool:
        try:
            await admission.run(lambda: services.store_response(
                organization_id=call.caller.org_id, response=response, conversation=asked.conversation))
        except Exception:  # the answer still goes out, saying it was not stored
            log.exception("could not store response %s", call.request_id)
            return False
        return True

    if inference.stream:
        return _event_stream(_response_sse(call, new_builder(), keep), headers)
    return await _whole(call, response_events.collect(call, new_builder, keep), headers)


async def _response_sse(call: calls.Call, builder: response_events.ResponseBuilder, keep):
    def frame(event: dict) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    try:  # closed here, not when collected: a client that leaves has what it was given kept at once
        async with contextlib.aclosing(response_events.stream(call, builder, keep)) as events:
            async for event in events:
                yield frame(event)
    except Exception:  # a bug even in failing the response: the client still gets an end it can parse
        log.exception("streaming %s failed", call.request_id)
        yield frame(builder.error(INTERNAL_ERROR))
    finally:
        await asyncio.shield(call.cancel())


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id[:80]}' not found.", code="response_not_found")


def _read_response(header, response_id: str, query) -> dict:
    caller = calls.authenticate_sync(header)
    if query.get("stream", "false") != "false":
        raise invalid("stream", "A stored response is read whole: streaming it again is not supported.",
                      code="unsupported_value")
    found = selectors.stored_response(organization_id=caller.org_id, response_id=response_id)
    if found is None:
        raise _not_found(response_id)
    return found


def _delete_response(header, response_id: str, query) -> dict:
    caller = calls.authenticate_sync(header)
    if not services.delete_response(organization_id=caller.org_id, response_id=response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@csrf_exempt
async def response_detail(request, response_id: str):
    """``GET`` a stored response, or ``DELETE`` it."""
    if request.method == "DELETE":
        work = _delete_response
    elif request.method in ("GET", "HEAD"):
        work = _read_response
    else:
        return ApiError(405, f"Use GET or DELETE for {request.path}.", code="method_not_allowed").response()
    try:
        return JsonResponse(await admission.run(work, request.headers.get("Authorization"), response_id, request.GET))
    except ApiError as exc:
        return exc.response()


def _input_items(header, response_id: str, query) -> dict:
    caller = calls.authenticate_sync(header)
    page = pages.parse(query)
    items = selectors.input_items(organization_id=caller.org_id, response_id=response_id)
    if items is None:
        raise _not_found(response_id)
    return pages.page(items, page)


async def response_input_items(request, response_id: str):
    """The input items a stored response answered, a page at a time (OpenAI's list shape)."""
    if refusal := _get_only(request):
        return refusal.response()
    try:
        return JsonResponse(await admission.run(_input_items, request.headers.get("Authorization"), response_id,
                                                request.GET))
    except ApiError as exc:
        return exc.response()


@csrf_exempt
async def chat_completions(request):
    return await _inference(request, parse_chat, "chat")


@csrf_exempt
async def completions(request):
    return await _inference(request, parse_completion, "completion")


@csrf_exempt
async def embeddings(request):
    return await _inference(request, parse_embedding, "embedding")


def _model_json(deployment) -> dict:
    return {
        "id": deployment.name,
        "object": "model",
        "created": int(deployment.created_at.timestamp()),
        "owned_by": deployment.organization.slug if deployment.organization_id else "system",
    }


def _list_models(header) -> dict:
    from models_catalog.selectors import deployments_visible_to

    caller = calls.authenticate_sync(header, scope=None)
    return {"object": "list", "data": [_model_json(d) for d in deployments_visible_to(organization=caller.organization)]}


def _get_model(header, name: str) -> dict:
    from models_catalog.errors import DeploymentNotFound
    from models_catalog.selectors import resolve_deployment

    caller = calls.authenticate_sync(header, scope=None)
    try:
        if len(name) > MAX_MODEL_NAME or not name.isprintable():
            raise DeploymentNotFound(name[:MAX_MODEL_NAME])
        return _model_json(resolve_deployment(organization=caller.organization, name=name))
    except DeploymentNotFound as exc:
        raise ApiError(404, exc.message, param="model", code="model_not_found") from None


def _get_only(request) -> ApiError | None:
    if request.method not in ("GET", "HEAD"):
        return ApiError(405, f"Use GET for {request.path}.", code="method_not_allowed")
    return None


async def models(request):
    if refusal := _get_only(request):
        return refusal.response()
    try:
        return JsonResponse(await admission.run(_list_models, request.headers.get("Authorization")))
    except ApiError as exc:
        return exc.response()


async def model_detail(request, name: str):
    if refusal := _get_only(request):
        return refusal.response()
    try:
        return JsonResponse(await admission.run(_get_model, request.headers.get("Authorization"), name))
    except ApiError as exc:
        return exc.response()


@csrf_exempt
async def unknown_endpoint(request, rest: str = ""):
    """Any other path under /v1/: a JSON 404 an API client can read (not the site's HTML page)."""
    return ApiError(404, f"Invalid URL ({request.method} {request.path}).", code="unknown_url").response()
