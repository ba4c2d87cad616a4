"""OpenAI's deprecated function calling, read as tools: ``functions`` and ``function_call`` in a
chat request, an assistant message's ``function_call`` and the ``function`` message with its
result. Older SDK code and frameworks still send it.

The request is rewritten into the tools form before it is checked (at most one call, as the
legacy API made), with errors naming the legacy fields; the reply says what was called as the
legacy API did: ``message.function_call`` with ``finish_reason: "function_call"``, streamed as
``delta.function_call`` (the name first, then the arguments).
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ApiError, invalid

FIELDS = ("functions", "function_call")
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
# What the tools' checks call a legacy field, and what the client called it.
_RENAMES = ((re.compile(r"\btools\[(\d+)\]\.function\b"), r"functions[\1]"), (re.compile(r"\btools\[(\d+)\]"), r"functions[\1]"),
            (re.compile(r"\btools\b"), "functions"), (re.compile(r"\btool_choice\b"), "function_call"),
            (re.compile(r"\.tool_calls\[0\]\.function\b"), ".function_call"),
            (re.compile(r"\.tool_calls\[0\]"), ".function_call"))


def asks_functions(body: dict) -> bool:
    """Whether a chat body offers functions in the legacy form: then its reply takes that form too."""
    return any(body.get(name) is not None for name in FIELDS)


def uses_functions(body: dict) -> bool:
    """Whether a chat body speaks the legacy form anywhere: its fields or its messages (a
    conversation may carry legacy calls to a request that offers tools)."""
    messages = body.get("messages")
    return asks_functions(body) or (isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "function" or m.get("function_call") is not None) for m in messages))


def as_tools(body: dict) -> dict:
    """``body`` (which ``uses_functions``) in the tools form; fields sent as null are left out."""
    sent = [name for name in FIELDS if body.get(name) is not None]
    if sent and any(body.get(name) is not None for name in TOOL_FIELDS):
        raise invalid(sent[0], f"{sent[0]} is the deprecated form of tools; send tools or functions, not both",
                      code="invalid_parameter_combination")
    out = {name: value for name, value in body.items() if name not in FIELDS}
    functions, choice = body.get("functions"), body.get("function_call")
    if functions is not None:
        shape = '{"name": ..., "description": ..., "parameters": {...}}'
        if not isinstance(functions, list):
            raise invalid("functions", f"functions must be an array of {shape}")
        for i, function in enumerate(functions):
            if not isinstance(function, dict):
                raise invalid(f"functions[{i}]", f"functions[{i}] must be {shape}")
        out["tools"] = [{"type": "function", "function": function} for function in functions]
        out["parallel_tool_calls"] = False  # a legacy reply calls one function at most
    if choice is not None:
        if isinstance(choice, dict) and set(choice) == {"name"}:
            choice = {"type": "function", "function": choice}
        elif choice not in ("none", "auto"):
            raise invalid("function_call", 'function_call must be "none", "auto" or {"name": ...}')
        out["tool_choice"] = choice
    if isinstance(body.get("messages"), list):
        out["messages"] = _messages(body["messages"])
    return out


def renamed(error: ApiError) -> ApiError:
    """A tools check's error as the legacy request's client wrote it."""
    for pattern, legacy in _RENAMES:
        error.message = pattern.sub(legacy, error.message)
        if error.param:
            error.param = pattern.sub(legacy, error.param)
    return error


def _messages(messages: list) -> list:
    """The conversation with each legacy call as a tool call, and its result as that call's tool
    message (which must come right after it, as with tools)."""
    out, waiting = [], None  # waiting: (id, name, where) of the call the next message must answer
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            out.append(message)
            continue
        if waiting and message.get("role") != "function":
            raise _unanswered(waiting)
        if message.get("role") == "function":
            out.append(_result(message, where, waiting))
            waiting = None
        elif message.get("function_call") is not None:
            message, waiting = _call(message, where)
            out.append(message)
        else:
            out.append(message)
    if waiting:
        raise _unanswered(waiting)
    return out


def _call(message: dict, where: str) -> tuple[dict, tuple]:
    call = message["function_call"]
    if message.get("role") != "assistant":
        raise invalid(f"{where}.function_call", f"{where}: only an assistant message calls a function")
    if message.get("tool_calls") is not None:
        raise invalid(f"{where}.function_call", f"{where} has both tool_calls and function_call; send one",
                      code="invalid_parameter_combination")
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), str)):
        raise invalid(f"{where}.function_call", f'{where}.function_call must be {{"name": ..., "arguments": '
                                                '"<JSON text>"}')
    call_id = f"call_{where.replace('[', '_').rstrip(']')}"  # any id unique in the conversation
    tool_call = {"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
    rest = {name: value for name, value in message.items() if name != "function_call"}
    return {**rest, "tool_calls": [tool_call]}, (call_id, call["name"], where)


def _result(message: dict, where: str, waiting: tuple | None) -> dict:
    name = message.get("name")
    if not isinstance(name, str):
        raise invalid(f"{where}.name", f"{where}.name must be the name of the function whose result it is",
                      code="missing_required_parameter" if name is None else None)
    if waiting is None or waiting[1] != name:
        raise invalid(f"{where}.name", f"{where} is the result of {name!r}, which the assistant message right "
                                       "before it does not call")
    return {"role": "tool", "tool_call_id": waiting[0], "content": message.get("content")}


def _unanswered(waiting: tuple) -> ApiError:
    _, name, where = waiting
    return invalid(f"{where}.function_call", f"{where} calls {name!r}, and the message right after it is not "
                                             "its result (a function message)")


def function_call(tool_calls: list[dict] | None) -> dict | None:
    """A reply's one call as the legacy ``function_call`` (its name and arguments)."""
    return dict(tool_calls[0]["function"]) if tool_calls else None


def function_call_delta(deltas: list[dict]) -> dict | None:
    """A chunk's ``tool_calls`` deltas of the one call as the legacy ``delta.function_call``: the
    name in the first, then the arguments."""
    first = [delta for delta in deltas if delta["index"] == 0]  # (a legacy reply makes one call)
    if not first:
        return None
    function = first[0]["function"]
    return {"name": function["name"], "arguments": function["arguments"]} if "name" in function \
        else {"arguments": function["arguments"]}


def finish_reason(reason: str) -> str:
    return "function_call" if reason == "tool_calls" else reason
