"""JSON output: a byte-level automaton that accepts exactly the texts a ``response_format`` allows.

OpenAI's ``{"type": "json_object"}`` (any JSON object) and ``{"type": "json_schema"}`` (a value of
a JSON Schema's shape) compile into a ``JsonGrammar``, shared by every request that asks for the
same format; each such request keeps a ``JsonMatcher``, which says whether a token's bytes may come
next and moves on as tokens are taken. The sampler asks it only about the tokens it was about to
pick, best first, so a step costs a few checks, not one per vocabulary entry.

The automaton is a pushdown one over bytes, nondeterministic where the schema is (``anyOf``, a
type list): its state is the set of stacks still alive. The values of an ``enum`` and the
declared keys of an object are matched as one set each, so they cost one stack, not one per
value. A stack is a tuple of frames, each a small tuple:

    ("v", node, after_colon)            a value of ``node`` comes next
    ("o", node, seen, phase, value)     inside an object; phase "{" "," "k" ":" "a" (after a
                                        member) or "}" (only the close may come); ``seen``: the
                                        keys so far (their JSON text); ``value``: the node of the
                                        key just read
    ("a", node, count, phase)           inside an array; phase "[" "," "a" or "]"
    ("s", escape, utf8, length, node, key)
                                        inside a string of ``length`` characters; ``utf8``: 0 or
                                        (bytes still due, range of the next one); ``node``: the
                                        string's when it bounds the length; ``key``: the text so
                                        far of an undeclared key (None for a value)
    ("k", keys, at)                     inside a declared key: the candidates' JSON texts, ``at``
                                        bytes matched
    ("p", node, states, length)         inside a string with a pattern or format: the states of
                                        its regex (see byte_regex), ``length`` characters written
    ("r", node, states)                 inside a number with bounds or multipleOf: the states of
                                        the range's pattern (see byte_regex.integer_pattern,
                                        decimal_pattern), with what number_text keeps
    ("n", integer, phase)               inside a number
    ("l", texts, at)                    inside a literal (true, false, null, an enum's values)

Whitespace goes only where a JSON writer puts it (see ``_blank``), and a run of it is bounded
(``MAX_WS_BYTES``, ``MAX_WS_LINES``): a model that cannot write the token it wanted would
otherwise pad with newlines, and small ones left free to indent do so until max_tokens.

No prefix the automaton accepts is a dead end: whatever it took, a whole value can still follow.
Schemas make sure of it at compile time (every part must have a finite value); the nesting limit
only closes off objects and arrays where any value may go, and the cap on live stacks drops
interpretations, never all of them.
"""

from __future__ import annotations

import functools
import json
import math
from decimal import Decimal
from dataclasses import dataclass, field
from typing import Any, Iterable

from .byte_regex import RegexError, compile_format, compile_pattern, decimal_pattern, integer_pattern
from .number_text import DOUBLE_DIGITS, NumberText

MAX_WS_BYTES = 48
MAX_WS_LINES = 2
_SPACE_RUN, _SPACES, _TABS = 1 << 8, 2 << 8, 3 << 8  # a whitespace run's kind (see _run_after)
MAX_DEPTH = 32  # objects and arrays nested where any value may go; schemas nested
MAX_CHOICES = 1000  # an enum's values, an object's properties (OpenAI's limits are of this order)
MAX_PARTS = 5000  # subschemas and enum values in one schema: compiling stays in milliseconds
MAX_ALTERNATIVES = 512  # live stacks kept; the rest of an ambiguous schema's readings are dropped

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_NUMBER_ENDS = "0ifx"  # the number phases a number may end in (see _number)
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "strict",
                "discriminator"}  # pydantic's, beside the oneOf that does the work
_KEYWORDS = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "items",
                            "minItems", "maxItems", "minLength", "maxLength", "enum", "const", "anyOf",
                            "oneOf", "$ref", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
                            "exclusiveMaximum", "multipleOf"}
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
_DEF_TABLES = ("$defs", "definitions")


class SchemaError(ValueError):
    """A response format this engine cannot follow; the message says where and why."""


@dataclass(eq=False)
class Node:
    """One schema position. Compared and hashed by identity: frames hold nodes."""

    kind: str  # any | object | array | string | number | integer | literal | anyof | ref
    where: str = "#"
    properties: dict[bytes, "Node"] = field(default_factory=dict)  # key's JSON text -> node, in the schema's order
    required: frozenset[bytes] = frozenset()
    additional: "Node | None" = None  # the node of keys not declared; None: none allowed
    items: "Node | None" = None
    min_items: int = 0
    max_items: int | None = None
    min_length: int = 0  # a string's, in characters
    max_length: int | None = None
    literals: tuple[bytes, ...] = ()  # a literal's possible JSON texts
    options: tuple["Node", ...] = ()
    regex: Any = None  # a string's pattern or format (byte_regex.ByteRegex)
    target: str = ""  # a ref's definition ("$defs/name"; "" for the root)
    defs: dict[str, "Node"] | None = None  # a ref's table


