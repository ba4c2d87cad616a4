"""Regular expressions as automata over the bytes of a JSON string's content: JSON Schema's
``pattern``, and the ``format``s that have one (date-time, uuid, email, ...).

A pattern compiles to an NFA whose edges read bytes: a character class is a set of code points,
written as the UTF-8 byte ranges that spell them, so ``.``, ``\\S`` or ``[^a]`` include every
character outside ASCII they should, and no broken UTF-8. The text is written unescaped, so the
characters a JSON string must escape (``"``, ``\\``, control characters) are never allowed: a
pattern that needs one matches nothing here and is refused. Each state knows the lengths (in
characters) that can still lead to a match, so that a string's length bounds apply beside the
pattern without leading into a dead end.

The syntax and meaning are ECMAScript's, as JSON Schema's: alternation, groups (also ``(?:``,
named), classes with ranges, ``\\d \\w \\s`` and their negations, ``.``, ``* + ? {n} {n,} {n,m}``
(lazy ones too), ``\\xHH``, ``\\uHHHH``, and ``^``/``$`` at the ends of the pattern or of its
top-level alternatives (a pattern matches anywhere in the string unless anchored). Lookarounds,
backreferences, word boundaries and unknown letter escapes are refused.
"""

from __future__ import annotations

import functools
import math
from decimal import Decimal
from collections import deque
from dataclasses import dataclass, field

MAX_STATES = 5000
MAX_CLOSURE = 100_000  # empty-edge links summed over states: (a?){1000} makes a million
MAX_REPEAT = 1000
MAX_CODE = 0x10FFFF
# Code points a JSON string may hold as they are: printable ASCII but the quote and the
# backslash, and every character outside ASCII (surrogates are no characters).
_PLAIN = ((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x7F), (0x80, 0xD7FF), (0xE000, MAX_CODE))
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))  # ECMAScript's \s
_LINE_ENDS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))  # what ``.`` does not match

# Formats as patterns: the values validators, pydantic and the common parsers accept.
_YEAR = r"(000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d{3})"
_LEAP_YEAR = r"(\d\d(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = r"((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8]))"
_DATE = f"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?"
_ZONE = r"(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_PORT = r"(:([1-9]\d{0,3}|[1-5]\d{4}|6[0-4]\d{3}|65[0-4]\d\d|655[0-2]\d|6553[0-5]))?"
_N = r"\d{1,6}"  # a duration's number: pydantic refuses huge ones
_CLOCK = f"T({_N}H({_N}M)?({_N}(\\.\\d{{1,6}})?S)?|{_N}M({_N}(\\.\\d{{1,6}})?S)?|{_N}(\\.\\d{{1,6}})?S)"
_HEX = "[0-9a-fA-F]"
FORMATS = {
    "date-time": f"^{_DATE}T{_TIME}{_ZONE}$",
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}{_ZONE}?$",
    "duration": f"^-?P(({_N}Y({_N}M)?({_N}W)?({_N}D)?|{_N}M({_N}W)?({_N}D)?|{_N}W({_N}D)?|{_N}D)({_CLOCK})?|{_CLOCK})$",
    "uuid": f"^{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}$",
    "email": f"^[A-Za-z0-9_%+-]{{1,32}}(\\.[A-Za-z0-9_%+-]{{1,32}}){{0,3}}@({_LABEL}\\.){{1,4}}[A-Za-z]{{2,24}}$",
    "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$",
    "hostname": f"^{_LABEL}(\\.{_LABEL})*$",
    "uri": f"^[A-Za-z][A-Za-z0-9+.-]*://({_LABEL}(\\.{_LABEL})*|\\[[0-9a-fA-F:.]{{2,45}}\\]){_PORT}([/?#]\\S*)?$",
}
for _version in range(1, 9):  # pydantic's UUID1 ... UUID8
    FORMATS[f"uuid{_version}"] = f"^{_HEX}{{8}}-{_HEX}{{4}}-{_version}{_HEX}{{3}}-[89abAB]{_HEX}{{3}}-{_HEX}{{12}}$"


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
    moves: list[set[int]] = field(repr=False, default_factory=list)  # per state: the states one byte reaches
    starts_char: list[bool] = field(repr=False, default_factory=list)  # whether its edges read a first byte
    _lengths: dict[int, list[int]] = field(repr=False, default_factory=dict)  # see lengths_left
    _steps: dict[tuple[frozenset[int], int], frozenset[int]] = field(repr=False, default_factory=dict)

    def step(self, states: frozenset[int], b: int) -> frozenset[int]:
        key = (states, b)
        found = self._steps.get(key)
        if found is None:
            out: set[int] = set()
            for state in states:
                for low, high, target in self.edges[state]:
                    if low <= b <= high:
                        out |= self.closure[target]
            found = frozenset(out)
            if len(self._steps) > 20_000:  # a bounded memo: a small DFA, built as it is used
                self._steps.clear()
            self._steps[key] = found
        return found

    def matches(self, states: frozenset[int]) -> bool:
        return self.accept in states

    def fits(self, states: frozenset[int], length: int, low: int, high: int | None) -> bool:
        """Whether a match can still end with between ``low`` and ``high`` characters, ``length``
        of them written."""
        if high is not None and length > high:
            return False
        if high is not None and low > 0 and high - low < len(self.edges):
            # A narrow window may fall in a gap of the lengths a state leads to: ask exactly.
            least = max(0, low - length)
            window = ((1 << (high - length + 1)) - 1) >> least << least
            lengths = self.lengths_left(high)
            return any(lengths[s] & window for s in states)
        return any((high is None or length + self.min_left[s] <= high) and length + self.max_left[s] >= low
                   for s in states)

    def lengths_left(self, most: int) -> list[int]:
        """Per state, the numbers of characters (up to ``most``) that lead to a match, as bits."""
        if most not in self._lengths:
            n, mask = len(self.edges), (1 << (most + 1)) - 1
            into: list[list[int]] = [[] for _ in range(n)]
            for s in range(n):
                for t in self.moves[s]:
                    into[t].append(s)
            bits = [1 if self.accept in self.closure[s] else 0 for s in range(n)]
            work = deque(s for s in range(n) if bits[s])
            while work:
                t = work.popleft()
                for s in into[t]:
                    grown = bits[s] | ((bits[t] << self.starts_char[s]) & mask)
                    if grown != bits[s]:
                        bits[s] = grown
                        work.append(s)
            self._lengths[most] = bits
        return self._lengths[most]


