"""Chat's function calling, as OpenAI spells it: ``tools``, ``tool_choice``, ``parallel_tool_calls``,
and the assistant ``tool_calls`` and ``tool`` results a conversation carries back.

The request side checks and flattens them for the worker (a tool becomes {"name", "description",
"parameters"}); ``ToolCallStream`` turns the reply's text into OpenAI's ``tool_calls``, whole or as
stream deltas, and ``ToolAnswer`` streams them.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from workers.dispatch import tool_call_parser, tools_problem

from . import formatting, legacy_functions
from .errors import invalid, text_only

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


def parse_tools(body: dict) -> dict:
    """The sampling fields for ``tools``/``tool_choice``/``parallel_tool_calls`` (none when the
    request has no tools)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if tools is not None and not isinstance(tools, list):
        raise invalid("tools", "tools must be an array of {\"type\": \"function\", \"function\": {...}}")
    flat = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools or [])]
    if len(flat) > MAX_TOOLS:
        raise invalid("tools", f"at most {MAX_TOOLS} tools are allowed")
    names = [tool["name"] for tool in flat]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate:
        raise invalid("tools", f"tools holds two functions named {duplicate!r}")
    choice = _choice(choice, names)
    if not flat:
        return {}
    problem = tools_problem(flat, choice, parallel is not False)
    if problem:
        raise invalid("tools", f"tools: {problem}")
    return {"tools": flat, "tool_choice": choice, "parallel_tool_calls": parallel is not False}


def _tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise invalid(where, f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
    extra = set(tool) - {"type", "function"}
    if extra:
        raise invalid(where, f"{where} takes no {sorted(extra)[0]!r}")
    function = tool["function"]
    extra = set(function) - {"name", "description", "parameters", "strict"}
    if extra:
        raise invalid(where, f"{where}.function takes no {sorted(extra)[0]!r}")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise invalid(where, f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes")
    flat = {"name": name}
    if function.get("description") is not None:
        if not isinstance(function["description"], str):
            raise invalid(where, f"{where}.function.description must be a string")
        flat["description"] = text_only(function["description"], f"{where}.function.description")
    if function.get("parameters") is not None:
        if not isinstance(function["parameters"], dict):
            raise invalid(where, f"{where}.function.parameters must be a JSON Schema object")
        text_only(json.dumps(function["parameters"], ensure_ascii=False), f"{where}.function.parameters")
        flat["parameters"] = function["parameters"]
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise invalid(where, f"{where}.function.strict must be a boolean")
    return flat


# OpenAI's tool choices for features this platform lacks (a subset of the tools, custom tools).
UNSUPPORTED_CHOICES = ("allowed_tools", "custom")


def _choice(choice: Any, names: list[str]) -> str | dict:
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise invalid("tool_choice", f"tool_choice must be one of {', '.join(CHOICES)} or "
                                         '{"type": "function", "function": {"name": ...}}')
        if choice == "required" and not names:
            raise invalid("tool_choice", 'tool_choice "required" needs tools to call')
        return choice
    if isinstance(choice, dict) and choice.get("type") in UNSUPPORTED_CHOICES:
        raise invalid("tool_choice", f'tool_choice of type {choice["type"]!r} is not supported by this platform; '
                                     'use none, auto, required or {"type": "function", "function": {"name": ...}}',
                      code="unsupported_value")
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise invalid("tool_choice", 'tool_choice must be one of none, auto, required or '
                                     '{"type": "function", "function": {"name": ...}}')
    name = choice["function"]["name"]
    if name not in names:
        raise invalid("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return {"name": name}


class ToolTurns:
    """Reads a conversation's tool fields, checking that calls and results pair up as OpenAI
    requires: an assistant message's calls are answered by the ``tool`` messages right after it,
    one per call, before the conversation goes on."""

    def __init__(self) -> None:
        self.waiting: dict[str, None] = {}  # the ids of the last calls not answered yet
        self.asked = ""  # the message that made them

    def fields(self, message: dict, where: str) -> dict:
        """The checked tool fields of one message (``tool_calls``, ``tool_call_id``)."""
        role = message["role"]
        if role == "tool":
            return {"tool_call_id": self._answer(message, where)}
        self._all_answered()
        if role == "assistant" and message.get("tool_calls") is not None:
            self.asked = where
            calls = [self._call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(_list(message, where))]
            return {"tool_calls": calls} if calls else {}
        return {}

    def end(self) -> None:
        self._all_answered()

    def _all_answered(self) -> None:
        if self.waiting:
            raise invalid(f"{self.asked}.tool_calls", f"{self.asked} calls {', '.join(map(repr, self.waiting))}, "
                                                      "which no tool message right after it answers")

    def _call(self, call: Any, at: str) -> dict:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and isinstance(call.get("id"), str) and call["id"]
                and call.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), str)):
            raise invalid(at, f'{at} must be {{"id": "<non-empty>", "type": "function", "function": '
                              '{"name": ..., "arguments": "<JSON text>"}}')
        if not TOOL_NAME.fullmatch(function["name"]):
            raise invalid(at, f"{at}.function.name must be 1 to 64 letters, digits, underscores or dashes")
        if call["id"] in self.waiting:
            raise invalid(at, f"{at} has the id {call['id']!r} of another call in the same message")
        self.waiting[call["id"]] = None
        arguments = text_only(function["arguments"], f"{at}.function.arguments")
        return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}

    def _answer(self, message: dict, where: str) -> str:
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise invalid(f"{where}.tool_call_id", f"{where}.tool_call_id must be the id (a string) of the call "
                                                   "it answers", code="missing_required_parameter" if call_id is None else None)
        if call_id not in self.waiting:
            raise invalid(f"{where}.tool_call_id", f"{where} answers {call_id!r}, which is no call of the assistant "
                                                   "message before it still waiting for its result")
        del self.waiting[call_id]
        return call_id


