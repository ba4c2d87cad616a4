"""JSON Schema's ``multipleOf``: a number's text read beside its pattern (a range's, or that of any
number written without an exponent), keeping the remainder of what its digits spell.

A multiple ``m = p / 10**q`` (``p`` a whole number) divides a number when the number's digits past
the ``q``-th after its point are zeros and its digits up to there, read as a whole number padded
with zeros to ``q`` places, are divisible by ``p``: 7.50 is a multiple of 0.25 (750 = 30 × 25),
7.6 is not. So a state is (the pattern's states, that number mod ``p``, digits after the point so
far or None before it). A byte is taken only if a match can still follow, as the grammar needs of
every step: whether one can is a search of the few states ahead, kept once known.
"""

from __future__ import annotations

from collections import deque
from decimal import Decimal

from .byte_regex import ByteRegex, RegexError

MAX_STATES_PER_PATTERN_STATE = 1_000  # p × (q + 2): what one reading of the pattern may meet (a search each)
MAX_KNOWN = 100_000  # states whose fate is kept
_DIGIT_BYTES = b"0123456789"
_NUMBER_BYTES = b"-0123456789."

State = tuple  # (pattern states, remainder, places or None)


class MultipleOf:
    """The texts of ``regex`` (a number's pattern) that are multiples of ``multiple``; read as the
    grammar reads a ``ByteRegex``: ``start``, ``step`` (falsy: the byte cannot come), ``matches``."""

    def __init__(self, regex: ByteRegex, multiple: Decimal) -> None:
        multiple = multiple.normalize()
        if not multiple.is_finite() or multiple <= 0:
            raise RegexError("multipleOf must be a number greater than 0")
        exponent = multiple.as_tuple().exponent
        self.places = max(0, -exponent)
        self.divisor = int(multiple.scaleb(self.places))
        if self.divisor * (self.places + 2) > MAX_STATES_PER_PATTERN_STATE:
            raise RegexError(f"multipleOf {_plain(multiple)} has more digits than this engine follows "
                             f"(its digits times its decimal places must stay under {MAX_STATES_PER_PATTERN_STATE})")
        self.regex = regex
        self.edges = regex.edges  # (what a schema's size is counted by)
        self.start: State = (regex.start, 0, None)
        self._known: dict[State, bool] = {}
        if not self._alive(self.start):
            raise RegexError(f"no number of the range is a multiple of {_plain(multiple)}")

    def step(self, state: State, b: int) -> State | None:
        after = self._advance(state, b)
        return after if after is not None and self._alive(after) else None

    def matches(self, state: State) -> bool:
        states, remainder, places = state
        return self.regex.matches(states) and \
            remainder * pow(10, self.places - (places or 0), self.divisor) % self.divisor == 0

    def _advance(self, state: State, b: int) -> State | None:
        states, remainder, places = state
        after = self.regex.step(states, b)
        if not after:
            return None
        if b in _DIGIT_BYTES:
            if places is not None and places >= self.places:  # past the multiple's places: zeros only
                return (after, remainder, places) if b == 0x30 else None
            remainder = (remainder * 10 + b - 0x30) % self.divisor
            places = None if places is None else places + 1
        elif b == 0x2E:
            places = 0
        return after, remainder, places

    def _alive(self, state: State) -> bool:
        """Whether a match can follow ``state``: a breadth-first search of the states ahead."""
        known = self._known.get(state)
        if known is not None:
            return known
        seen, work, found = {state}, deque([state]), False
        while work and not found:
            current = work.popleft()
            if self._known.get(current) or self.matches(current):
                found = True
                break
            for b in _NUMBER_BYTES:
                after = self._advance(current, b)
                if after is not None and after not in seen and self._known.get(after) is not False:
                    seen.add(after)
                    work.append(after)
        if len(self._known) > MAX_KNOWN:
            self._known.clear()
        self._known[state] = found
        if not found:  # everything reached is a dead end too
            self._known.update(dict.fromkeys(seen, False))
        return found


def _plain(value: Decimal) -> str:
    return format(value, "f")