def compile_format(name: str) -> ByteRegex:
    if not isinstance(name, str) or name not in FORMATS:
        raise RegexError(f"the format {name!r} is not supported (supported: {', '.join(FORMATS)})")
    return compile_pattern(FORMATS[name])


def compile_pattern(pattern: str) -> ByteRegex:
    if not isinstance(pattern, str):
        raise RegexError("a pattern must be a string")
    return _compiled(pattern)


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> ByteRegex:
    try:
        tree = _Parser(pattern).parse()
        return _Builder(pattern).build(tree)
    except RecursionError:
        raise RegexError("the pattern's groups are nested too deep") from None


# -- parsing ------------------------------------------------------------------------------------
# The tree: ("class", code point ranges), ("cat", [..]), ("alt", [..]), ("rep", tree, least,
# most or None), and, parsed only at the ends of top-level alternatives, ("^",) and ("$",).

_ESCAPES = {"t": 0x09, "n": 0x0A, "v": 0x0B, "f": 0x0C, "r": 0x0D, "0": 0x00}
_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}


class _Parser:
    def __init__(self, pattern: str):
        self.text = pattern
        self.at = 0
        self.depth = 0

    def parse(self):
        options = self._alternation()
        if self.at != len(self.text):
            raise RegexError(f"unexpected {self.text[self.at]!r} at {self.at}")
        anything = ("rep", ("class", _PLAIN), 0, None)
        anchored = []
        for option in options:  # a top-level alternative matches anywhere unless anchored
            items = option[1]
            head = [] if items[:1] == [("^",)] else [anything]
            tail = [] if items[-1:] == [("$",)] else [anything]
            anchored.append(("cat", head + [i for i in items if i[0] not in "^$"] + tail))
        return anchored[0] if len(anchored) == 1 else ("alt", anchored)

    def _peek(self) -> str | None:
        return self.text[self.at] if self.at < len(self.text) else None

    def _take(self) -> str:
        if self.at >= len(self.text):
            raise RegexError("the pattern ends too early")
        self.at += 1
        return self.text[self.at - 1]

    def _alternation(self) -> list:
        options = [self._sequence()]
        while self._peek() == "|":
            self.at += 1
            options.append(self._sequence())
        return options

    def _sequence(self):
        items = []
        while self._peek() not in (None, "|", ")"):
            items.append(self._quantified(self._atom(first=not items)))
        return ("cat", items)

    def _quantified(self, atom):
        quantified = False
        while True:
            c = self._peek()
            bounds = self._bounds() if c == "{" else None
            if c not in ("*", "+", "?") and bounds is None:
                return atom
            if quantified or atom[0] in "^$":
                raise RegexError(f"nothing to repeat at {self.at}")
            if bounds is None:
                self.at += 1
                atom = ("rep", atom, 0 if c != "+" else 1, 1 if c == "?" else None)
            else:
                self.at = self.text.index("}", self.at) + 1
                atom = ("rep", atom, *bounds)
            quantified = True
            if self._peek() == "?":  # lazy: the same strings
                self.at += 1

    def _bounds(self):
        """``{n}``, ``{n,}`` or ``{n,m}`` at the cursor (None: a literal brace)."""
        close = self.text.find("}", self.at, self.at + 12)
        if close < 0:
            return None
        low, comma, high = self.text[self.at + 1:close].partition(",")
        if not _digits(low) or (high and not _digits(high)):
            return None
        least, most = int(low), (int(high) if high else None) if comma else int(low)
        if (most is not None and most < least) or max(least, most or 0) > MAX_REPEAT:
            raise RegexError(f"the repeat {self.text[self.at:close + 1]} is out of range (at most {MAX_REPEAT})")
        return least, most

    def _atom(self, *, first: bool):
        c = self._take()
        if c == "(":
            if self.text.startswith("?:", self.at):
                self.at += 2
            elif self.text.startswith(("?<", "?P<"), self.at) and not self.text.startswith(("?<=", "?<!"), self.at):
                close = self.text.find(">", self.at)
                if close < 0 or close == self.text.index("<", self.at) + 1:
                    raise RegexError("a group's name is missing or not closed with >")
                self.at = close + 1
            elif self._peek() == "?":
                raise RegexError(f"lookarounds and inline flags are not supported (at {self.at - 1})")
            self.depth += 1
            options = self._alternation()
            self.depth -= 1
            if self._peek() != ")":
                raise RegexError("a group is not closed")
            self.at += 1
            return options[0] if len(options) == 1 else ("alt", options)
        if c == "[":
            return ("class", self._class())
        if c == ".":
            return ("class", _minus(_PLAIN, _LINE_ENDS))
        if c == "\\":
            return ("class", self._escape(in_class=False))
        if c == "^" and first and not self.depth:
            return ("^",)
        if c == "$" and not self.depth and self._peek() in (None, "|"):
            return ("$",)
        if c in ("^", "$"):
            raise RegexError(f"{c} is supported only at the ends of the pattern or of its top-level alternatives")
        if c in ("*", "+", "?", ")"):
            raise RegexError(f"nothing to repeat, or an unopened group, at {self.at - 1}")
        return ("class", _point(ord(c)))

    def _escape(self, *, in_class: bool) -> tuple:
        """The code point ranges an escape stands for (after the backslash)."""
        c = self._take()
        if c.lower() in _CLASS_ESCAPES:
            members = _CLASS_ESCAPES[c.lower()]
            return members if c.islower() else _minus(((0, MAX_CODE),), members)
        if c == "b" and in_class:
            return _point(0x08)
        if c in _ESCAPES and not (c == "0" and (self._peek() or "").isdigit()):
            return _point(_ESCAPES[c])
        if c in "xu":
            return _point(self._hex(c))
        if c.isascii() and c.isalnum():
            raise RegexError(f"\\{c} is not supported (escapes for word boundaries, backreferences, "
                             "Unicode properties and anchors such as \\A are not; ^ and $ are)")
        return _point(ord(c))

    def _hex(self, c: str) -> int:
        digits = 2 if c == "x" else 4
        code = self.text[self.at:self.at + digits]
        if len(code) != digits or not all(d in "0123456789abcdefABCDEF" for d in code):
            raise RegexError(f"\\{c} needs {digits} hex digits")
        self.at += digits
        value = int(code, 16)
        low = self.text[self.at + 2:self.at + 6] if self.text.startswith("\\u", self.at) else ""
        if 0xD800 <= value < 0xDC00 and len(low) == 4 and all(d in "0123456789abcdefABCDEF" for d in low) \
                and 0xDC00 <= int(low, 16) < 0xE000:  # a UTF-16 pair, as JavaScript spells an emoji
            self.at += 6
            value = 0x10000 + ((value - 0xD800) << 10) + (int(low, 16) - 0xDC00)
        return value

    def _class(self) -> tuple:
        negate = self._peek() == "^"
        if negate:
            self.at += 1
        ranges: list[tuple[int, int]] = []
        while True:
            c = self._take()
            if c == "]":  # ECMAScript's: [] matches nothing, [^] any character
                break
            item = self._escape(in_class=True) if c == "\\" else _point(ord(c))
            if self._peek() == "-" and self.at + 1 < len(self.text) and self.text[self.at + 1] != "]":
                self.at += 1
                d = self._take()
                high = self._escape(in_class=True) if d == "\\" else _point(ord(d))
                if len(item) != 1 or len(high) != 1 or item[0][0] != item[0][1] or high[0][0] != high[0][1]:
                    raise RegexError("a range in a class must join two characters")
                if high[0][0] < item[0][0]:
                    raise RegexError(f"the class range {chr(item[0][0])}-{chr(high[0][0])} is backwards")
                ranges.append((item[0][0], high[0][0]))
            else:
                ranges.extend(item)
        return _minus(((0, MAX_CODE),), ranges) if negate else _merge(ranges)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 4


