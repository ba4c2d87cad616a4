"""A Responses API reply, built from a call's worker events: the stream of typed events
(``response.created``, ``response.output_text.delta``, ``response.function_call_arguments.delta``,
..., ``response.completed``), whose last one holds the whole response, which is also what a client
that does not stream gets. A response that fails once started (``response.failed``, or the error's
status for a client that does not stream) is stored as ``failed`` with its error and what it wrote,
and one whose client leaves as ``cancelled``, with what the model wrote until it stopped.

The reply's text is read as chat reads it (``tools.ToolCallStream``): text goes into a message
item, each call into a function_call item, in the order the model wrote them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from . import calls, formatting, tools
from .errors import ApiError, unexpected_error
from .responses import new_id as _id

log = logging.getLogger(__name__)


def usage_json(usage: dict) -> dict:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": usage.get("cached_prompt_tokens", 0),
                                                             "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


class ResponseBuilder:
    """Turns a call's events into Responses events; ``response`` is the response so far."""

    def __init__(self, *, response_id: str, created: int, model: str, sampling: dict, settings: dict) -> None:
        self.response = {
            "id": response_id, "object": "response", "created_at": created, "status": "in_progress",
            "completed_at": None, "error": None, "incomplete_details": None, "model": model, "output": [], "usage": None,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            **settings,
        }
        self._reader = tools.ToolCallStream(sampling) if tools.calls_tools(sampling) else None
        self._sequence = 0
        self._open: dict | None = None  # the item being written
        self._calls: dict[int, dict] = {}  # function_call items by the call's index
        self._pending: list[dict] = []  # logprobs of text the reader holds back (a possible call's start)

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def feed(self, event: dict) -> list[dict]:
        """Events for one worker ``inference.delta``. Its tokens' logprobs (when asked for) go with
        its text; with tools, with the text they spell, once the reader lets it out (a call's are
        not text)."""
        logprobs = formatting.chat_logprobs(event["logprobs"])["content"] if event.get("logprobs") else []
        if self._reader is None:
            return self._text(event["text"], logprobs)
        self._pending += logprobs
        return self._pieces(self._reader.pieces(event["text"]))

    def finish(self, event: dict) -> list[dict]:
        """Events for the worker's ``inference.finished``: the open item closes, the response ends."""
        return self.settle(event) + [self.end()]

    def settle(self, event: dict) -> list[dict]:
        """The response is whole: the open item closes, usage and status are set. One its client
        cancelled (by leaving) is ``cancelled``, OpenAI's status for a response stopped on request."""
        reason = event["finish_reason"]
        status = "incomplete" if reason == "length" else "cancelled" if reason == "abort" else "completed"
        return self._settle(status, event["usage"])

    def fail(self, error: ApiError, usage: dict) -> list[dict]:
        """The response failed after it started: what it wrote so far stays, cut short."""
        out = self._settle("failed", usage)
        self.response["error"] = {"code": _response_error_code(error), "message": error.message}
        return out

    def cancel(self, usage: dict) -> list[dict]:
        """The client left and the worker was not heard from again: the response as it stands."""
        return self._settle("cancelled", usage)

    def _settle(self, status: str, usage: dict) -> list[dict]:
        out = self._pieces(self._reader.pieces(None)) if self._reader is not None else []
        out += self._close(status="completed" if status == "completed" else "incomplete")
        self.response["usage"] = usage_json(usage)
        self.response["status"] = status
        if status == "completed":
            self.response["completed_at"] = int(time.time())
        if status == "incomplete":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    @property
    def settled(self) -> bool:
        return self.response["status"] != "in_progress"

    def end(self) -> dict:
        """The last event, which holds the whole response."""
        return self._event(f"response.{self.response['status']}", response=self._snapshot())

    def error(self, error: ApiError) -> dict:
        """The stream's end when even failing the response failed (a bug): no response to end it."""
        return self._event("error", code=error.code, message=error.message, param=error.param)

    # ------------------------------------------------------------------------------ items

    def _text(self, text: str, logprobs: list[dict]) -> list[dict]:
        if not text:
            return []
        out = []
        if self._open is None or self._open["type"] != "message":
            out += self._close(status="completed")
            item = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            out += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._index,
                                   content_index=0, part=_copy_part(part)))
        item = self._open
        item["content"][0]["text"] += text
        item["content"][0]["logprobs"] += logprobs
        out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._index,
                               content_index=0, delta=text, logprobs=logprobs))
        return out

    def _pieces(self, pieces: list[tuple]) -> list[dict]:
        """Events for what the reader found, in the order the model wrote it."""
        out = []
        for piece in pieces:
            if piece[0] == "text":
                spelled, self._pending = tools.content_logprobs(self._pending, piece[1])
                out += self._text(piece[1], spelled)
            elif piece[0] == "call":
                self._pending = []  # its tags: not text
                out += self._close(status="completed")
                item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": piece[2],
                        "name": piece[3], "arguments": ""}
                self._calls[piece[1]] = item
                out += self._add(item)
            elif piece[2]:
                item = self._calls[piece[1]]
                item["arguments"] += piece[2]
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=self.response["output"].index(item), delta=piece[2]))
        return out

    def _add(self, item: dict) -> list[dict]:
        self.response["output"].append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=self._index, item=_copy(item))]

    def _close(self, *, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.response["output"].index(item)
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=list(part["logprobs"])))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=_copy_part(part)))
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"]))
        item["status"] = status
        out.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return out

    @property
    def _index(self) -> int:
        return len(self.response["output"]) - 1

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _snapshot(self) -> dict:
        return {**self.response, "output": [_copy(item) for item in self.response["output"]]}


