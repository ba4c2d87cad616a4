"""OpenAI's Responses API (``POST /v1/responses``) read as a chat request: ``instructions`` and the
input items become messages, ``tools`` and ``text.format`` chat's tools and response_format,
``max_output_tokens`` the token limit. Everything is then checked as chat checks it, and an error
names the Responses parameter.

A request that continues a stored response (``previous_response_id``) answers that response's
conversation, its output included, followed by its own ``input``; instructions and tools are not
carried over, as OpenAI's are not.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from .errors import ApiError, invalid, json_object
from .protocol import InferenceRequest, parse_chat

FIELDS = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "stream_options",
    "tools", "tool_choice", "parallel_tool_calls", "text", "store", "metadata", "user", "previous_response_id",
    "truncation", "reasoning", "include", "service_tier", "safety_identifier", "prompt_cache_key", "background",
    "max_tool_calls", "top_logprobs", "prompt_cache_retention", "conversation", "prompt", "context_management",
}
# Parameters accepted at the values that ask for nothing this platform lacks.
NO_OPS = {
    "background": (None, False),
    "max_tool_calls": (None,),
    "truncation": (None, "disabled", "auto"),  # a conversation too long for the context is a 400 either way
    "prompt_cache_retention": (None, "in_memory", "24h"),  # the prefix cache keeps what memory holds
    "conversation": (None,),  # previous_response_id chains responses here
    "prompt": (None,),  # no stored prompt templates
    "context_management": (None,),
}
# ``reasoning`` as a response repeats it (``{"effort": null, "summary": null}``) asks for nothing: the
# models here do not reason. Any of its fields, each at one of these values.
REASONING_NOTHING = {"effort": (None, "none"), "summary": (None,), "generate_summary": (None,)}
LOGPROBS = "message.output_text.logprobs"
# What ``include`` may name: the output text's logprobs; the rest asks for parts of items (tool
# results, reasoning, images) this platform never produces, so there is nothing to add.
INCLUDES = {LOGPROBS, "reasoning.encrypted_content", "web_search_call.action.sources", "code_interpreter_call.outputs",
            "computer_call_output.output.image_url", "file_search_call.results", "message.input_image.image_url"}
# Chat's names in errors, as this API calls them (a message is named by the item it came from).
RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format.json_schema": "text.format",
           "response_format": "text.format"}
MESSAGE = re.compile(r"messages\[(\d+)\]")
# Chat's words for a call and its result, as this API calls them (items, not messages).
TOOL_WORDS = ((re.compile(r"\.tool_calls(\[\d+\])?"), ""), *((re.compile(re.escape(chat)), words) for chat, words in (
    (".tool_call_id", ".call_id"), (".function.", "."),
    ("which no tool message right after it answers", "which no function_call_output item right after it answers"),
    ("which is no call of the assistant message before it still waiting for its result",
     "which is no function_call item before it still waiting for its output"),
    ("must be the id (a string) of the call it answers", "must be the call_id (a string) of the function_call it answers"),
)))
CHAT_ROLES = {"user", "system", "developer", "assistant"}
TEXT_PARTS = {"input_text", "output_text"}
INHERITED = "previous_response_id"  # what an item of the previous response's conversation is named by


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass
class ResponseRequest:
    inference: InferenceRequest  # the chat request it runs as
    settings: dict  # what its response repeats of it
    conversation: list[dict]  # every input item it answers, as stored: the previous response's, then input's
    store: bool


def parse_response_request(body: Any, *, history: Callable[[str], tuple[list[dict], str] | None] = lambda _: None,
                           can_store: bool = False) -> ResponseRequest:
    """The chat request a Responses body asks for. ``history(id)`` is the conversation of a stored
    response, its output included, and its status (None: no such response); ``can_store``:
    whether responses are kept at all."""
    for name in json_object(body):
        if name not in FIELDS:
            raise invalid(name, f"Unrecognized request argument supplied: {name}", code="unknown_parameter")
    for name, accepted in NO_OPS.items():
        value = body.get(name)
        if value is not None and not any(value == ok and type(value) is type(ok) for ok in accepted):
            raise invalid(name, f"{name}={json.dumps(value)[:200]} is not supported by this platform",
                          code="unsupported_value")
    reasoning = body.get("reasoning")
    if reasoning is not None and not (isinstance(reasoning, dict) and all(
            name in REASONING_NOTHING and value in REASONING_NOTHING[name] for name, value in reasoning.items())):
        raise invalid("reasoning", f"reasoning={json.dumps(reasoning)[:200]} is not supported by this platform (its "
                                   'models do not reason): leave it out or send {"effort": null}', code="unsupported_value")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise invalid("store", "store must be a boolean")
    chat = {name: body[name] for name in ("model", "temperature", "top_p", "stream", "stream_options",
                                          "parallel_tool_calls", "metadata", "user", "service_tier",
                                          "safety_identifier", "prompt_cache_key") if name in body}
    conversation, origins = _conversation(body.get("input"), _previous(body.get("previous_response_id"), history))
    chat["messages"], origins = _messages(conversation, origins, body.get("instructions"))
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("text") is not None:
        chat["response_format"] = _format(body["text"])
    chat.update(_logprobs(body.get("include"), body.get("top_logprobs")))
    if isinstance(chat.get("stream_options"), dict):  # the Responses API has no include_usage: usage always comes
        chat["stream_options"] = {k: v for k, v in chat["stream_options"].items() if k != "include_usage"}
    try:
        request = parse_chat(chat)
    except ApiError as exc:
        raise renamed(exc, origins) from None
    request.max_tokens_param = "max_output_tokens"
    request.extra["origins"] = origins
    store = can_store and body.get("store") is not False
    return ResponseRequest(request, _settings(body, store=store), conversation, store)


def _previous(response_id: Any, history: Callable[[str], tuple[list[dict], str] | None]) -> list[dict]:
    if response_id is None:
        return []
    if not isinstance(response_id, str) or not response_id:
        raise invalid(INHERITED, "previous_response_id must be the id of a stored response")
    found = history(response_id) if response_id.isprintable() else None
    if found is None:
        raise invalid(INHERITED, f"Previous response with id '{response_id[:80]}' not found.",
                      code="previous_response_not_found")
    items, status = found
    if status == "failed":  # what it wrote is no answer to build on, and leaving it out would hide that
        raise invalid(INHERITED, f"Previous response with id '{response_id[:80]}' failed, so it cannot be "
                                 "continued: continue the response it continued, or send its input again.",
                      code="previous_response_failed")
    return items


def _conversation(items: Any, before: list[dict]) -> tuple[list[dict], list[str]]:
    """The items a response answers, as stored (each with its own id), and where each came from:
    the previous response's, then ``input``'s."""
    if items is None:
        raise invalid("input", "input is required", code="missing_required_parameter")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
        wheres = ["input"]
    elif isinstance(items, list) and items:
        wheres = [f"input[{i}]" for i in range(len(items))]
    else:
        raise invalid("input", "input must be a string or a non-empty array of items")
    known = {item.get("id") for item in before}
    added = []
    for item, where in zip(items, wheres):
        if not isinstance(item, dict):
            raise invalid(where, f"{where} must be an object")
        if isinstance(item.get("id"), str) and item["id"] in known:
            raise invalid(where, f"{where} (id {item['id'][:80]}) is already in the conversation of "
                                 "previous_response_id: send only the new items", code="duplicate_item")
        added.append(_stored(item, where))
    return [*before, *added], [INHERITED] * len(before) + wheres


def _stored(item: dict, where: str) -> dict:
    """``item`` in the shape a stored conversation keeps (and ``input_items`` lists), with a new id."""
    kind = item.get("type", "message")
    if kind == "message":
        role, text = _message(item, where)
        part = ({"type": "output_text", "text": text, "annotations": [], "logprobs": []} if role == "assistant"
                else {"type": "input_text", "text": text})
        return {"id": new_id("msg"), "type": "message", "role": role, "status": "completed", "content": [part]}
    if kind == "function_call":
        if not all(isinstance(item.get(name), str) for name in ("call_id", "name", "arguments")):
            raise invalid(where, f"{where} must have call_id, name and arguments (JSON text), all strings")
        return {"id": new_id("fc"), "type": "function_call", "status": "completed",
                **{name: item[name] for name in ("call_id", "name", "arguments")}}
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            if not all(isinstance(p, dict) and _is_text_part(p) for p in output):
                raise invalid(f"{where}.output", "only text output parts are supported")
            output = "".join(p["text"] for p in output)
        if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
            raise invalid(where, f"{where} must have a call_id and an output, both strings")
        return {"id": new_id("fco"), "type": "function_call_output", "status": "completed",
                "call_id": item["call_id"], "output": output}
    raise invalid(where, f"{json.dumps(kind)[:60]} items are not supported; this platform takes message, "
                         "function_call and function_call_output items", code="unsupported_value")


def _messages(items: list[dict], wheres: list[str], instructions: Any) -> tuple[list[dict], list[str]]:
    """The chat messages of stored items, and where each came from ("instructions", or the item's
    origin): a model's calls in a row are one assistant message."""
    messages, origins = [], []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "instructions must be a string")
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    for item, where in zip(items, wheres):
        if item["type"] == "message":
            role, text = _message(item, where)
            messages.append({"role": role, "content": text})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (origins[-1] == INHERITED) == (where == INHERITED):
                last.setdefault("tool_calls", []).append(call)  # one more call of the message before it
                continue
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        origins.append(where)
    return messages, origins


