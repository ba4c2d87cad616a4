"""A call's answers (``n`` per prompt) as OpenAI shapes them: streamed as chunks, or collected into
one response. Each delta event names its answer by ``index``; the end names each answer's
finish reason (``formatting.choice_ends``)."""

from __future__ import annotations

import asyncio

from . import formatting, legacy_functions, tools
from .errors import ApiError


def echoed(event: dict, prompt) -> tuple[str, list[dict] | None]:
    """A delta's text and logprob entries, after the prompt when the delta brings it (a
    completion's ``echo``): the prompt as the model's tokens read it when the worker says (so
    that the text and the tokens' offsets agree), else as the client wrote it."""
    scored = event.get("prompt")
    if scored is None:
        return event["text"], event["logprobs"]
    text = scored["text"] if scored["text"] is not None else prompt
    if scored["logprobs"] is None:
        return text + event["text"], event["logprobs"]
    return text + event["text"], scored["logprobs"] + (event["logprobs"] or [])


class TextAnswer:
    """One streamed answer of free text."""

    def __init__(self, ctx: formatting.Context, index: int, include_usage: bool, prompt=None) -> None:
        self._ctx, self._index, self._include_usage = ctx, index, include_usage
        self._prompt = prompt  # what echo writes back
        self._offset = 0  # characters so far: where the next token starts (completions' logprobs)

    def feed(self, event: dict) -> list[dict]:
        text, logprobs = echoed(event, self._prompt)
        if not text and not logprobs:  # the stop token or EOS that ended it: nothing to show
            return []
        chunk = formatting.chunk(self._ctx, index=self._index, text=text, logprobs=logprobs,
                                 text_offset=self._offset, include_usage=self._include_usage)
        self._offset += len(text)
        return [chunk]

    def end(self, reason: str) -> list[dict]:
        return [formatting.chunk(self._ctx, index=self._index, text=None if self._ctx.kind == "chat" else "",
                                 finish_reason=reason, include_usage=self._include_usage)]


async def stream_chunks(call, ctx: formatting.Context, include_usage: bool):
    """OpenAI chunk dicts for a started call; shared by SSE and the WebSocket."""
    sampling, count = call.request.sampling, _count(call.request)
    if tools.calls_tools(sampling):
        legacy = call.request.extra.get("legacy_functions", False)
        answers = [tools.ToolAnswer(ctx, index, sampling, include_usage, legacy=legacy) for index in range(count)]
    else:
        answers = [TextAnswer(ctx, index, include_usage, _prompt_of(call.request, index)) for index in range(count)]
    # A reply that can only call tools has no content: null from the start, as OpenAI's.
    opening = None if tools.calls_only(sampling) else ""
    for index in range(count):
        yield formatting.chunk(ctx, index=index, text=opening, first=True, include_usage=include_usage)
    ended: set[int] = set()
    async for event in call.events():
        if event["type"] == "inference.delta":
            index = event.get("index", 0)
            for chunk in answers[index].feed(event):
                yield chunk
            # An answer that ended well says so at once, not when the last of its siblings ends
            # (one aborted or failed ends the request: its end waits for the request's).
            if event.get("finish_reason") in formatting.GOOD_ENDS:
                ended.add(index)
                for chunk in answers[index].end(formatting.openai_finish_reason(event["finish_reason"])):
                    yield chunk
        elif event["type"] == "inference.finished":
            for index, reason in formatting.choice_ends(event):
                for chunk in answers[index].end(reason) if index not in ended else ():
                    yield chunk
            if include_usage:
                yield formatting.usage_chunk(ctx, event["usage"])


async def collect(call, ctx: formatting.Context) -> dict:
    """The whole response of a call whose client does not stream."""
    if ctx.kind == "embedding":
        return await _embeddings(call, ctx)
    sampling, count = call.request.sampling, _count(call.request)
    texts: list[list[str]] = [[] for _ in range(count)]
    logprobs: list[list[dict]] = [[] for _ in range(count)]
    async for event in call.events():
        if event["type"] == "inference.delta":
            index = event.get("index", 0)
            text, entries = echoed(event, _prompt_of(call.request, index))
            texts[index].append(text)
            logprobs[index].extend(entries or [])
        elif event["type"] == "inference.restarted":  # its worker died: a copy runs it from the start
            for parts in (*texts, *logprobs):
                parts.clear()
        elif event["type"] == "inference.finished":
            choices = [_whole(ctx, call.request, index, "".join(texts[index]), reason,
                              logprobs[index] if sampling.get("logprobs") else None)
                       for index, reason in formatting.choice_ends(event)]
            return formatting.response(ctx, choices=choices, usage=event["usage"])
    raise ApiError(500, "The worker ended the request without finishing it.")


async def _embeddings(call, ctx: formatting.Context) -> dict:
    """An embeddings response: one embedding per input, each in the delta of its index."""
    vectors: list[str | None] = [None] * len(call.request.prompts)
    async for event in call.events():
        if event["type"] == "inference.delta" and "embedding" in event:
            vectors[event.get("index", 0)] = event["embedding"]
        elif event["type"] == "inference.restarted":
            vectors = [None] * len(vectors)
        elif event["type"] == "inference.finished":
            if None in vectors:
                break
            # Thousands of vectors as numbers take a while: not on the loop every stream shares.
            return await asyncio.to_thread(formatting.embeddings, ctx, vectors,
                                           encoding=call.request.extra["encoding_format"], usage=event["usage"])
    raise ApiError(500, "The worker ended the request without an embedding for each input.")


def _count(request) -> int:
    """How many answers a request has: ``n`` for each of its prompts."""
    return request.n * len(request.prompts or [None])


def _prompt_of(request, index: int):
    """The prompt answer ``index`` answers (a completion's; None for chat): answers go prompt by
    prompt, ``n`` each, as OpenAI orders them."""
    return request.prompts[index // request.n] if request.prompts else None


def _whole(ctx: formatting.Context, request, index: int, text: str, reason: str,
           logprobs: list[dict] | None) -> dict:
    sampling, calls = request.sampling, None
    if tools.calls_tools(sampling):
        reader = tools.ToolCallStream(sampling)
        text = reader.feed(text)[0] + reader.finish()[0]
        calls, reason = reader.calls, tools.finish_reason(sampling, reason, reader)
        if tools.calls_only(sampling):
            text = None  # no text can come: null, as streamed, even when max_tokens cut the call short
        if calls and logprobs is not None:  # the content's tokens alone: a call's are not content
            logprobs = tools.content_logprobs(logprobs, text)[0]
        if request.extra.get("legacy_functions"):
            return formatting.choice(ctx, index=index, text=text, finish_reason=legacy_functions.finish_reason(reason),
                                     logprobs=logprobs, function_call=legacy_functions.function_call(calls))
    return formatting.choice(ctx, index=index, text=text, finish_reason=reason, logprobs=logprobs, tool_calls=calls)
