"""The answers of one request: ``n`` per prompt (OpenAI's ``n``, and a completion's batch of
prompts), prompt by prompt. Each is its own engine request with its own relay stream, and
together they are one request to the gateway and to billing.

Each prompt is counted once, as OpenAI bills it (the engine's prefix cache shares its blocks
between its answers), and the completions are summed. Answer ``j`` of a prompt in a seeded
request samples with ``seed + j``: reproducible, and not ``n`` copies of one answer.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

# The request's end, in order of precedence: one failed answer fails the request (billed as
# failed, for what it produced), and one aborted answer makes it aborted.
_OUTCOMES = ("error", "abort")


def sequences(payload: dict) -> int:
    """How many engine requests a task's payload makes: ``n`` for each of its prompts."""
    prompts = payload.get("prompts")
    n = payload.get("n", 1)
    return max(1, n if isinstance(n, int) else 1) * max(1, len(prompts) if isinstance(prompts, list) else 1)


def engine_ids(request_id: str, count: int) -> list[str]:
    """The engine's id of each answer: the request's own when there is one answer."""
    return [request_id] if count == 1 else [f"{request_id}/{i}" for i in range(count)]


def params_for(params, sample: int):
    """The sampling of a prompt's answer number ``sample``."""
    if sample == 0 or params.seed is None:
        return params
    return replace(params, seed=params.seed + sample)


class Choices:
    """The streams of a request's answers, and their engine handles once submitted."""

    def __init__(self, streams: list, *, n: int = 1) -> None:
        self.streams = streams
        self.n = n  # answers per prompt
        self.handles: list = []

    def submit(self, submit_one) -> None:
        """``submit_one(index, stream)`` each answer; if one cannot be submitted, the others stop."""
        try:
            for index, stream in enumerate(self.streams):
                stream.handle = submit_one(index, stream)
                self.handles.append(stream.handle)
        except BaseException:
            self.abort()
            raise

    @property
    def prompt_tokens(self) -> int:
        """Each prompt's tokens, once."""
        return sum(handle.prompt_tokens for handle in self.handles[::self.n])

    def abort(self) -> None:
        for handle in self.handles:
            handle.abort()

    def open(self) -> None:
        for stream in self.streams:
            stream.open()

    def wait(self, stall_timeout: float, *, report_every: float = 5.0,
             abandoned: Callable[[], bool] | None = None) -> list:
        """Every answer's final output; ``TimeoutError`` once no answer made progress for
        ``stall_timeout`` s (one queued in the engine behind its siblings has not stalled).
        A prompt computed chunk by chunk is progress too, though nothing comes out: checked
        every ``report_every`` s, and then reported to the gateway (its own stall timer). So is
        ``abandoned()`` (its gateway died): then the answers are aborted, as for a cancel."""
        computed, moved = self._computed_tokens(), time.monotonic()

        def progressed() -> float:
            nonlocal computed, moved
            if abandoned is not None and not self.ended and abandoned():
                self.abort()
            output = max(stream.progressed for stream in self.streams)
            now = time.monotonic()
            if (tokens := self._computed_tokens()) != computed:
                computed, moved = tokens, now
                reporting = [s for s in self.streams if not s.ended]
                if reporting and now - output >= report_every:  # tokens flowing say it already
                    reporting[0].report_progress()
            return max(output, moved)

        return [stream.wait(stall_timeout, progressed, poll=report_every) for stream in self.streams]

    def _computed_tokens(self) -> int:
        return sum(stream.computed_tokens for stream in self.streams)

    @property
    def ended(self) -> bool:
        return all(stream.ended for stream in self.streams)

    @property
    def lasts(self) -> list:
        return [stream.last for stream in self.streams]

    @property
    def lost(self) -> bool:
        """A send of some answer failed: the client may lack part of it, its end included."""
        return any(getattr(stream, "lost", False) for stream in self.streams)

    def tokens_sent(self, by: float | None = None) -> int:
        """The completion tokens of every answer the gateway received (by ``by``, monotonic)."""
        return sum(stream.tokens_sent(by) for stream in self.streams)


def finish_reason(outputs: list) -> str:
    """The request's finish reason: an error or an abort of any answer, else the first answer's."""
    reasons = [out.finish_reason for out in outputs]
    return next((outcome for outcome in _OUTCOMES if outcome in reasons), reasons[0])


def error(outputs: list) -> str | None:
    return next((out.error for out in outputs if out.error), None)


def usage(outputs: list, *, n: int = 1, prompt_tokens: int | None = None) -> dict:
    """The request's token counts from its answers' outputs (``n`` per prompt; None for an
    answer that produced none): each prompt once, as its first answer read it, the completions
    summed."""
    firsts = [out for out in outputs[::n] if out is not None]
    return {
        "prompt_tokens": sum(out.prompt_tokens for out in firsts) if prompt_tokens is None else prompt_tokens,
        "cached_prompt_tokens": sum(out.cached_prompt_tokens for out in firsts),
        "completion_tokens": sum(out.completion_tokens for out in outputs if out is not None),
    }


def timings(outputs: list):
    """The request's timings: queued until its first answer was scheduled, its first token the
    first of any answer, done when the last answer was."""
    if len(outputs) == 1:
        return outputs[0].timings
    all_timings = [out.timings for out in outputs]

    def earliest(name):
        values = [getattr(t, name) for t in all_timings if getattr(t, name) is not None]
        return min(values, default=None)

    latencies = [t.e2e_latency for t in all_timings]
    return replace(all_timings[0], queue_time=earliest("queue_time"),
                   time_to_first_token=earliest("time_to_first_token"),
                   e2e_latency=None if None in latencies else max(latencies))