def _message(item: dict, where: str) -> tuple[str, str]:
    """A message item's role and text."""
    role, content = item.get("role"), item.get("content")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise invalid(f"{where}.role", f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and _is_text_part(part)):
                raise invalid(f"{where}.content[{j}]", "only input_text and output_text content parts are supported")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise invalid(f"{where}.content", f"{where}.content must be a string or an array of text parts")
    return role, content


def _is_text_part(part: dict) -> bool:
    kind = part.get("type")
    return isinstance(kind, str) and kind in TEXT_PARTS and isinstance(part.get("text"), str)


def _logprobs(include: Any, top: Any) -> dict:
    """Chat's logprobs settings: asked for by ``include``, or by a ``top_logprobs`` above 0."""
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(name, str) for name in include):
        raise invalid("include", "include must be an array of strings")
    for i, name in enumerate(include):
        if name not in INCLUDES:
            raise invalid(f"include[{i}]", f"include[{i}]: {json.dumps(name)[:80]} is not one of "
                                           f"{', '.join(sorted(INCLUDES))}")
    if top is not None and (type(top) is not int or not 0 <= top <= 20):
        raise invalid("top_logprobs", "top_logprobs must be an integer from 0 to 20")
    if LOGPROBS in include or top:
        return {"logprobs": True, "top_logprobs": top or 0}
    return {}