def _point(code: int) -> tuple:
    if 0xD800 <= code < 0xE000:
        raise RegexError(f"the pattern holds half of a UTF-16 pair (\\u{code:04x}), which is no character")
    return ((code, code),)


def _merge(ranges) -> tuple:
    out: list[list[int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], high)
        else:
            out.append([low, high])
    return tuple((low, high) for low, high in out)


def _minus(ranges, removed) -> tuple:
    out, removed = [], _merge(removed)
    for low, high in _merge(ranges):
        for r_low, r_high in removed:
            if r_high < low or r_low > high:
                continue
            if r_low > low:
                out.append((low, r_low - 1))
            low = max(low, r_high + 1)
            if low > high:
                break
        if low <= high:
            out.append((low, high))
    return tuple(out)


def _intersect(ranges, kept) -> tuple:
    return _minus(ranges, _minus(((0, MAX_CODE),), kept))


def _utf8(low: int, high: int) -> list[list[tuple[int, int]]]:
    """Code points low..high (no surrogates) as UTF-8: sequences of byte ranges, each sequence
    matching a run of them byte by byte."""
    for limit in (0x7F, 0x7FF, 0xFFFF):  # one byte length each
        if low <= limit < high:
            return _utf8(low, limit) + _utf8(limit + 1, high)
    if high < 0x80:
        return [[(low, high)]]
    for i in range(1, 4):  # split until the bytes after the first differing one span all values
        m = (1 << (6 * i)) - 1
        if low & ~m != high & ~m:
            if low & m:
                return _utf8(low, low | m) + _utf8((low | m) + 1, high)
            if high & m != m:
                return _utf8(low, (high & ~m) - 1) + _utf8(high & ~m, high)
    return [list(zip(chr(low).encode(), chr(high).encode()))]


