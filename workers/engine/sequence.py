"""What a request asks for (SamplingParams) and where it stands (Sequence), plus what it gets back.

A sequence's tokens are its prompt followed by what it has generated so far. The scheduler only
tracks how many of them already sit in the KV cache (``num_computed_tokens``): a step computes
the next run of uncomputed tokens, and when that run reaches the end, a new token is sampled from
the last position. Prefill, chunked prefill, decode, a prefix-cache hit and recompute after
preemption are all that one rule.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from .json_grammar import JsonGrammar, SchemaError, grammar_for
from .tool_calls import CHOICES, MAX_TOOLS, NAME, ToolGrammar, tool_grammar_for


class InvalidRequestError(ValueError):
    """A request the engine cannot run; ``param`` names the offending field (OpenAI's ``param``)."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


def _fail(param: str, message: str) -> None:
    raise InvalidRequestError(f"{param}: {message}", param=param)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow OpenAI's API.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 disables top-k. ``max_tokens=None`` means
    "until the context is full" (the request then ends with finish_reason "length"); a
    ``max_tokens`` larger than what fits after the prompt is refused, as is a prompt that leaves
    no room at all.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # The prompt's own logprobs (each prompt token's given the tokens before it), with this many
    # alternatives each; None: not computed. Such a request computes its whole prompt (no prefix
    # cache), and may ask for max_tokens=0: the prompt scored, nothing generated.
    prompt_logprobs: int | None = None
    # OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}; the JSON
    # ones constrain the output to JSON text (see json_grammar and ``grammar``).
    response_format: dict | None = None
    # Functions the model may call ({"name", "description", "parameters"}: OpenAI's "function"
    # objects), and whether it must: "auto" (it may answer in text), "required", {"name": ...}
    # (that one), "none" (it sees them, and calls none). See tool_calls: calls are written as text.
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    # An embedding: the request's output is the final hidden state of its prompt's last token,
    # L2-normalized (``RequestOutput.embedding``); nothing is generated (max_tokens reads as 0).
    embed: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.embed, bool):
            _fail("embed", f"must be a boolean, got {self.embed!r}")
        if self.embed:
            if self.max_tokens not in (None, 0):
                _fail("max_tokens", "an embedding generates nothing: leave max_tokens out")
            if self.tools or self.response_format is not None or self.prompt_logprobs is not None:
                _fail("embed", "an embedding takes no tools, response_format or prompt_logprobs")
            self.max_tokens, self.temperature = 0, 0.0  # the token a step samples for it is dropped
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            _fail("prompt_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, "
                                     f"got {self.prompt_logprobs!r}")
        least = 0 if self.prompt_logprobs is not None or self.embed else 1
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < least):
            _fail("max_tokens", f"must be a positive integer (0 only with prompt_logprobs), got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            _fail("temperature", f"must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            _fail("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", f"must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not _is_number(self.min_p) or not (0 <= self.min_p <= 1):
            _fail("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", f"must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not (-2 <= value <= 2):
                _fail(name, f"must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not math.isfinite(self.repetition_penalty) \
                or self.repetition_penalty <= 0:
            _fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        self.stop = self._valid_stop(self.stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    _is_int(t) and t >= 0 for t in self.stop_token_ids):
                _fail("stop_token_ids", "must be a list of non-negative token ids")
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            self.stop_token_ids = []
        if self.logit_bias is not None:
            self.logit_bias = self._valid_logit_bias(self.logit_bias)
        if not isinstance(self.logprobs, bool):
            _fail("logprobs", f"must be a boolean, got {self.logprobs!r}")
        if not _is_int(self.top_logprobs) or not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            _fail("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                  f"got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            _fail("top_logprobs", "needs logprobs=True")
        self._valid_tools()
        if self.response_format is not None:  # on its own first: with tools, an error names the right one
            try:
                grammar_for(self.response_format)
            except SchemaError as exc:
                _fail("response_format", str(exc))
        try:
            grammar = self.grammar
        except SchemaError as exc:
            _fail(self.guided_by, str(exc))
        if grammar is not None and grammar.needs_end and self.ignore_eos and not self.stop_token_ids:
            _fail(self.guided_by, "guided output ends with the end-of-sequence token: not with ignore_eos")

    def _valid_tools(self) -> None:
        if self.tools is not None:
            if not isinstance(self.tools, (list, tuple)) or len(self.tools) > MAX_TOOLS:
                _fail("tools", f"must be a list of at most {MAX_TOOLS} functions")
            for tool in self.tools:
                if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) \
                        or not NAME.fullmatch(tool["name"]):
                    _fail("tools", "each tool needs a name of 1 to 64 letters, digits, underscores or dashes")
            names = [tool["name"] for tool in self.tools]
            if len(set(names)) != len(names):
                _fail("tools", "tool names must be unique")
            self.tools = list(self.tools)
        choice = self.tool_choice
        if not (choice in CHOICES or isinstance(choice, dict) and isinstance(choice.get("name"), str)):
            _fail("tool_choice", f"must be one of {', '.join(CHOICES)} or {{'name': ...}}, got {choice!r}")
        if not self.tools and choice not in ("none", "auto"):
            _fail("tool_choice", "needs tools to choose from")
        if isinstance(choice, dict) and choice["name"] not in {tool["name"] for tool in self.tools}:
            _fail("tool_choice", f"names {choice['name']!r}, which is not in tools")
        if not isinstance(self.parallel_tool_calls, bool):
            _fail("parallel_tool_calls", f"must be a boolean, got {self.parallel_tool_calls!r}")

    @property
    def calls_tools(self) -> bool:
        """Whether the model is shown tools and may call them."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def json_output(self) -> bool:
        """Whether response_format asks for anything but text."""
        rf = self.response_format
        return rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text")

    @property
    def guided_by(self) -> str:
        """The parameter that constrains the output (for errors)."""
        return "tools" if self.calls_tools or (self.tools and not self.json_output) else "response_format"

    @staticmethod
    def _valid_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            _fail("stop", "must be a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS:
            _fail("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        if any(s == "" for s in stop):
            _fail("stop", "stop strings must not be empty")
        return list(stop)

    @staticmethod
    def _valid_logit_bias(bias: Any) -> dict[int, float]:
        if not isinstance(bias, dict):
            _fail("logit_bias", "must be a mapping of token id to bias")
        clean: dict[int, float] = {}
        for key, value in bias.items():
            try:  # OpenAI's JSON carries token ids as strings
                token = int(key)
            except (TypeError, ValueError):
                _fail("logit_bias", f"key {key!r} is not a token id")
            if token < 0:
                _fail("logit_bias", f"token id {token} is negative")
            if not _is_number(value) or not (-100 <= value <= 100):
                _fail("logit_bias", f"bias for token {token} must be in [-100, 100], got {value!r}")
            clean[token] = float(value)
        return clean

    @property
    def grammar(self) -> JsonGrammar | ToolGrammar | None:
        """What the output must follow, compiled (None for free text): the tools' calls or the
        response_format, shared by the requests that ask for the same."""
        grammar = None if self.response_format is None else grammar_for(self.response_format)
        if self.calls_tools:  # calls, or (tool_choice "auto") the response_format's JSON
            return tool_grammar_for(self.tools, self.tool_choice, self.parallel_tool_calls, answer=grammar)
        if grammar is None and self.tools:  # shown, never called
            return tool_grammar_for(self.tools, "none", False)
        return grammar

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and, if asked, the most likely alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestTimings:
    """Seconds; ``None`` where the moment has not come (yet)."""

    arrival_time: float  # time.monotonic() when submitted
    queue_time: float | None = None  # arrival → first scheduled
    time_to_first_token: float | None = None  # arrival → first token
    time_per_output_token: float | None = None  # mean gap between tokens after the first
    e2e_latency: float | None = None  # arrival → finish
    first_scheduled_step: int | None = None  # engine step that first ran this request
    mean_batch_size: float | None = None  # tokens sampled per step, over the steps that sampled one for it


@dataclass
class RequestOutput:
    """One delivery for a request: what is new since the previous one, and the running totals."""

    request_id: str
    # The tokens of ``text`` (see ``OutputGate``), and in the end the stop token or EOS that
    # ended the request; ``completion_tokens`` counts every token generated, those of a stop
    # string included.
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None  # one entry per token of ``text``
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    timings: RequestTimings
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None  # set when finish_reason == "error"
    # On a request's first output, when it asked for ``prompt_logprobs``: its prompt, and each
    # prompt token's logprob (None for the first, which nothing comes before).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # An embedding request's (``SamplingParams.embed``), on its final output: float32 [hidden].
    embedding: Any = None
    # On the final output of a request that asked for logprobs and ended by a stop token or EOS:
    # that token's entry, which ``logprobs`` leaves out (it adds no text). OpenAI's completions
    # list it (lm-evaluation-harness counts on the generated token's entry); its chat does not.
    stop_token_logprob: TokenLogprob | None = None


class Sequence:
    """One request's tokens and progress through the engine. Touched only by the step loop."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, max_tokens: int, arrival_time: float, detokenizer: Any = None):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # what the context leaves when none was asked for
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full blocks
        self.num_committed_blocks = 0  # leading blocks of block_table the prefix cache has seen
        self.num_cached_prompt_tokens = 0  # prompt tokens served by the prefix cache
        # Scoring the prompt needs the logits of every prompt position: none may come from the cache.
        self.uses_prefix_cache = params.prompt_logprobs is None
        # Per prompt position, filled as the prompt is computed; the first token has none.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if params.prompt_logprobs is None else [None] * self.num_prompt_tokens)
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.detokenizer = detokenizer  # IncrementalDetokenizer; None where text is not needed
        self.output_gate = OutputGate(params.stop)
        self.guide: Any = None  # guided.Guide, for output that follows a grammar
        self.timings = RequestTimings(arrival_time=arrival_time)
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.sampled_steps = 0  # the steps that sampled a token for this request
        self.sampled_alongside = 0  # the tokens those steps sampled, its own included
        self.embedding: Any = None  # an embedding request's, once its prompt is computed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.value})")


class StopStringMatcher:
    """Finds stop strings in streamed text, even when one spans several tokens.

    Text that could still turn out to be the start of a stop string is held back; nothing of a
    stop string is ever emitted. Only the held text and the new piece need searching: any earlier
    start of a stop string would have been held back too.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""

    def feed(self, piece: str, *, active: bool = True) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string found or None). Not ``active``: the text
        cannot hold a stop string (a tool call's), and what was held goes out with it."""
        if not self.stops:
            return piece, None
        text = self.held + piece
        if not active:
            self.held = ""
            return text, None
        found_at, found = len(text) + 1, None
        for stop in self.stops:
            at = text.find(stop)
            if at != -1 and at < found_at:
                found_at, found = at, stop
        if found is not None:
            self.held = ""
            return text[:found_at], found
        keep = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), keep, -1):
                if stop.startswith(text[len(text) - length:]):
                    keep = length
                    break
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """The held text, once the sequence ends for another reason."""
        held, self.held = self.held, ""
        return held


@dataclass
class Release:
    """What a request may deliver now: text, and the tokens (ids, logprob entries) it comes from."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stop: str | None = None  # the stop string that ended the request, if this piece completed one


@dataclass
class _HeldToken:
    token_id: int
    logprob: TokenLogprob | None
    start: int | None = None  # where its text starts in the generated text; None while it has none


class OutputGate:
    """Lets each token out with its text, through the stop-string matcher.

    The rule: a token's id and logprob entry are returned iff at least one character of its text
    is returned, and they go out with the first such character. So text held back as a possible
    stop string holds its tokens back too, and tokens wholly inside (or after) the stop string that
    ended the request are dropped; one that starts before it is kept. A token ending mid-character
    has no text of its own: it goes with the token that completes the character.
    """

    def __init__(self, stops: list[str]):
        self.matcher = StopStringMatcher(stops)
        self.held: list[_HeldToken] = []  # in order; the ones with text start first
        self.fed = 0  # characters of generated text given to the matcher
        self.released = 0  # of those, the ones let out

    def add(self, token_id: int, logprob: TokenLogprob | None) -> None:
        """A new token, before its text is known (so that one failing to decode still counts)."""
        self.held.append(_HeldToken(token_id, logprob))

    def feed(self, piece: str, *, stops: bool = True) -> Release:
        """The text the tokens added so far complete (possibly ""): what may go out now;
        ``stops``: whether a stop string may end it (see ``StopStringMatcher.feed``)."""
        if not self.matcher.stops:  # nothing is held back for its text: each token goes with its text
            if not piece:
                return Release()
            self.fed += len(piece)
            self.released = self.fed
            return self._release(piece, len(self.held))
        if piece:
            for token in reversed(self.held):
                if token.start is not None:
                    break
                token.start = self.fed
        self.fed += len(piece)
        text, stop = self.matcher.feed(piece, active=stops)
        self.released += len(text)
        out = self._release(text, self._released_tokens())
        if stop is not None:
            self.held = []  # nothing of theirs is returned: they lie in the stop string or after
            out.stop = stop
        return out

    def flush(self) -> Release:
        """Everything held, once the request ends other than by a stop string."""
        text = self.matcher.flush()
        self.released += len(text)
        return self._release(text, len(self.held))

    def _released_tokens(self) -> int:
        """How many of the held tokens have a character let out (a prefix: starts only grow)."""
        count = 0
        for token in self.held:
            if token.start is None or token.start >= self.released:
                break
            count += 1
        return count

    def _release(self, text: str, count: int) -> Release:
        tokens, self.held = self.held[:count], self.held[count:]
        return Release(text, [t.token_id for t in tokens],
                       [t.logprob for t in tokens if t.logprob is not None])