def _copy(item: dict) -> dict:
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [_copy_part(part) for part in copied["content"]]
    return copied


def _response_error_code(error: ApiError) -> str:
    """A failed response's ``error.code`` is one of the values OpenAI documents for it (clients
    switch on them), not the HTTP error's own code; its message says what happened."""
    if error.status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if error.status < 500 else "server_error"


def _copy_part(part: dict) -> dict:
    """A part as it is now (its lists grow with the text)."""
    return {**part, "annotations": list(part["annotations"]), "logprobs": list(part["logprobs"])}


# Keeps a whole response (when it asked to be stored); False when it could not.
Keep = Callable[[dict], Awaitable[bool]]
# How long a response whose client left waits for the worker's last event, which brings what the
# model wrote before it stopped and the usage billed for it; past this it is kept as it stands.
LEFT_WAIT_S = 10.0


async def _kept(builder: ResponseBuilder, keep: Keep | None) -> None:
    """Store the whole response before its last event: a client that continues it as soon as it
    has it finds it. One that could not be stored says ``store: false``."""
    if keep is not None and builder.response["store"] and not await keep(builder.response):
        builder.response["store"] = False


def _usage_so_far(call) -> dict:
    """The worker's usage once it finished (what it billed), else what reached the gateway."""
    if call.finished is not None:
        return call.finished["usage"]
    return {"prompt_tokens": call.prompt_tokens, "completion_tokens": call.completion_seen}


async def _failure(call, exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    log.exception("response %s failed", call.request_id)  # a bug: the client gets its id, the log its traceback
    await asyncio.shield(call.cancel())  # the model must not write on for nobody (and be billed for it)
    return unexpected_error()


async def stream(call, builder: ResponseBuilder, keep: Keep | None = None):
    """The Responses events of a started call. One that fails ends with ``response.failed``, kept
    like any other; one whose client leaves is kept as the model left it (``_left``)."""
    kept = False
    try:
        for event in builder.start():
            yield event
        failure = None
        try:
            async for event in call.events():
                if event["type"] == "inference.delta":
                    for out in builder.feed(event):
                        yield out
                elif event["type"] == "inference.finished":
                    for out in builder.settle(event):
                        yield out
        except Exception as exc:
            failure = await _failure(call, exc)
        if failure is not None:
            for out in builder.fail(failure, _usage_so_far(call)):
                yield out
        kept = True  # from here on, a client that leaves changes nothing: the store is shielded
        await asyncio.shield(_kept(builder, keep))
        yield builder.end()
    except (asyncio.CancelledError, GeneratorExit):
        if not kept:
            await asyncio.shield(_left(call, builder, keep))
        raise


async def collect(call, new_builder, keep: Keep | None = None) -> dict:
    """The whole response of a call whose client does not stream; a failure is kept, then raised."""
    builder = new_builder()
    try:
        async for event in call.events():
            builder = _read(builder, event, new_builder)
    except asyncio.CancelledError:
        await asyncio.shield(_left(call, builder, keep, new_builder))
        raise
    except Exception as exc:
        failure = await _failure(call, exc)
        builder.fail(failure, _usage_so_far(call))
        await asyncio.shield(_kept(builder, keep))  # a client that leaves meanwhile does not undo it
        raise failure from None
    await asyncio.shield(_kept(builder, keep))
    return builder.response


def _read(builder: ResponseBuilder, event: dict, new_builder=None) -> ResponseBuilder:
    """The response with a worker event read into it (not streamed: nothing goes out): a new one
    when its worker died and a copy runs it from the start (``new_builder``, for a client that
    does not stream, the one such events come to)."""
    if event["type"] == "inference.delta":
        builder.feed(event)
    elif event["type"] == "inference.restarted" and new_builder is not None:
        return new_builder()
    elif event["type"] == "inference.finished":
        builder.settle(event)
    return builder


async def _left(call, builder: ResponseBuilder, keep: Keep | None, new_builder=None) -> None:
    """The client left before the end: the request is cancelled, and the response kept with what
    the model wrote until it stopped, its usage the worker's (what it billed) unless the worker is
    not heard from within LEFT_WAIT_S."""
    if not builder.settled and call.finished is not None:  # it finished as the client left
        failure = calls.ended_badly(call.finished, cancelled=call.cancelled)
        if failure is not None:
            builder.fail(failure, _usage_so_far(call))
        else:
            builder.settle(call.finished)
    if not builder.settled and not call.done:
        await call.cancel()
        try:
            async with asyncio.timeout(LEFT_WAIT_S):
                async for event in call.events():
                    builder = _read(builder, event, new_builder)
        except ApiError as exc:
            builder.fail(exc, _usage_so_far(call))
        except TimeoutError:
            pass
    if not builder.settled:
        builder.cancel(_usage_so_far(call))
    await _kept(builder, keep)