# -- building -----------------------------------------------------------------------------------


class _Builder:
    def __init__(self, pattern: str):
        self.pattern = pattern
        self.edges: list[list[tuple[int, int, int]]] = []
        self.empty: list[list[int]] = []
        self.starts_char: list[bool] = []  # whether a state's edges read a character's first byte

    def state(self, starts_char: bool = True) -> int:
        if len(self.edges) >= MAX_STATES:
            raise RegexError(f"the pattern is too large (more than {MAX_STATES} states)")
        self.edges.append([])
        self.empty.append([])
        self.starts_char.append(starts_char)
        return len(self.edges) - 1

    def build(self, tree) -> ByteRegex:
        start = self.state()
        accept = self.add(tree, start)
        closure = self._closures()
        alive = self._co_reachable(accept, closure)
        if not any(s in alive for s in closure[start]):
            raise RegexError("the pattern matches no string that JSON writes without escapes (it needs a quote, "
                             "a backslash or a control character)")
        edges = [[e for e in out if e[2] in alive] for out in self.edges]
        closure = [frozenset(s for s in c if s in alive) for c in closure]
        moves = [{t2 for _, _, t in edges[s] for t2 in closure[t]} for s in range(len(edges))]
        min_left, max_left = self._distances(accept, moves, closure)
        return ByteRegex(self.pattern, edges, closure, accept, closure[start], min_left, max_left,
                         moves=moves, starts_char=self.starts_char)

    def add(self, tree, source: int) -> int:
        """Wire ``tree`` from ``source``; returns the state where it ends."""
        kind = tree[0]
        if kind == "class":
            target = self.state()
            for low, high in _intersect(tree[1], _PLAIN):
                for sequence in _utf8(low, high):
                    at = source
                    for i, (b_low, b_high) in enumerate(sequence):
                        nxt = target if i == len(sequence) - 1 else self.state(starts_char=False)
                        self.edges[at].append((b_low, b_high, nxt))
                        at = nxt
            return target
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

    def _closures(self) -> list[frozenset[int]]:
        closures, total = [], 0
        for state in range(len(self.edges)):
            seen, stack = {state}, [state]
            while stack:
                for nxt in self.empty[stack.pop()]:
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            total += len(seen)
            if total > MAX_CLOSURE:
                raise RegexError("the pattern is too complex (optional parts nested in repeats)")
            closures.append(frozenset(seen))
        return closures

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

    def _distances(self, accept, moves, closure) -> tuple[list[int], list[float]]:
        """Per state, the fewest and most characters on a way to ``accept`` (a byte that starts
        a character counts one; one that continues it, none; every loop writes characters)."""
        n = len(moves)
        weight = [1 if self.starts_char[s] else 0 for s in range(n)]
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


