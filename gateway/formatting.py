"""The one place that turns worker events into OpenAI JSON: responses, stream chunks, usage.

Workers send neutral events (see ``workers.inference``): ``delta`` events carry new text, token
ids and per-token logprobs as ``{"token", "bytes", "logprob", "top": [[token, logprob, bytes]]}``;
``finished`` carries the finish reason and the token counts.
"""

from __future__ import annotations

import base64
import codecs
from dataclasses import dataclass

import numpy as np

SYSTEM_FINGERPRINT = "fp_inference_platform_1"


@dataclass(frozen=True)
class Context:
    kind: str  # "chat" | "completion" | "embedding"
    id: str
    created: int
    model: str
    fingerprint: str | None = None  # the engine's (``Call.fingerprint``); None: the platform's own

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def envelope(self, *, chunk: bool) -> dict:
        obj = "chat.completion.chunk" if chunk and self.kind == "chat" else self.object
        envelope = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                    "system_fingerprint": self.fingerprint or SYSTEM_FINGERPRINT}
        if self.kind == "chat":  # the tier that served it, as OpenAI says (one tier here)
            envelope["service_tier"] = "default"
        return envelope


def usage_json(usage: dict) -> dict:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usage.get("cached_prompt_tokens", 0)},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def chat_logprobs(entries: list[dict]) -> dict:
    def one(token, logprob, raw):
        return {"token": token, "logprob": logprob, "bytes": raw}

    return {
        "content": [
            {**one(e["token"], e["logprob"], e["bytes"]), "top_logprobs": [one(*alt) for alt in e["top"]]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[dict], *, text_offset: int) -> dict:
    # Where each token starts in the text, in characters: from its bytes, since a token may hold
    # part of a character (its "token" is then "bytes:\\x.."); it starts after the whole ones.
    offsets, at, decoder = [], text_offset, codecs.getincrementaldecoder("utf-8")(errors="replace")
    for e in entries:
        offsets.append(at)
        at += len(decoder.decode(bytes(e["bytes"])))
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [_completion_top(e) for e in entries],
        "text_offset": offsets,
    }


def _completion_top(entry: dict) -> dict | None:
    # The legacy endpoint always lists the sampled token beside the top alternatives (OpenAI:
    # "up to logprobs+1 elements"), where chat lists the alternatives alone. An echoed prompt's
    # first token has neither (nothing comes before it).
    if entry["top"] is None:
        return None
    top = {token: logprob for token, logprob, _ in entry["top"]}
    top.setdefault(entry["token"], entry["logprob"])
    return top


def _logprobs(ctx: Context, entries: list[dict] | None, text_offset: int) -> dict | None:
    if entries is None:
        return None
    return chat_logprobs(entries) if ctx.kind == "chat" else completion_logprobs(entries, text_offset=text_offset)


def chunk(ctx: Context, *, text: str | None, index: int = 0, logprobs: list[dict] | None = None,
          finish_reason: str | None = None, first: bool = False, text_offset: int = 0, include_usage: bool = False,
          tool_calls: list[dict] | None = None, function_call: dict | None = None) -> dict:
    """One streamed chunk of answer ``index``, carrying new text or tool call deltas (or the
    deprecated ``function_call``'s), or, with ``finish_reason``, the end of the answer."""
    if ctx.kind == "chat":
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None or first:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        if function_call:
            delta["function_call"] = function_call
        choice = {"index": index, "delta": delta, "logprobs": _logprobs(ctx, logprobs, text_offset),
                  "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": _logprobs(ctx, logprobs, text_offset),
                  "finish_reason": finish_reason}
    body = {**ctx.envelope(chunk=True), "choices": [choice]}
    if include_usage:
        body["usage"] = None
    return body


def usage_chunk(ctx: Context, usage: dict) -> dict:
    """The last chunk before ``[DONE]`` when the client asked for ``include_usage``."""
    return {**ctx.envelope(chunk=True), "choices": [], "usage": usage_json(usage)}


def choice(ctx: Context, *, index: int, text: str | None, finish_reason: str, logprobs: list[dict] | None,
           tool_calls: list[dict] | None = None, function_call: dict | None = None) -> dict:
    """One whole answer of a response (a message that calls tools, or the deprecated
    ``function_call``, has no content unless the model wrote some before its calls)."""
    if ctx.kind == "chat":
        calls = tool_calls or function_call
        message = {"role": "assistant", "content": (text or None) if calls else text, "refusal": None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        if function_call:
            message["function_call"] = function_call
        return {"index": index, "message": message, "logprobs": _logprobs(ctx, logprobs, 0),
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": _logprobs(ctx, logprobs, 0), "finish_reason": finish_reason}


def response(ctx: Context, *, choices: list[dict], usage: dict) -> dict:
    """A whole non-streamed response."""
    return {**ctx.envelope(chunk=False), "choices": choices, "usage": usage_json(usage)}


def embeddings(ctx: Context, vectors: list[str], *, encoding: str, usage: dict) -> dict:
    """OpenAI's embeddings response; ``vectors``: each input's embedding as the worker sends it,
    base64 of little-endian float32, written back as numbers unless the client asked for base64."""
    def value(vector: str):
        if encoding == "base64":
            return vector
        return np.frombuffer(base64.b64decode(vector), dtype="<f4").tolist()

    tokens = usage["prompt_tokens"]
    return {"object": "list", "model": ctx.model,
            "data": [{"object": "embedding", "index": i, "embedding": value(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def choice_ends(event: dict) -> list[tuple[int, str]]:
    """Each answer's index and OpenAI finish reason, from a worker's ``inference.finished`` event
    (one from a worker that predates ``n`` names one answer's reason alone)."""
    ends = event.get("choices") or [{"index": 0, "finish_reason": event["finish_reason"]}]
    return [(end["index"], openai_finish_reason(end["finish_reason"])) for end in ends]


GOOD_ENDS = ("stop", "length")  # the engine's reasons of an answer that ended as asked


def openai_finish_reason(reason: str) -> str:
    """The engine's reasons mapped onto OpenAI's vocabulary."""
    return reason if reason in GOOD_ENDS else "stop"