ANY = Node("any")
ANY_OBJECT = Node("object", additional=ANY)
ANY_ARRAY = Node("array", items=ANY)
ANY_STRING = Node("string")
ANY_NUMBER = Node("number")
ANY_LITERAL = Node("literal", literals=(b"true", b"false", b"null"))


@dataclass(eq=False)
class JsonGrammar:
    """A compiled response format; ``matcher()`` starts a request on it."""

    root: Node
    needs_end = True  # a value is whole only once the end-of-sequence token says so

    def matcher(self) -> "JsonMatcher":
        return JsonMatcher(self)

    @classmethod
    def from_response_format(cls, response_format: Any) -> "JsonGrammar | None":
        """OpenAI's ``response_format``: None for plain text; a SchemaError when it is malformed
        or asks for what the automaton cannot enforce."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise SchemaError("must be an object such as {\"type\": \"json_object\"}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(ANY_OBJECT)
        if kind != "json_schema":
            raise SchemaError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise SchemaError("json_schema must be an object with a 'schema'")
        schema = spec.get("schema", {})
        return cls(compile_schema(schema))


def grammar_for(response_format: Any) -> JsonGrammar | None:
    """``JsonGrammar.from_response_format``, compiled once per distinct format: the gateway's
    check and every request asking for the same one share it."""
    try:
        key = json.dumps(response_format)  # not sorted: properties are written in the schema's order
    except (TypeError, ValueError, RecursionError) as exc:
        raise SchemaError(f"must be JSON nested at most {MAX_DEPTH} deep: {str(exc)[:100]}") from None
    return _compiled(key)


@functools.lru_cache(maxsize=64)
def _compiled(key: str) -> JsonGrammar | None:
    return JsonGrammar.from_response_format(json.loads(key))


# -- compiling a schema -------------------------------------------------------------------------


def compile_schema(schema: Any) -> Node:
    """A JSON Schema (the subset OpenAI's structured outputs use) as automaton nodes."""
    try:
        return _compile(schema)
    except RecursionError:  # a chain of thousands of references: no schema a person writes
        raise SchemaError("the schema's references are chained too deep") from None


def _compile(schema: Any) -> Node:
    if not isinstance(schema, (dict, bool)):
        raise SchemaError("json_schema.schema must be a JSON Schema object")
    raw_defs: dict[str, Any] = {}
    if isinstance(schema, dict):
        for table in _DEF_TABLES:
            entries = schema.get(table, {})
            if not isinstance(entries, dict):
                raise SchemaError(f"{table} must be an object")
            raw_defs.update({f"{table}/{name}": value for name, value in entries.items()})
    defs: dict[str, Node] = {}
    compiler = _Compiler(defs, raw_defs)
    root = compiler.node(schema, "#")
    defs[""] = root
    for name, raw in raw_defs.items():
        defs[name] = compiler.node(raw, f"#/{name}")
    _check_refs(root, defs)
    _check_finite(root)
    return root


class _Compiler:
    def __init__(self, defs: dict[str, Node], raw_defs: dict[str, Any]):
        self.defs = defs
        self.raw_defs = raw_defs
        self.parts = 0

    def count(self, parts: int, where: str) -> None:
        self.parts += parts
        if self.parts > MAX_PARTS:
            raise SchemaError(f"{where}: a schema of more than {MAX_PARTS} parts (subschemas and enum values; a "
                              "multipleOf counts as the states of its remainders times its decimal places plus two) is not supported")

    def node(self, schema: Any, where: str, depth: int = 0) -> Node:
        if depth > MAX_DEPTH:
            raise SchemaError(f"{where}: schemas nested more than {MAX_DEPTH} deep are not supported")
        self.count(1, where)
        if schema is True or schema == {}:
            return ANY
        if schema is False:
            raise SchemaError(f"{where}: the schema false allows no value")
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object")
        unknown = sorted(set(schema) - _KEYWORDS)
        if unknown:
            raise SchemaError(f"{where}: the keyword {unknown[0]!r} is not supported (supported: type, "
                              "properties, required, additionalProperties, items, minItems, maxItems, "
                              "minLength, maxLength, pattern, format, minimum, maximum, multipleOf, enum, "
                              "const, anyOf, oneOf, $ref, $defs)")
        meaningful = set(schema) - _ANNOTATIONS
        for key in ("$ref", "anyOf", "oneOf"):
            if key in schema and meaningful != {key}:
                other = sorted(meaningful - {key})[0]
                raise SchemaError(f"{where}: {key} beside {other!r} is not supported (put {other!r} "
                                  f"inside each {'option' if key != '$ref' else 'definition'})")
        if "$ref" in schema:
            return self._ref(schema["$ref"], where)
        for key in ("anyOf", "oneOf"):  # oneOf as anyOf: the output matches at least one
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise SchemaError(f"{where}: {key} must be a non-empty list")
                return Node("anyof", where, options=tuple(self.node(o, f"{where}/{key}/{i}", depth + 1)
                                                          for i, o in enumerate(options)))
        types = schema.get("type")
        if isinstance(types, str):
            types = [types]
        if types is not None and (not isinstance(types, list) or not types or any(t not in _TYPES for t in types)):
            raise SchemaError(f"{where}: type must be one of {', '.join(_TYPES)} (or a list of them)")
        if "const" in schema or "enum" in schema:
            return self._literal(schema, types, where)
        if types is None:
            types = ["object"] if "properties" in schema or "additionalProperties" in schema else \
                ["array"] if "items" in schema else list(_TYPES)
        nodes = [self._typed(schema, t, where, depth) for t in dict.fromkeys(types)]
        return nodes[0] if len(nodes) == 1 else Node("anyof", where, options=tuple(nodes))

    def _literal(self, schema: dict, types: list[str] | None, where: str) -> Node:
        if {"const", "enum"} <= set(schema) or set(schema) - _ANNOTATIONS - {"const", "enum", "type"}:
            raise SchemaError(f"{where}: enum and const take no other keyword than type")
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values or len(values) > MAX_CHOICES:
            raise SchemaError(f"{where}: enum must be a list of 1 to {MAX_CHOICES} values")
        self.count(len(values), where)
        if types is not None:
            values = [v for v in values if _type_of(v) in types or (_type_of(v) == "integer" and "number" in types)]
            if not values:
                raise SchemaError(f"{where}: no value of the enum is of type {', '.join(types)}")
        return Node("literal", where, literals=tuple(dict.fromkeys(_encode(v, where) for v in values)))

    def _typed(self, schema: dict, kind: str, where: str, depth: int) -> Node:
        if kind == "object":
            return self._object(schema, where, depth)
        if kind == "array":
            items = self.node(schema.get("items", True), f"{where}/items", depth + 1)
            low, high = _bounds(schema, "minItems", "maxItems", where)
            return Node("array", where, items=items, min_items=low, max_items=high)
        if kind == "string":
            low, high = _bounds(schema, "minLength", "maxLength", where)
            regex = _regex(schema, low, high, where)
            if regex is not None:  # a large pattern costs what a tenth as many subschemas do
                self.count(len(regex.edges) // 10, where)
            return Node("string", where, min_length=low, max_length=high, regex=regex)
        if kind == "boolean":
            return Node("literal", where, literals=(b"true", b"false"))
        if kind == "null":
            return Node("literal", where, literals=(b"null",))
        if any(schema.get(name) is not None for name in (*_NUMBER_BOUNDS, "multipleOf")):  # digits that follow
            regex = compile_pattern(_range_pattern(schema, kind, where))                   # the range's pattern
            if kind == "number" or schema.get("multipleOf") is not None:
                regex = _number_text(regex, schema.get("multipleOf"), kind, where)
            self.count(len(regex.edges) // 10 + getattr(regex, "cost", 0), where)
            return Node(kind, where, regex=regex)
        return Node(kind, where)  # pattern and format constrain strings alone (JSON Schema's rule)

    def _object(self, schema: dict, where: str, depth: int) -> Node:
        properties = schema.get("properties", {})
        if not isinstance(properties, dict) or len(properties) > MAX_CHOICES:
            raise SchemaError(f"{where}: properties must be an object of at most {MAX_CHOICES} properties")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{where}: required must be a list of property names")
        missing = [r for r in required if r not in properties]
        if missing:
            raise SchemaError(f"{where}: required names {missing[0]!r}, which is not in properties")
        additional = schema.get("additionalProperties")
        if additional is None:  # undeclared keys only where the schema declares none
            extra = None if properties else ANY
        elif additional is False:
            extra = None
        else:
            extra = self.node(additional, f"{where}/additionalProperties", depth + 1)
        return Node("object", where, additional=extra,
                    properties={_encode(name, where): self.node(sub, f"{where}/properties/{name}", depth + 1)
                                for name, sub in properties.items()},
                    required=frozenset(_encode(r, where) for r in required))

    def _ref(self, ref: Any, where: str) -> Node:
        if ref == "#":
            return Node("ref", where, target="", defs=self.defs)
        for table in _DEF_TABLES:
            prefix = f"#/{table}/"
            if isinstance(ref, str) and ref.startswith(prefix) and ref[2:] in self.raw_defs:
                return Node("ref", where, target=ref[2:], defs=self.defs)
        raise SchemaError(f"{where}: $ref {ref!r} must name '#' or an entry of $defs")


def _regex(schema: dict, low: int, high: int | None, where: str):
    """A string's ``pattern`` or ``format`` compiled (None without either)."""
    pattern, named = schema.get("pattern"), schema.get("format")
    if pattern is None and named is None:
        return None
    if pattern is not None and named is not None:
        raise SchemaError(f"{where}: pattern beside format is not supported (use one)")
    try:
        regex = compile_pattern(pattern) if pattern is not None else compile_format(named)
    except RegexError as exc:
        raise SchemaError(f"{where}: {'pattern' if pattern is not None else 'format'}: {exc}") from None
    if not regex.fits(regex.start, 0, low, high):
        raise SchemaError(f"{where}: no string of the pattern fits minLength/maxLength")
    return regex


def _range_pattern(schema: dict, kind: str, where: str) -> str:
    """The pattern of the integers, or of the numbers (written without an exponent), that
    ``minimum``, ``maximum`` and their exclusive forms allow."""
    low = high = None  # (value, open)
    for name in _NUMBER_BOUNDS:
        value = schema.get(name)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) \
                or (isinstance(value, float) and not math.isfinite(value)):
            raise SchemaError(f"{where}: {name} must be a number")
        if abs(value) > 2**64:  # (an int may be too large to be a float)
            raise SchemaError(f"{where}: {name} is beyond what this engine bounds (2**64)")
        if kind == "integer":  # the nearest integer inside, the bound included
            bound = (math.ceil(value) if name == "minimum" else math.floor(value) + 1 if name == "exclusiveMinimum"
                     else math.floor(value) if name == "maximum" else math.ceil(value) - 1, False)
        else:
            bound = (_exact(value), name.startswith("exclusive"))
        if name.endswith("inimum"):  # the stricter of two: the larger, an open one on a tie
            low = bound if low is None or (bound[0], bound[1]) > low else low
        else:
            high = bound if high is None or (-bound[0], bound[1]) > (-high[0], high[1]) else high
    try:
        if kind == "integer":
            return integer_pattern(low and low[0], high and high[0])
        return decimal_pattern(low and low[0], high and high[0], low_open=bool(low and low[1]),
                               high_open=bool(high and high[1]))
    except RegexError as exc:
        raise SchemaError(f"{where}: {exc}") from None


def _number_text(regex, multiple: Any, kind: str, where: str) -> NumberText:
    """A bounded number read for its ``multipleOf``, and, not being an integer, for what a double
    holds: a reader parses it into one (see number_text)."""
    if multiple is not None and (not isinstance(multiple, (int, float)) or isinstance(multiple, bool)
                                 or (isinstance(multiple, float) and not math.isfinite(multiple)) or multiple <= 0):
        raise SchemaError(f"{where}: multipleOf must be a number greater than 0")
    try:
        return NumberText(regex, multiple=None if multiple is None else _exact(multiple),
                          digits=DOUBLE_DIGITS if kind == "number" else None)
    except RegexError as exc:
        raise SchemaError(f"{where}: {exc}") from None


def _exact(value: int | float) -> Decimal:
    """A schema's number as the schema wrote it: 0.1 is one tenth, not the binary float nearest it."""
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "")


def _bounds(schema: dict, low_name: str, high_name: str, where: str) -> tuple[int, int | None]:
    low, high = schema.get(low_name, 0), schema.get(high_name)
    for name, value in ((low_name, low), (high_name, high)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise SchemaError(f"{where}: {name} must be a non-negative integer")
    if high is not None and high < low:
        raise SchemaError(f"{where}: {high_name} is below {low_name}")
    return low, high


def _encode(value: Any, where: str) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except (ValueError, UnicodeEncodeError, RecursionError) as exc:  # NaN, a lone surrogate, depth
        raise SchemaError(f"{where}: {str(exc)[:100]}") from None


def only_objects(node: Node) -> bool:
    """Whether every value ``node`` allows is a JSON object."""
    node = _resolve(node)
    if node.kind == "anyof":
        return all(only_objects(option) for option in node.options)
    if node.kind == "literal":
        return all(text.startswith(b"{") for text in node.literals)
    return node.kind == "object"


def _resolve(node: Node) -> Node:
    while node.kind == "ref":
        node = node.defs[node.target]
    return node


def _children(node: Node) -> list[Node]:
    out = list(node.properties.values()) + list(node.options)
    for child in (node.additional, node.items):
        if child is not None:
            out.append(child)
    if node.kind == "ref":
        out.append(node.defs[node.target])
    return out


def _check_refs(root: Node, defs: dict[str, Node]) -> None:
    """A reference must reach a value before it reaches itself again: a definition that is only
    a reference to itself, or an anyOf one of whose options leads back to it, has none."""
    done: set[int] = set()

    def visit(node: Node, path: set[int]) -> None:
        if id(node) in done:
            return
        if id(node) in path:
            raise SchemaError(f"{node.where}: a $ref refers to itself before any value (through $ref or anyOf alone)")
        path.add(id(node))
        if node.kind == "ref":
            visit(defs[node.target], path)
        for option in node.options:
            visit(option, path)
        path.discard(id(node))
        done.add(id(node))

    for node in [root, *defs.values()]:
        visit(node, set())


def _check_finite(root: Node) -> None:
    """Every part of the schema must have a finite value: one whose required properties (or
    non-empty array's items) lead back to it without end has none, and output that started it
    could never be finished. Finiteness spreads from the scalars up, each link followed once."""
    nodes, stack, seen = [], [root], {id(root)}
    while stack:
        node = stack.pop()
        nodes.append(node)
        for child in _children(node):
            if id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    waiting: dict[int, int] = {}  # how many more of its parts a node waits for
    parents: dict[int, list[Node]] = {}
    finite: list[Node] = []
    for node in nodes:
        if node.kind == "ref":
            parts = [node.defs[node.target]]
        elif node.kind == "anyof":
            parts = list(node.options)
        elif node.kind == "object":
            parts = [node.properties[k] for k in node.required]
        elif node.kind == "array" and node.min_items:
            parts = [node.items]
        else:
            parts = []
        waiting[id(node)] = min(len(parts), 1) if node.kind == "anyof" else len(parts)
        for part in parts:
            parents.setdefault(id(part), []).append(node)
        if not parts:
            finite.append(node)
    done = {id(node) for node in finite}
    while finite:
        for parent in parents.get(id(finite.pop()), ()):
            waiting[id(parent)] -= 1
            if waiting[id(parent)] <= 0 and id(parent) not in done:
                done.add(id(parent))
                finite.append(parent)
    stuck = [node for node in nodes if id(node) not in done]
    if stuck:
        raise SchemaError(f"{stuck[0].where}: has no finite value (what it requires leads back to it)")


# -- the automaton --------------------------------------------------------------------------------

State = tuple  # (stack, whitespace bytes in the current run, its newlines and kind: see _run_after)


class Matcher:
    """Where one request stands in a nondeterministic byte automaton: the readings (states)
    still alive, and which bytes may come next. A grammar's matcher says how readings move on
    (``_run``) and when the request may end (``done``)."""

    stops_apply = True  # whether a stop string may end the reply here

    def __init__(self, states: tuple):
        self.states = states
        self._checked: tuple[bytes, tuple] | None = None  # the last bytes accepts() read, and where they led

    @property
    def failed(self) -> bool:
        return not self.states

    def accepts(self, data: bytes) -> bool:
        if not data:
            return False
        self._checked = (data, self._run(self.states, data))
        return bool(self._checked[1])

    def advance(self, data: bytes) -> None:
        """Take bytes the sampler chose (an end token adds none); the token the sampler just
        checked (the usual case) is not read again."""
        if data:
            checked = self._checked
            self.states = checked[1] if checked is not None and checked[0] == data else self._run(self.states, data)
        self._checked = None

    def allowed_first_bytes(self) -> list[bool]:
        """Per byte value, whether a token may start with it."""
        return [bool(self._run(self.states, bytes((b,)))) for b in range(256)]

    def _run(self, states: tuple, data: bytes) -> tuple:
        """The readings after ``data``: the grammar's own (see ``run_readings``)."""
        raise NotImplementedError


class JsonMatcher(Matcher):
    """Where one request stands in its JSON grammar (a stop string may cut JSON: the caller
    asked for it)."""

    def __init__(self, grammar: JsonGrammar):
        super().__init__(start_states(grammar))

    @property
    def done(self) -> bool:
        """Whether what came so far is a whole value (the request may end here)."""
        return states_done(self.states)

    def _run(self, states: tuple, data: bytes) -> tuple:
        return step_states(states, data)


# The automaton as plain functions over immutable states, for grammars built around it (tool calls).


def start_states(grammar: JsonGrammar) -> tuple[State, ...]:
    return ((("v", grammar.root, False),), 0, 0),


def states_done(states: tuple[State, ...]) -> bool:
    return any(_complete(stack) for stack, _, _ in states)


def step_states(states: tuple[State, ...], data: bytes) -> tuple[State, ...]:
    """The states after ``data``; empty when the grammar does not allow it."""
    return run_readings(states, data, _step)


def run_readings(states: tuple, data: bytes, step) -> tuple:
    """The readings alive after ``data``, each byte taking every reading to its ``step``s (in
    order, without repeats, at most ``MAX_ALTERNATIVES``)."""
    for byte in data:
        following: dict = {}
        for state in states:
            for nxt in step(state, byte):
                following[nxt] = None
        states = tuple(following)[:MAX_ALTERNATIVES]
        if not states:
            break
    return states


def _complete(stack: tuple) -> bool:
    """Empty, or only a number that may end here (a root number ends with the text)."""
    if len(stack) == 1 and stack[0][0] == "r":
        return stack[0][1].regex.matches(stack[0][2])
    return not stack or (len(stack) == 1 and stack[0][0] == "n" and stack[0][2] in _NUMBER_ENDS)


def _step(state: State, b: int) -> Iterable[State]:
    stack, ws, lines = state
    if not stack:
        return ()
    top = stack[-1]
    kind = top[0]
    if kind == "n":
        number = _number(top, b)
        if number is not None:
            return [(stack[:-1] + (number,), 0, 0)] if number else ()
        if top[2] not in _NUMBER_ENDS:
            return ()
        return _step((stack[:-1], 0, 0), b)  # the number ended: the byte is its parent's
    if kind == "r":  # a bounded number: its digits follow the range's pattern
        regex = top[1].regex
        states = regex.step(top[2], b)
        if states:
            return [(stack[:-1] + (("r", top[1], states),), 0, 0)]
        return _step((stack[:-1], 0, 0), b) if regex.matches(top[2]) else ()
    if b in _WS and kind in "voa":
        return _blank(stack, top, ws, lines, b)
    return [(s, 0, 0) for s in _STEPS[kind](stack, top, b)]


def _blank(stack: tuple, top: tuple, ws: int, lines: int, b: int) -> Iterable[State]:
    """Whitespace where a JSON writer puts it: after "{", "[" and "," (a newline and indentation),
    before a closing "}" or "]" (then only the close may follow), one space after ":". Nowhere
    else: a model that cannot write what it wanted must not pad instead (``"a": \\n\\n"x"``)."""
    kind = top[0]
    if kind == "v":
        return [(stack, 1, 0)] if top[2] and not ws and b == 0x20 else ()
    phase = top[3]
    if kind == "o":
        if phase in "a}":
            if not top[1].required <= top[2]:
                return ()
            stack = stack[:-1] + (("o", top[1], top[2], "}", None),)
        elif phase not in "{,":
            return ()
    elif phase in "a]":
        if top[2] < top[1].min_items:
            return ()
        stack = stack[:-1] + (("a", top[1], top[2], "]"),)
    run = _run_after(lines, ws, b)
    if run is None or ws + 1 > MAX_WS_BYTES:
        return ()
    return [(stack, ws + 1, run)]


def _run_after(run: int, ws: int, b: int) -> int | None:
    """A run of whitespace as writers make one: one space (Python's ", "), or up to
    ``MAX_WS_LINES`` newlines then indentation of spaces or of tabs, not both, and no newline once
    it started (no line of blanks, no tab after spaces). ``run``: the newlines so far, with the
    run's kind in the bits above (``_SPACE_RUN``, ``_SPACES``, ``_TABS``); None: ``b`` cannot come."""
    newlines, kind = run & 0xFF, run & ~0xFF
    if b == 0x0A:
        return run + 1 if not kind and newlines < MAX_WS_LINES else None
    if b == 0x20 and not ws:
        return _SPACE_RUN
    indent = _SPACES if b == 0x20 else _TABS if b == 0x09 else None
    return newlines | indent if indent and newlines and kind in (0, indent) else None


def _value(stack: tuple, top: tuple, b: int) -> list[tuple]:
    return _start(_resolve(top[1]), b, stack[:-1])


def _start(node: Node, b: int, below: tuple) -> list[tuple]:
    """The stacks after ``b`` starts a value of ``node`` on top of ``below``."""
    kind = node.kind
    if kind == "anyof":
        out = []
        for option in node.options:
            out.extend(_start(_resolve(option), b, below))
        return out
    if kind == "any":
        if b == 0x7B or b == 0x5B:
            if len(below) >= MAX_DEPTH:  # closed off (a frame per open object or array); a scalar may go here
                return []
            node = ANY_OBJECT if b == 0x7B else ANY_ARRAY
        else:
            node = ANY_STRING if b == 0x22 else ANY_NUMBER if b == 0x2D or b in _DIGITS else ANY_LITERAL
        kind = node.kind
    if kind == "literal":
        return _literal_step(node.literals, 0, b, below)
    if kind == "object":
        return [below + (("o", node, frozenset(), "{", None),)] if b == 0x7B else []
    if kind == "array":
        return [below + (("a", node, 0, "["),)] if b == 0x5B else []
    if kind == "string":
        if b != 0x22:
            return []
        if node.regex is not None:
            return [below + (("p", node, node.regex.start, 0),)]
        limited = node.min_length or node.max_length is not None
        return [below + (("s", 0, 0, 0, node if limited else None, None),)]
    if node.regex is not None:  # a bounded number
        states = node.regex.step(node.regex.start, b)
        return [below + (("r", node, states),)] if states else []
    if kind in ("number", "integer"):
        integer = kind == "integer"
        if b == 0x2D:
            return [below + (("n", integer, "-"),)]
        if b == 0x30:
            return [below + (("n", integer, "0"),)]
        if b in _DIGITS:
            return [below + (("n", integer, "i"),)]
    return []


def _next_keys(node: Node, seen: frozenset) -> tuple[bytes, ...]:
    """The declared keys that may come next: in the schema's order (as OpenAI's structured outputs
    write them: a "reasoning" declared before its "answer" is written first), from the one after
    the last written up to the first required one (an optional key may be left out, a required
    one not)."""
    keys = tuple(node.properties)
    after = max((i for i, key in enumerate(keys) if key in seen), default=-1) + 1
    upto = next((i for i in range(after, len(keys)) if keys[i] in node.required), len(keys) - 1)
    return keys[after:upto + 1]


def _object(stack: tuple, top: tuple, b: int) -> list[tuple]:
    _, node, seen, phase, value = top
    below = stack[:-1]
    if phase in "{," and b == 0x22:  # a key starts
        inside = below + (("o", node, seen, "k", None),)
        out = []
        keys = _next_keys(node, seen)
        if keys:
            out.append(inside + (("k", keys, 1),))
        if node.additional is not None:
            out.append(inside + (("s", 0, 0, 0, None, b""),))
        return out
    if phase == ":" and b == 0x3A:
        return [below + (("o", node, seen, "a", None), ("v", value, True))]
    if phase == "a" and b == 0x2C:
        more = node.additional is not None or bool(_next_keys(node, seen))
        return [below + (("o", node, seen, ",", None),)] if more else []
    if phase in "{a}" and b == 0x7D:
        return [below] if node.required <= seen else []
    return []


def _array(stack: tuple, top: tuple, b: int) -> list[tuple]:
    _, node, count, phase = top
    below = stack[:-1]
    if phase == "]":
        return [below] if b == 0x5D else []
    if phase == "a":
        if b == 0x2C and (node.max_items is None or count < node.max_items):
            return [below + (("a", node, count, ","),)]
        if b == 0x5D and count >= node.min_items:
            return [below]
        return []
    if phase == "[" and b == 0x5D:
        return [below] if node.min_items == 0 else []
    if node.max_items is not None and count >= node.max_items:
        return []
    return _start(_resolve(node.items), b, below + (("a", node, count + 1, "a"),))


def _utf8_lead(b: int) -> tuple[int, int, int] | None:
    """(continuation bytes due, range of the next one) for a lead byte; None for a byte that
    cannot start a character. The ranges leave out overlong forms, surrogates and what lies past
    U+10FFFF."""
    if 0xC2 <= b <= 0xDF:
        return (1, 0x80, 0xBF)
    if 0xE0 <= b <= 0xEF:
        return (2, 0xA0 if b == 0xE0 else 0x80, 0x9F if b == 0xED else 0xBF)
    if 0xF0 <= b <= 0xF4:
        return (3, 0x90 if b == 0xF0 else 0x80, 0x8F if b == 0xF4 else 0xBF)
    return None


def _string(stack: tuple, top: tuple, b: int) -> list[tuple]:
    _, escape, utf8, length, node, key = top
    below = stack[:-1]
    if key is not None:
        key += bytes((b,))
    if utf8:
        due, low, high = utf8
        if not low <= b <= high:
            return []
        return [below + (("s", 0, (due - 1, 0x80, 0xBF) if due > 1 else 0, length, node, key),)]
    if escape == -1:
        if b in _ESCAPES:
            return [below + (("s", 0, 0, length, node, key),)]
        return [below + (("s", 4, 0, length, node, key),)] if b == 0x75 else []
    if escape:
        return [below + (("s", escape - 1, 0, length, node, key),)] if b in _HEX else []
    if b == 0x22:
        if node is not None and length < node.min_length:
            return []
        if key is None:
            return [below]
        return _key_read(below, b'"' + key)
    if b < 0x20 or (node is not None and node.max_length is not None and length >= node.max_length):
        return []  # a control character, or a character past maxLength
    if b == 0x5C:
        # Not in an undeclared key beside declared ones: "\u0061" would spell a declared "a".
        return [] if key is not None and below[-1][1].properties else [below + (("s", -1, 0, length + 1, node, key),)]
    if b < 0x80:
        return [below + (("s", 0, 0, length + 1, node, key),)]
    lead = _utf8_lead(b)
    return [below + (("s", 0, lead, length + 1, node, key),)] if lead else []


def _key_read(below: tuple, key: bytes) -> list[tuple]:
    """An undeclared key ended: the object goes on to its value, unless the key is a declared
    one (those are read as such) or came before."""
    _, node, seen, _, _ = below[-1]
    if key in node.properties or key in seen:
        return []
    return [below[:-1] + (("o", node, seen | {key}, ":", node.additional),)]


def _key(stack: tuple, top: tuple, b: int) -> list[tuple]:
    _, keys, at = top
    keys = tuple(k for k in keys if k[at] == b)
    ended = next((k for k in keys if len(k) == at + 1), None)
    if ended is not None:  # the closing quote: no other key can still match
        _, node, seen, _, _ = stack[-2]
        return [stack[:-2] + (("o", node, seen | {ended}, ":", node.properties[ended]),)]
    return [stack[:-1] + (("k", keys, at + 1),)] if keys else []


def _literal(stack: tuple, top: tuple, b: int) -> list[tuple]:
    return _literal_step(top[1], top[2], b, stack[:-1])


def _literal_step(texts: tuple[bytes, ...], at: int, b: int, below: tuple) -> list[tuple]:
    """Byte ``at`` of one of ``texts``: the value may end here (one text is whole) and may go on
    (others are longer), e.g. the enum values 1 and 12 after "1"."""
    texts = tuple(t for t in texts if t[at] == b)
    out = [below] if any(len(t) == at + 1 for t in texts) else []
    longer = tuple(t for t in texts if len(t) > at + 1)
    if longer:
        out.append(below + (("l", longer, at + 1),))
    return out


def _number(top: tuple, b: int):
    """The number's next frame; () if ``b`` cannot go on it; None if ``b`` is not part of it."""
    _, integer, phase = top
    digit = b in _DIGITS
    if phase == "-":
        return ("n", integer, "0" if b == 0x30 else "i") if digit else ()
    if phase in "if" and digit:
        return top
    if phase in "0i" and b == 0x2E:
        return ("n", integer, ".") if not integer else ()
    if phase in "0if" and b in (0x65, 0x45):
        return ("n", integer, "e") if not integer else ()
    if phase == "0" and digit:
        return ()  # no leading zeros
    if phase == ".":
        return ("n", integer, "f") if digit else ()
    if phase == "e":
        return ("n", integer, "E") if b in (0x2B, 0x2D) else ("n", integer, "x") if digit else ()
    if phase == "E":
        return ("n", integer, "x") if digit else ()
    if phase == "x" and digit:
        return top
    return None


def _patterned(stack: tuple, top: tuple, b: int) -> list[tuple]:
    """Inside a string with a pattern: its bytes as they are (no escapes), each kept only if a
    match of the pattern, within the length bounds, can still follow."""
    _, node, states, length = top
    regex = node.regex
    if b == 0x22:
        return [stack[:-1]] if regex.matches(states) and length >= node.min_length else []
    states = regex.step(states, b)
    if b < 0x80 or b >= 0xC0:  # a character starts
        length += 1
    if not states or not regex.fits(states, length, node.min_length, node.max_length):
        return []
    return [stack[:-1] + (("p", node, states, length),)]


_STEPS = {"v": _value, "o": _object, "a": _array, "s": _string, "k": _key, "l": _literal, "p": _patterned}