# -- integer ranges ------------------------------------------------------------------------------


def integer_pattern(low: int | None, high: int | None) -> str:
    """An anchored pattern of the JSON integers from ``low`` to ``high`` (None: no bound), as
    JSON writes them: no leading zeros, no "-0"."""
    if low is not None and high is not None and low > high:
        raise RegexError(f"no integer is at least {low} and at most {high}")
    options = []
    if high is None or high >= 0:  # the non-negative ones
        options += _naturals(max(low or 0, 0), high)
    if low is None or low < 0:  # the negative ones, by magnitude
        magnitudes = _naturals(1 if high is None or high >= 0 else -high, None if low is None else -low)
        options.append("-(" + "|".join(magnitudes) + ")")
    return "^(" + "|".join(options) + ")$"


def _naturals(low: int, high: int | None) -> list[str]:
    """Alternatives matching the integers low..high (high None: no end), low >= 0."""
    out = []
    while high is None or len(str(low)) < len(str(high)):
        width = len(str(low))
        out += _between(str(low), "9" * width)
        if high is None:
            return out + [f"[1-9]\\d{{{width},}}"]
        low = 10 ** width
    return out + _between(str(low), str(high))


def _between(low: str, high: str) -> list[str]:
    """Alternatives matching the digit strings of one length from ``low`` to ``high``."""
    if low > high:
        return []
    if low == high:
        return [low]
    same = next(i for i, (a, b) in enumerate(zip(low, high)) if a != b)
    prefix, rest = low[:same], len(low) - same - 1
    first, last = low[same], high[same]
    out = []
    if low[same + 1:] != "0" * rest:  # the part that starts at low's digit
        out += [prefix + first + tail for tail in _between(low[same + 1:], "9" * rest)]
        first = chr(ord(first) + 1)
    top = []
    if high[same + 1:] != "9" * rest:  # the part that ends at high's digit
        top = [prefix + last + tail for tail in _between("0" * rest, high[same + 1:])]
        last = chr(ord(last) - 1)
    if first <= last:
        out.append(prefix + f"[{first}-{last}]" + (f"\\d{{{rest}}}" if rest else ""))
    return out + top


def decimal_pattern(low: Decimal | int | None, high: Decimal | int | None, *, low_open: bool = False,
                    high_open: bool = False) -> str:
    """An anchored pattern of the JSON numbers without exponent between ``low`` and ``high``
    (None: no bound; ``*_open``: the bound itself excluded). A bound may have a fraction; its
    digits bound the pattern's size, so one of more than ``MAX_BOUND_DIGITS`` is refused."""
    low, high = (None if b is None else _checked_bound(b) for b in (low, high))
    if low is not None and high is not None and (low > high or (low == high and (low_open or high_open))):
        raise RegexError(f"no number lies between {_plain(low)} and {_plain(high)}")
    options = []
    if high is None or high > 0 or (high == 0 and not high_open):  # zero and up
        at_least_zero = low is not None and low >= 0
        options += _unsigned(low if at_least_zero else Decimal(0), at_least_zero and low_open, high, high_open)
    if low is None or low < 0:  # below zero, by magnitude, which is never 0 ("-0" is no number a writer makes)
        below_zero = high is not None and high < 0
        options.append("-(" + "|".join(_unsigned(-high if below_zero else Decimal(0), high_open or not below_zero,
                                                 None if low is None else -low, low_open)) + ")")
    return "^(" + "|".join(options) + ")$"