def _tools(tools: Any) -> Any:
    """Chat's nesting of the flat Responses tools (``{"type": "function", "name", ...}``)."""
    if not isinstance(tools, list):
        return tools  # chat's check names it
    nested = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(f"tools[{i}]", f"tools[{i}] is a {json.dumps(kind)[:60]} tool; this platform calls "
                                         "functions only", code="unsupported_value")
        nested.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return nested


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _format(text: Any) -> Any:
    """Chat's response_format for ``text: {"format": ...}``."""
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise invalid("text", 'text must be {"format": {...}}')
    fmt = text.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        for name in ("name", "schema"):  # chat's may go without its schema; this API's may not
            if name not in fmt:
                raise invalid(f"text.format.{name}", f"text.format.{name} is required for a json_schema format",
                              code="missing_required_parameter")
        spec = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


def renamed(exc: ApiError, origins: list[str]) -> ApiError:
    """``exc`` naming what the client sent: the input item (or instructions) a message came
    from, max_output_tokens, text.format."""
    def origin(match: re.Match) -> str:
        index = int(match.group(1))
        return origins[index] if index < len(origins) else "input"

    if exc.param:
        exc.param = MESSAGE.sub(origin, exc.param)
        exc.param = "input" if exc.param == "messages" else exc.param
        if exc.param.startswith(INHERITED + "."):  # what the stored conversation lacks: input must add it
            exc.param = "input"
    exc.message = MESSAGE.sub(origin, exc.message).replace("messages:", "input:")
    for pattern, words in TOOL_WORDS:
        exc.message = pattern.sub(words, exc.message)
        exc.param = exc.param and pattern.sub(words, exc.param)
    for chat_name, name in RENAMED.items():
        if exc.param and exc.param.startswith(chat_name):
            exc.param = name + exc.param[len(chat_name):]
        exc.message = exc.message.replace(chat_name, name)
    return exc


def _settings(body: dict, *, store: bool) -> dict:
    """What a response repeats of its request."""
    return {
        "previous_response_id": body.get("previous_response_id"),
        "store": store,
        "top_logprobs": body.get("top_logprobs") or 0,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
    }