def _list(message: dict, where: str) -> list:
    if not isinstance(message["tool_calls"], list):
        raise invalid(f"{where}.tool_calls", f"{where}.tool_calls must be an array")
    return message["tool_calls"]


def calls_tools(sampling: dict) -> bool:
    return bool(sampling.get("tools")) and sampling.get("tool_choice") != "none"


def calls_only(sampling: dict) -> bool:
    """Whether the reply can hold nothing but calls (tool_choice "required" or a function)."""
    return calls_tools(sampling) and sampling.get("tool_choice") != "auto"


def finish_reason(sampling: dict, reason: str, reader: "ToolCallStream") -> str:
    """OpenAI's: "tool_calls" when the model chose to call and its calls are whole (a named
    choice was no choice: "stop")."""
    if reader.calls and reader.whole and reason == "stop" and not isinstance(sampling.get("tool_choice"), dict):
        return "tool_calls"
    return reason


class ToolCallStream:
    """Reads a reply's text as it streams and says what the message gains: text for its content,
    and OpenAI ``tool_calls`` entries (the first of each call with its id and name)."""

    def __init__(self, sampling: dict) -> None:
        self._parser = tool_call_parser(text=not calls_only(sampling))
        self._ids: list[str] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        return self._shape(self.pieces(text))

    def finish(self) -> tuple[str, list[dict]]:
        return self._shape(self.pieces(None))

    def pieces(self, text: str | None) -> list[tuple]:
        """What the message gains from ``text`` (None: the reply ended), in the order the model
        wrote it: ("text", text), ("call", index, id, name), ("arguments", index, text)."""
        out = []
        for event in self._parser.finish() if text is None else self._parser.feed(text):
            if event[0] == "call":
                self._ids.append("call_" + secrets.token_hex(12))
                out.append(("call", event[1], self._ids[-1], event[2]))
            elif event[0] == "text":
                out.append(event)
            else:
                out.append(("arguments", event[1], event[2]))
        return out

    @property
    def whole(self) -> bool:
        return self._parser.whole

    @property
    def calls(self) -> list[dict]:
        """Every call so far, whole, as a response message holds them."""
        return [{"id": call_id, "type": "function", "function": dict(call)}
                for call_id, call in zip(self._ids, self._parser.calls)]

    @staticmethod
    def _shape(pieces: list[tuple]) -> tuple[str, list[dict]]:
        """Chat's shape of the pieces: the text, and one ``tool_calls`` delta per call."""
        text, deltas = [], {}
        for piece in pieces:
            if piece[0] == "text":
                text.append(piece[1])
            elif piece[0] == "call":
                deltas[piece[1]] = {"index": piece[1], "id": piece[2], "type": "function",
                                    "function": {"name": piece[3], "arguments": ""}}
            else:
                entry = deltas.setdefault(piece[1], {"index": piece[1], "function": {"arguments": ""}})
                entry["function"]["arguments"] += piece[2]
        return "".join(text), list(deltas.values())


class ToolAnswer:
    """One streamed answer that may call tools: text and call deltas as the reply is read, each
    chunk carrying the logprobs of the tokens since the last (a call's tags are tokens too, and
    no chunk goes out for them alone), then the end."""

    def __init__(self, ctx: formatting.Context, index: int, sampling: dict, include_usage: bool, *,
                 legacy: bool = False) -> None:
        self._ctx, self._index, self._sampling, self._include_usage = ctx, index, sampling, include_usage
        self._reader, self._pending = ToolCallStream(sampling), []
        self._legacy = legacy  # the call as the deprecated ``function_call`` (see legacy_functions)

    def feed(self, event: dict) -> list[dict]:
        self._pending += event["logprobs"] or []
        return self._flush(*self._reader.feed(event["text"]))

    def end(self, reason: str) -> list[dict]:
        chunks = self._flush(*self._reader.finish())
        reason = finish_reason(self._sampling, reason, self._reader)
        self._pending = []  # a call's tags: not content
        return chunks + [self._chunk(text=None, finish_reason=legacy_functions.finish_reason(reason)
                                     if self._legacy else reason)]

    def _flush(self, text: str, calls: list[dict]) -> list[dict]:
        if not (text or calls):
            return []
        # The logprobs of the content's tokens go with it; a call's (its tags, its JSON) are not
        # content, as OpenAI's logprobs cover the message's content alone.
        logprobs, self._pending = content_logprobs(self._pending, text)
        if calls:
            self._pending = []
        if self._legacy:
            return [self._chunk(logprobs, text=text or None, function_call=legacy_functions.function_call_delta(calls))]
        return [self._chunk(logprobs, text=text or None, tool_calls=calls)]

    def _chunk(self, logprobs: list[dict] | None = None, **fields) -> dict:
        return formatting.chunk(self._ctx, index=self._index, logprobs=logprobs or None,
                                include_usage=self._include_usage, **fields)


def content_logprobs(entries: list[dict], text: str | None) -> tuple[list[dict], list[dict]]:
    """Of a reply's logprob entries, those of the tokens that spell ``text`` (the content at their
    start, counted in bytes), and the rest."""
    wanted, spelled = len((text or "").encode()), 0
    for at, entry in enumerate(entries):
        if spelled >= wanted:
            return entries[:at], entries[at:]
        spelled += len(entry["bytes"]) if entry.get("bytes") is not None else len(entry["token"].encode())
    return entries, []