MAX_BOUND_DIGITS = 20  # of a number's bound, either side of its point: 2**64 has 20


def _checked_bound(bound: Decimal | int) -> Decimal:
    value = Decimal(bound)
    if not value.is_finite():
        raise RegexError(f"a bound must be a finite number, not {bound}")
    whole, fraction = _parts(abs(value))
    if len(str(whole)) > MAX_BOUND_DIGITS or len(fraction) > MAX_BOUND_DIGITS:
        raise RegexError(f"the bound {_plain(value)} has more digits than this engine bounds ({MAX_BOUND_DIGITS})")
    return value


def _plain(value: Decimal) -> str:
    return format(value.normalize(), "f")


def _parts(value: Decimal) -> tuple[int, str]:
    """A non-negative number's integer part and its fraction's digits, without trailing zeros."""
    whole = int(value)
    return whole, _plain(value - whole).partition(".")[2].rstrip("0")


def _unsigned(low: Decimal, low_open: bool, high: Decimal | None, high_open: bool) -> list[str]:
    """Alternatives matching the unsigned decimals from ``low`` to ``high`` (0 <= low <= high)."""
    low_whole, low_fraction = _parts(low)
    if high is not None:
        high_whole, high_fraction = _parts(high)
        if high_whole == low_whole:  # one integer part: its fraction has both bounds
            return _with_fraction(str(low_whole), low_fraction, low_open, high_fraction, high_open)
    out = []
    end = None if high is None else high_whole - 1  # the integer parts whose every fraction is in
    if end is None or low_whole + 1 <= end:
        out += [f"({n})(\\.\\d+)?" for n in _naturals(low_whole + 1, end)]
    out += _with_fraction(str(low_whole), low_fraction, low_open, None, False)
    if high is not None:
        out += _with_fraction(str(high_whole), None, False, high_fraction, high_open)
    return out


def _with_fraction(whole: str, low: str | None, low_open: bool, high: str | None, high_open: bool) -> list[str]:
    """Alternatives of the integer part ``whole`` and the fractions between ``low`` and ``high``
    (see ``_fraction``); none if no fraction is."""
    digits, bare = _fraction(low, low_open, high, high_open)
    out = [whole] if bare else []
    if digits:
        out.append(whole + "\\.(" + "|".join(digits) + ")")
    return out


@functools.lru_cache(maxsize=4096)
def _fraction(low: str | None, low_open: bool, high: str | None, high_open: bool) -> tuple[tuple[str, ...], bool]:
    """The fraction digit strings ``f`` with ``0.low <= 0.f <= 0.high`` (< where open; None: that
    side is already met by the integer part; bounds are written without trailing zeros): the
    alternatives matching the non-empty ones, and whether no fraction at all (a zero) is in."""
    bare = (low is None or (low == "" and not low_open)) and (high is None or high != "" or not high_open)
    if low is None and high is None:
        return (r"\d+",), bare
    if high is None and low == "":  # at the lower bound's end: any digits, but some nonzero one if open
        return ((r"\d*[1-9]\d*",) if low_open else (r"\d+",)), bare
    if high == "":  # at the upper bound's end: zeros only, and nothing if it is open or below the lower
        return (() if high_open or low or (low == "" and low_open) else ("0+",)), bare
    out, free = [], []  # free: first digits after which any digits do
    for digit in "0123456789":
        next_low = low if low is None else None if digit > (low[:1] or "0") else low[1:] if digit == (low[:1] or "0") else "-"
        next_high = high if high is None else None if digit < high[0] else high[1:] if digit == high[0] else "-"
        if "-" in (next_low, next_high):
            continue
        if next_low is None and next_high is None:
            free.append(digit)
            continue
        rest, empty = _fraction(next_low, low_open, next_high, high_open)
        if rest:
            out.append(digit + "(" + "|".join(rest) + ")" + ("?" if empty else ""))
        elif empty:
            out.append(digit)
    if free:
        out.append((free[0] if len(free) == 1 else f"[{free[0]}-{free[-1]}]") + r"\d*")
    return tuple(out), bare
