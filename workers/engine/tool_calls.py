"""Tool calls: how a model is told about functions, how it writes a call, and reading calls back.

A call is written the way Hermes-style models (Qwen2.5, Hermes 2/3 and others) are trained to:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several in a row, one per line, when parallel calls are allowed. The functions are described in a
system message; earlier calls and their results are written back into the conversation in the same
form (results inside ``<tool_response>`` tags, as a user turn, which every chat template accepts).

Nothing here trusts the model to follow the form: a ``ToolGrammar`` makes the sampler write it
exactly, with the arguments following the function's ``parameters`` schema (see ``json_grammar``).
With ``tool_choice="auto"`` the reply is free text until the model writes ``<tool_call>``, and from
there on the grammar holds (with a response_format, it is that JSON or calls); ``"required"`` starts with a call; a named function allows that one
alone; ``"none"`` allows text that never opens a call. ``ToolCallParser`` reads such a reply, streamed or whole, back into text and calls.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from .json_grammar import JsonGrammar, Matcher, SchemaError, compile_schema, only_objects, run_readings, \
    start_states, states_done, step_states

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names: no JSON escaping
MAX_TOOLS = 128  # OpenAI's limit
CHOICES = ("none", "auto", "required")

_HEAD = '\n{{"name": "{name}", "arguments": '  # what follows OPEN, up to the arguments' value
_TAIL = "}\n" + CLOSE
_SEPARATOR = "\n"  # between two calls


# -- the prompt ---------------------------------------------------------------------------------


def tools_prompt(tools: list[dict]) -> str:
    """The system text that describes ``tools`` ({"name", "description", "parameters"}) and the
    form of a call."""
    lines = [json.dumps({"type": "function", "function": tool}, ensure_ascii=False) for tool in tools]
    return ("# Tools\n\nYou may call one or more of these functions to help with the request. Their "
            "signatures, one per line, are inside <tools></tools>:\n<tools>\n" + "\n".join(lines) +
            "\n</tools>\n\nTo call a function, write a JSON object with its name and its arguments "
            f"between {OPEN}{CLOSE} tags:\n{OPEN}\n" + '{"name": "function_name", "arguments": {...}}' +
            f"\n{CLOSE}")


def chat_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` in a form chat templates render, even those that want user and assistant
    turns to alternate: the tools described in the system message, an assistant's ``tool_calls``
    written as the model writes them, ``tool`` results (with a user message right after them)
    as one user turn. Messages without tools pass through unchanged."""
    out: list[dict] = []
    results = False  # whether out[-1] is a user turn of tool results
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"])
                              for c in message["tool_calls"])
            content = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool" or (role == "user" and results and isinstance(message.get("content"), str)):
            text = message.get("content") or ""
            if role == "tool":
                text = f"<tool_response>\n{text}\n</tool_response>"
            if results:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id", "name")})
        results = role == "tool" or (results and role == "user")
    if tools:
        described = tools_prompt(tools)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (``arguments``: JSON text)."""
    return OPEN + _HEAD.format(name=name) + arguments.strip() + _TAIL


# -- the grammar --------------------------------------------------------------------------------


@dataclass(eq=False)
class ToolGrammar:
    """What a reply may be: ``free`` text first (tool_choice "auto"), then calls of ``tools``
    (name, compiled arguments schema); one call, or a run of them when ``parallel``. With an
    ``answer`` (a response_format), a free reply is either that JSON or calls, not text."""

    tools: tuple[tuple[str, JsonGrammar], ...]
    free: bool
    parallel: bool
    answer: JsonGrammar | None = None

    @property
    def needs_end(self) -> bool:
        """Whether a reply needs the end-of-sequence token to end (text alone can run to max_tokens)."""
        return bool(self.tools)

    def matcher(self) -> "ToolCallMatcher":
        return ToolCallMatcher(self)


def tool_grammar_for(tools: list[dict], choice: Any, parallel: bool, answer: JsonGrammar | None = None) -> ToolGrammar:
    """The grammar of a reply to ``tools`` under ``tool_choice``, compiled once per distinct set;
    a SchemaError names the tool whose parameters cannot be followed. ``answer``: the JSON a reply
    that calls nothing must be (tool_choice "auto" with a response_format)."""
    if choice == "none":
        return NO_CALLS
    try:
        key = json.dumps([[t["name"], t.get("parameters")] for t in tools])  # not sorted: arguments keep their order
    except (TypeError, ValueError, RecursionError, KeyError) as exc:
        raise SchemaError(f"tools must be JSON: {str(exc)[:100]}") from None
    named = choice.get("name") if isinstance(choice, dict) else None
    grammar = _compiled(key, named, choice == "auto", bool(parallel) and named is None)
    return grammar if answer is None or not grammar.free else _answering(grammar, answer)


@functools.lru_cache(maxsize=64)
def _answering(grammar: ToolGrammar, answer: JsonGrammar) -> ToolGrammar:
    return ToolGrammar(grammar.tools, grammar.free, grammar.parallel, answer)


# tool_choice "none": the model sees the tools (a prompt the same as the turns that may call
# them, so the prefix cache holds) and writes text that never opens a call.
NO_CALLS = ToolGrammar((), free=True, parallel=False)


@functools.lru_cache(maxsize=64)
def _compiled(key: str, named: str | None, free: bool, parallel: bool) -> ToolGrammar:
    compiled = []
    for i, (name, parameters) in enumerate(json.loads(key)):
        if named is not None and name != named:
            continue
        try:
            root = compile_schema(parameters or {"type": "object"})  # none, or {}: any object
        except SchemaError as exc:
            raise SchemaError(f"tools[{i}] ({name}): {exc}") from None
        if not only_objects(root):  # arguments are an object, as OpenAI's and every client expect
            raise SchemaError(f'tools[{i}] ({name}): parameters must describe an object ("type": "object")')
        compiled.append((name, JsonGrammar(root)))
    if not compiled:
        raise SchemaError(f"tool_choice names {named!r}, which is not in tools")
    return ToolGrammar(tuple(compiled), free, parallel)


# A thread is one reading of the reply so far:
#   ("free", k)              free text whose last k bytes begin OPEN
#   ("json", states)         inside the answer (the JSON automaton's states)
#   ("lit", text, at, then)  inside a fixed text, ``at`` of its bytes matched; then: the index of
#                            the tool whose arguments follow, or _END
#   ("args", i, states)      inside tool i's arguments (the JSON automaton's states)
#   ("end",)                 after a whole call: the reply may end, or another call follow
_END = -1


class ToolCallMatcher(Matcher):
    """Where one reply stands in its ``ToolGrammar``."""

    def __init__(self, grammar: ToolGrammar):
        self.grammar = grammar
        self._open = OPEN.encode()
        self._heads = [(OPEN + _HEAD.format(name=name)).encode() for name, _ in grammar.tools]
        self._tail = _TAIL.encode()
        if grammar.answer is not None:  # the JSON answer, or calls from the first byte ('{' or '<')
            starts = (("json", start_states(grammar.answer)),) + self._call_starts(0)
        else:
            starts = (("free", 0),) if grammar.free else self._call_starts(0)
        super().__init__(starts)

    @property
    def done(self) -> bool:
        """Whether the reply may end here: free text, a whole answer, or after a whole call."""
        return any(t[0] in ("free", "end") or (t[0] == "json" and states_done(t[1])) for t in self.states)

    @property
    def stops_apply(self) -> bool:
        """Whether a stop string may end the reply here: in free text or the answer (the caller
        asked for it), not inside the calls."""
        return any(t[0] in ("free", "json") for t in self.states)

    def _call_starts(self, at: int) -> tuple:
        """A call of any of the tools, ``at`` bytes into its head (which names the tool)."""
        return tuple(("lit", head, at, i) for i, head in enumerate(self._heads))

    def _run(self, threads: tuple, data: bytes) -> tuple:
        return run_readings(threads, data, self._step)

    def _step(self, thread: tuple, b: int) -> list | tuple:
        kind = thread[0]
        if kind == "free":
            matched = self._open[:thread[1]] + bytes((b,))
            while matched and not self._open.startswith(matched):
                matched = matched[1:]
            if len(matched) == len(self._open):  # the model opened a call: the grammar holds from here
                return self._call_starts(len(self._open))
            return [("free", len(matched))]
        if kind == "lit":
            _, text, at, then = thread
            if text[at] != b:
                return ()
            if at + 1 < len(text):
                return [("lit", text, at + 1, then)]
            if then == _END:
                return [("end",)]
            return [("args", then, start_states(self.grammar.tools[then][1]))]
        if kind == "end":
            return self._call_starts(0) if self.grammar.parallel and b == ord(_SEPARATOR) else ()
        if kind == "json":
            following = step_states(thread[1], bytes((b,)))
            return [("json", following)] if following else ()
        _, i, states = thread
        out = []
        following = step_states(states, bytes((b,)))
        if following:
            out.append(("args", i, following))
        if states_done(states) and b == self._tail[0]:  # the arguments are whole: the call closes
            out.append(("lit", self._tail, 1, _END))
        return out


# -- reading calls back ---------------------------------------------------------------------------

_HEAD_START, _HEAD_END = _HEAD.format(name="\0").split("\0")
_HEAD_TEXT = re.compile(re.escape(_HEAD_START) + f"({NAME.pattern})" + re.escape(_HEAD_END))


class ToolCallParser:
    """Splits a reply, fed as it streams, into text and calls. ``feed`` returns events:

        ("text", str)                 text for the message's content
        ("call", index, name)         a call begins
        ("arguments", index, str)     more of that call's arguments (JSON text)

    Text that may be the start of ``<tool_call>`` is held back until it is known not to be, and
    so is trailing whitespace (the line break before a call is no part of the text). A call cut
    before its name is whole is dropped; a reply that breaks the form (which a guided one cannot)
    is text from where it broke."""

    def __init__(self, *, text: bool = True) -> None:
        """``text``: whether the reply may hold text (tool_choice "auto"); without, what is held
        back at the end is the start of a cut call's tag, and goes nowhere."""
        self.calls: list[dict] = []  # {"name", "arguments"} so far
        self._free = text
        self._buffer = ""
        self._state = "text"  # text | head | args | tail | between
        self._gap = ""  # the whitespace between the text and a call's tag
        self._depth = 0
        self._in_string = self._escaped = False

    def feed(self, text: str) -> list[tuple]:
        self._buffer += text
        events: list[tuple] = []
        while self._buffer and self._advance(events):
            pass
        return events

    def finish(self) -> list[tuple]:
        """The events of what is still held back once the reply has ended."""
        events: list[tuple] = []
        if self._state == "text" and self._free:
            self._text(events, self._buffer)
        self._buffer = ""
        return events

    @property
    def whole(self) -> bool:
        """Whether the reply so far ends outside any call (not cut inside one)."""
        return self._state in ("text", "between")

    def _advance(self, events: list) -> bool:
        """Move on through the buffer; False when it must wait for more."""
        buffer = self._buffer
        if self._state == "text":
            at = buffer.find(OPEN)
            if at < 0:
                keep = next((n for n in range(min(len(OPEN) - 1, len(buffer)), 0, -1)
                             if OPEN.startswith(buffer[-n:])), 0)
                cut = len(buffer[:len(buffer) - keep].rstrip())
                self._text(events, buffer[:cut])
                self._buffer = buffer[cut:]
                return False
            before = buffer[:at].rstrip()
            self._text(events, before)
            self._gap = buffer[len(before):at]  # the whitespace held before the tag
            return self._go("head", buffer[at + len(OPEN):])
        if self._state == "head":
            found = _HEAD_TEXT.match(buffer)
            if found:
                self.calls.append({"name": found.group(1), "arguments": ""})
                events.append(("call", len(self.calls) - 1, found.group(1)))
                self._depth, self._in_string, self._escaped = 0, False, False
                return self._go("args", buffer[found.end():])
            if _may_become_head(buffer):
                return False
            events.append(("text", self._gap + OPEN))  # not a call after all: the tag was text
            return self._go("text", buffer)
        if self._state == "args":
            end = self._scan(buffer)
            piece = buffer if end is None else buffer[:end]
            self.calls[-1]["arguments"] += piece
            events.append(("arguments", len(self.calls) - 1, piece))
            return self._go("args" if end is None else "tail", "" if end is None else buffer[end:])
        if self._state == "tail":
            if buffer.startswith(_TAIL):
                return self._go("between", buffer[len(_TAIL):])
            return not _TAIL.startswith(buffer) and self._go("text", buffer)
        following = _SEPARATOR + OPEN  # between: another call, or the form is broken
        if buffer.startswith(following):
            return self._go("head", buffer[len(following):])
        return not following.startswith(buffer) and self._go("text", buffer)

    def _go(self, state: str, rest: str) -> bool:
        self._state, self._buffer = state, rest
        return True

    @staticmethod
    def _text(events: list, text: str) -> None:
        if text:
            events.append(("text", text))

    def _scan(self, text: str) -> int | None:
        """Where the arguments' JSON value ends in ``text`` (None: not in it)."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


def _may_become_head(text: str) -> bool:
    if len(text) <= len(_HEAD_START):
        return _HEAD_START.startswith(text)
    if not text.startswith(_HEAD_START):
        return False
    rest = text[len(_HEAD_START):]
    name = re.match(r"[A-Za-z0-9_-]*", rest).group()
    return len(name) <= 64 and _HEAD_END.startswith(rest[len(name):])


def parse_tool_calls(text: str, *, free: bool = True) -> tuple[str, list[dict]]:
    """A whole reply's text and calls ({"name", "arguments"}); ``free`` as ``ToolCallParser``'s ``text``."""
    parser = ToolCallParser(text=free)
    events = parser.feed(text) + parser.finish()
    return "".join(e[1] for e in events if e[0] == "text"), parser.calls
