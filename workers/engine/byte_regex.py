"""Regular expressions as automata over the bytes of a JSON string's content: JSON Schema's
``pattern``, and the ``format``s that have one (date-time, uuid, email, ...).

A pattern compiles to an NFA whose edges read bytes; a character outside ASCII is the UTF-8
sequence of bytes it is written as, and "any character" (``.``, ``\\S``, ``[^a]``) includes every
one of them. The text is written unescaped, so the characters a JSON string must escape (``"``,
``\\``, control characters) are never allowed: a pattern that needs one matches nothing here and
is refused. Each state knows the fewest and the most characters that can still lead to a match,
which lets a string's length bounds apply beside the pattern without leading into a dead end.

The syntax is ECMAScript's, as JSON Schema's: alternation, groups (also ``(?:``, named), classes
with ranges, ``\\d \\w \\s`` and their negations, ``.``, ``* + ? {n} {n,} {n,m}`` (lazy ones too),
``\\xHH``, ``\\uHHHH``, and ``^``/``$`` at the ends (a pattern matches anywhere in the string
unless anchored). Lookarounds, backreferences and word boundaries are refused.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

MAX_STATES = 5000
MAX_REPEAT = 1000
# Bytes a JSON string may hold as they are: printable ASCII but the quote and the backslash.
_PLAIN = frozenset(range(0x20, 0x80)) - {0x22, 0x5C}
_DIGIT = frozenset(range(0x30, 0x3A))
_WORD = _DIGIT | frozenset(range(0x41, 0x5B)) | frozenset(range(0x61, 0x7B)) | {0x5F}
_SPACE = frozenset(b" \t\n\r\f\v")
# A character outside ASCII, in strict UTF-8: per lead bytes, the ranges of the bytes that follow.
_UTF8 = (((0xC2, 0xDF), ((0x80, 0xBF),)),
         ((0xE0, 0xE0), ((0xA0, 0xBF), (0x80, 0xBF))),
         ((0xE1, 0xEC), ((0x80, 0xBF), (0x80, 0xBF))),
         ((0xED, 0xED), ((0x80, 0x9F), (0x80, 0xBF))),
         ((0xEE, 0xEF), ((0x80, 0xBF), (0x80, 0xBF))),
         ((0xF0, 0xF0), ((0x90, 0xBF), (0x80, 0xBF), (0x80, 0xBF))),
         ((0xF1, 0xF3), ((0x80, 0xBF), (0x80, 0xBF), (0x80, 0xBF))),
         ((0xF4, 0xF4), ((0x80, 0x8F), (0x80, 0xBF), (0x80, 0xBF))))

# Formats as patterns: what a JSON Schema validator, pydantic and most parsers accept.
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?"
_ZONE = r"(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
FORMATS = {
    "date-time": f"^{_DATE}T{_TIME}{_ZONE}$",
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}{_ZONE}?$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "email": r"^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63})*\.[A-Za-z]{2,24}$",
    "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$",
    "hostname": r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$",
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]*:[^\s]+$",
}
# An ISO 8601 duration (pydantic's timedelta): at least one part after P, and after T.
FORMATS["duration"] = (r"^-?P((\d+Y(\d+M)?(\d+W)?(\d+D)?|\d+M(\d+W)?(\d+D)?|\d+W(\d+D)?|\d+D)"
                       r"(T(\d+H(\d+M)?(\d+(\.\d+)?S)?|\d+M(\d+(\.\d+)?S)?|\d+(\.\d+)?S))?"
                       r"|T(\d+H(\d+M)?(\d+(\.\d+)?S)?|\d+M(\d+(\.\d+)?S)?|\d+(\.\d+)?S))$")


class RegexError(ValueError):
    """A pattern this module cannot compile; the message says why."""


@dataclass(eq=False)
class ByteRegex:
    """A compiled pattern. States are ints; a reading is the frozenset of states alive."""

    pattern: str
    edges: list[list[tuple[int, int, int]]]  # per state: (low byte, high byte, target)
    closure: list[frozenset[int]]  # per state: the states its empty edges reach, itself included
    accept: int
    start: frozenset[int]
    min_left: list[int]  # per state: the fewest characters still to write to match
    max_left: list[float]  # the most (inf: any number)

    def step(self, states: frozenset[int], b: int) -> frozenset[int]:
        out: set[int] = set()
        for state in states:
            for low, high, target in self.edges[state]:
                if low <= b <= high:
                    out |= self.closure[target]
        return frozenset(out)

    def matches(self, states: frozenset[int]) -> bool:
        return self.accept in states

    def fits(self, states: frozenset[int], length: int, low: int, high: int | None) -> bool:
        """Whether a match can still end with between ``low`` and ``high`` characters, ``length``
        of them written."""
        return any((high is None or length + self.min_left[s] <= high) and length + self.max_left[s] >= low
                   for s in states)


def compile_format(name: str) -> ByteRegex:
    if name not in FORMATS:
        raise RegexError(f"the format {name!r} is not supported (supported: {', '.join(FORMATS)})")
    return compile_pattern(FORMATS[name])


def compile_pattern(pattern: str) -> ByteRegex:
    if not isinstance(pattern, str):
        raise RegexError("a pattern must be a string")
    tree = _Parser(pattern).parse()
    return _Builder(pattern).build(tree)


# -- parsing ------------------------------------------------------------------------------------
# The tree: ("set", bytes frozenset, any non-ASCII character too: bool), ("seq", bytes) for one
# non-ASCII character, ("cat", [..]), ("alt", [..]), ("rep", tree, least, most or None).


class _Parser:
    def __init__(self, pattern: str):
        self.text = pattern
        self.at = 0

    def parse(self):
        text = self.text
        start = 1 if text.startswith("^") else 0
        end = len(text) - 1 if text.endswith("$") and not _escaped_at(text, len(text) - 1) and len(text) > start else len(text)
        self.text, self.at = text[:end], start
        tree = self._alternation()
        if self.at != len(self.text):
            raise RegexError(f"unexpected {self.text[self.at]!r} at {self.at}")
        anything = ("rep", ("set", _PLAIN, True), 0, None)
        parts = ([] if start else [anything]) + [tree] + ([] if end < len(text) else [anything])
        return ("cat", parts)

    def _peek(self) -> str | None:
        return self.text[self.at] if self.at < len(self.text) else None

    def _take(self) -> str:
        if self.at >= len(self.text):
            raise RegexError("the pattern ends too early")
        self.at += 1
        return self.text[self.at - 1]

    def _alternation(self):
        options = [self._sequence()]
        while self._peek() == "|":
            self.at += 1
            options.append(self._sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def _sequence(self):
        items = []
        while self._peek() not in (None, "|", ")"):
            items.append(self._quantified(self._atom()))
        return ("cat", items)

    def _quantified(self, atom):
        while True:
            c = self._peek()
            if c in ("*", "+", "?"):
                self.at += 1
                atom = ("rep", atom, 0 if c != "+" else 1, 1 if c == "?" else None)
            elif c == "{" and self._bounds() is not None:
                least, most = self._bounds(consume=True)
                atom = ("rep", atom, least, most)
            else:
                return atom
            if self._peek() == "?":  # lazy: the same strings
                self.at += 1

    def _bounds(self, consume: bool = False):
        close = self.text.find("}", self.at)
        if close < 0:
            return None
        inside = self.text[self.at + 1:close]
        low, comma, high = inside.partition(",")
        if not low.isdigit() or (high and not high.isdigit()):
            return None
        least, most = int(low), (int(high) if high else None) if comma else int(low)
        if (most is not None and most < least) or max(least, most or 0) > MAX_REPEAT:
            raise RegexError(f"the repeat {{{inside}}} is out of range (at most {MAX_REPEAT})")
        if consume:
            self.at = close + 1
        return least, most

    def _atom(self):
        c = self._take()
        if c == "(":
            if self.text.startswith("?:", self.at):
                self.at += 2
            elif self.text.startswith("?<", self.at) and not self.text.startswith(("?<=", "?<!"), self.at) \
                    or self.text.startswith("?P<", self.at):
                close = self.text.find(">", self.at)
                if close < 0:
                    raise RegexError("a group's name is not closed with >")
                self.at = close + 1
            elif self._peek() == "?":
                raise RegexError(f"lookarounds and inline flags are not supported (at {self.at - 1})")
            tree = self._alternation()
            if self._peek() != ")":
                raise RegexError("a group is not closed")
            self.at += 1
            return tree
        if c == "[":
            return self._class()
        if c == ".":
            return ("set", _PLAIN, True)
        if c == "\\":
            return self._escape(in_class=False)
        if c in ("^", "$"):
            raise RegexError(f"{c} is supported only at the ends of the pattern")
        if c in ("*", "+", "?", ")"):
            raise RegexError(f"nothing to repeat, or an unopened group, at {self.at - 1}")
        return _char(c)

    def _escape(self, *, in_class: bool):
        c = self._take()
        classes = {"d": (_DIGIT, False), "w": (_WORD, False), "s": (_SPACE & _PLAIN, False)}
        if c.lower() in classes:
            members, _ = classes[c.lower()]
            return ("set", members, False) if c.islower() else ("set", _PLAIN - members, True)
        if c in "bB" and not in_class or c.isdigit() and c != "0" or c in "kcpP":
            raise RegexError(f"\\{c} (word boundaries, backreferences, Unicode properties) is not supported")
        if c in "xu":
            digits = 2 if c == "x" else 4
            code = self.text[self.at:self.at + digits]
            if len(code) != digits or any(d not in "0123456789abcdefABCDEF" for d in code):
                raise RegexError(f"\\{c} needs {digits} hex digits")
            self.at += digits
            value = int(code, 16)
            low = self.text[self.at + 2:self.at + 6] if self.text.startswith("\\u", self.at) else ""
            if 0xD800 <= value < 0xDC00 and len(low) == 4 and all(d in "0123456789abcdefABCDEF" for d in low) \
                    and 0xDC00 <= int(low, 16) < 0xE000:  # a UTF-16 pair, as JavaScript spells an emoji
                self.at += 6
                value = 0x10000 + ((value - 0xD800) << 10) + (int(low, 16) - 0xDC00)
            return _char(chr(value))
        controls = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "b": "\b"}
        return _char(controls.get(c, c))

    def _class(self):
        negate = self._peek() == "^"
        if negate:
            self.at += 1
        members: set[int] = set()
        non_ascii = False
        first = True
        while True:
            c = self._take()
            if c == "]" and not first:
                break
            first = False
            item = self._escape(in_class=True) if c == "\\" else _char(c)
            if self._peek() == "-" and self.at + 1 < len(self.text) and self.text[self.at + 1] != "]":
                self.at += 1
                d = self._take()
                high = self._escape(in_class=True) if d == "\\" else _char(d)
                if item[0] != "set" or high[0] != "set" or len(item[1]) != 1 or len(high[1]) != 1:
                    raise RegexError("a range in a class must join two ASCII characters")
                low_b, high_b = min(item[1]), min(high[1])
                if high_b < low_b:
                    raise RegexError(f"the class range {chr(low_b)}-{chr(high_b)} is backwards")
                members |= set(range(low_b, high_b + 1))
                continue
            if item[0] == "seq":
                raise RegexError("non-ASCII characters in a class are not supported")
            members |= item[1]
            non_ascii = non_ascii or item[2]
        if negate:
            return ("set", _PLAIN - members, not non_ascii)
        return ("set", frozenset(members) & _PLAIN, non_ascii)


def _char(c: str):
    if ord(c) < 0x80:
        return ("set", frozenset({ord(c)}) & _PLAIN, False)
    if 0xD800 <= ord(c) < 0xE000:
        raise RegexError(f"the pattern holds half of a UTF-16 pair (\\u{ord(c):04x}), which is no character")
    return ("seq", c.encode("utf-8"))


def _escaped_at(text: str, at: int) -> bool:
    backslashes = 0
    while at - backslashes - 1 >= 0 and text[at - backslashes - 1] == "\\":
        backslashes += 1
    return backslashes % 2 == 1


# -- building -----------------------------------------------------------------------------------


class _Builder:
    def __init__(self, pattern: str):
        self.pattern = pattern
        self.edges: list[list[tuple[int, int, int]]] = []
        self.empty: list[list[int]] = []
        self.first_byte: list[bool] = []  # whether a state's edges start a character

    def state(self, first: bool = True) -> int:
        if len(self.edges) >= MAX_STATES:
            raise RegexError(f"the pattern is too large (more than {MAX_STATES} states)")
        self.edges.append([])
        self.empty.append([])
        self.first_byte.append(first)
        return len(self.edges) - 1

    def build(self, tree) -> ByteRegex:
        start = self.state()
        accept = self.add(tree, start)
        closure = [self._closure(s) for s in range(len(self.edges))]
        alive = self._co_reachable(accept, closure)
        if not any(s in alive for s in closure[start]):
            raise RegexError("the pattern matches no string that JSON writes without escapes (it needs a quote, "
                             "a backslash or a control character)")
        edges = [[e for e in out if e[2] in alive] for out in self.edges]
        closure = [frozenset(s for s in c if s in alive) for c in closure]
        min_left, max_left = self._distances(accept, edges, closure)
        return ByteRegex(self.pattern, edges, closure, accept, closure[start], min_left, max_left)

    def add(self, tree, source: int) -> int:
        """Wire ``tree`` from ``source``; returns the state where it ends."""
        kind = tree[0]
        if kind == "set":
            target = self.state()
            for low, high in _ranges(tree[1]):
                self.edges[source].append((low, high, target))
            if tree[2]:
                self._any_non_ascii(source, target)
            return target
        if kind == "seq":
            at = source
            for i, b in enumerate(tree[1]):
                nxt = self.state(first=i == len(tree[1]) - 1)
                self.edges[at].append((b, b, nxt))
                at = nxt
            return at
        if kind == "cat":
            for part in tree[1]:
                source = self.add(part, source)
            return source
        if kind == "alt":
            end = self.state()
            for option in tree[1]:
                self.empty[self.add(option, source)].append(end)
            return end
        _, inner, least, most = tree
        for _ in range(least):
            source = self.add(inner, source)
        if most is None:
            loop = self.state()
            self.empty[source].append(loop)
            self.empty[self.add(inner, loop)].append(loop)
            return loop
        end = self.state()
        for _ in range(most - least):
            self.empty[source].append(end)
            source = self.add(inner, source)
        self.empty[source].append(end)
        return end

    def _any_non_ascii(self, source: int, target: int) -> None:
        for (lead_low, lead_high), follow in _UTF8:
            at = self.state(first=False)
            self.edges[source].append((lead_low, lead_high, at))
            for i, (low, high) in enumerate(follow):
                nxt = target if i == len(follow) - 1 else self.state(first=False)
                self.edges[at].append((low, high, nxt))
                at = nxt

    def _closure(self, state: int) -> frozenset[int]:
        seen, stack = {state}, [state]
        while stack:
            for nxt in self.empty[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return frozenset(seen)

    def _co_reachable(self, accept: int, closure: list[frozenset[int]]) -> set[int]:
        into: dict[int, set[int]] = {}
        for s in range(len(self.edges)):
            for t in closure[s]:
                into.setdefault(t, set()).add(s)
            for _, _, t in self.edges[s]:
                into.setdefault(t, set()).add(s)
        alive, stack = {accept}, [accept]
        while stack:
            for s in into.get(stack.pop(), ()):
                if s not in alive:
                    alive.add(s)
                    stack.append(s)
        return alive

    def _distances(self, accept, edges, closure) -> tuple[list[int], list[float]]:
        """Per state, the fewest and most characters on a way to ``accept`` (a byte that starts
        a character counts one; one that continues it, none; every loop writes characters)."""
        n = len(edges)
        moves = [{t2 for _, _, t in edges[s] for t2 in closure[t]} for s in range(n)]
        weight = [1 if self.first_byte[s] else 0 for s in range(n)]
        into: list[list[int]] = [[] for _ in range(n)]
        for s in range(n):
            for t in moves[s]:
                into[t].append(s)
        # Fewest: a 0-1 breadth-first search backwards from the states that may end here.
        low = [math.inf] * n
        queue = deque(s for s in range(n) if accept in closure[s])
        for s in queue:
            low[s] = 0
        while queue:
            t = queue.popleft()
            for s in into[t]:
                if low[t] + weight[s] < low[s]:
                    low[s] = low[t] + weight[s]
                    queue.appendleft(s) if weight[s] == 0 else queue.append(s)
        # Most: states are settled once all they lead to is; those never settled reach a loop.
        high = [math.inf] * n
        waiting = [len(moves[s]) for s in range(n)]
        ready = [s for s in range(n) if not waiting[s]]
        while ready:
            s = ready.pop()
            ends = [0.0] if accept in closure[s] else []
            high[s] = max(ends + [high[t] + weight[s] for t in moves[s]], default=-math.inf)
            for p in into[s]:
                waiting[p] -= 1
                if not waiting[p]:
                    ready.append(p)
        return [int(v) if v != math.inf else 0 for v in low], high


def _ranges(members: frozenset[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for b in sorted(members):
        if out and out[-1][1] == b - 1:
            out[-1] = (out[-1][0], b)
        else:
            out.append((b, b))
    return out
