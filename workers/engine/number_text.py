"""A bounded number's text, read beside its pattern (a range's, or that of any number written
without an exponent) for what a pattern cannot say: ``multipleOf``, and what a double can hold.

A multiple ``m = p / 10**q`` (``p`` a whole number) divides a number when the number's digits past
the ``q``-th after its point are zeros and its digits up to there, read as a whole number padded
with zeros to ``q`` places, are divisible by ``p``: 7.50 is a multiple of 0.25 (750 = 30 × 25),
7.6 is not. So the remainder of what the digits spell is kept as they come, as few states as
tell it apart (``Divisibility``): a multiple of 1000 needs four, not a thousand.

Readers parse a JSON number into a binary double (JavaScript, pydantic's ``float``), which holds
15 significant digits. One written with more may round onto the bound it kept clear of:
0.49999999999999999999 is below 0.5, but reads as 0.5, and a field with ``lt=0.5`` refuses it. A
number whose digits from its first nonzero one to its last are at most 15 never crosses so. Two
such texts that differ read as doubles that differ, in the same order (a double keeps 15 digits).
A bound is a double's shortest text (integers past 2**53, which no double holds, aside): a
number of 15 digits or fewer that read as the bound's double would be a shorter text of it, so
it would be the bound. Zeros count only once a nonzero digit follows them (``1732800000000000``
and ``0.5000`` are fine), but after the point only while a nonzero digit could still follow
within 15: else it could only pad (a model that cannot write the digit it wanted would write
``0.871188183309745000``); a run of them is at most ``MAX_PLACES`` long, as are the digits after
the point: no bound has more, and it keeps the states to search few.

A state is (the pattern's states, the remainder, digits after the point so far or None before it,
significant digits so far, zeros since the last nonzero digit after the first). A byte is taken
only if a match can still follow, as the grammar needs of every step: whether one can is a search
of the few states ahead, kept once known.
"""

from __future__ import annotations

import functools
from collections import deque
from decimal import Decimal

import numpy as np

from .byte_regex import MAX_BOUND_DIGITS, ByteRegex, RegexError

DOUBLE_DIGITS = 15  # the significant digits a double holds (C's DBL_DIG)
MAX_PLACES = MAX_BOUND_DIGITS  # digits after the point, where digits are counted
MAX_STATES_PER_PATTERN_STATE = 1_000  # remainders × (q + 2): what one reading of the pattern may meet (a search each)
MAX_DIVISOR = 100_000  # the largest p whose remainders are sorted into states (at most a tenth of a second)
MAX_KNOWN = 100_000  # states whose fate is kept
_DIGIT_BYTES = b"0123456789"
_NUMBER_BYTES = b"-0123456789."

State = tuple  # (pattern states, remainder's state, places or None, significant digits, zeros pending)


class Divisibility:
    """Whether a whole number, read a digit at a time, is divisible by ``divisor``, in as few
    states as tell its remainders apart: ``divisor`` of them when it is prime to 10 (7, 499), but
    four for 1000 (how many of the last three digits are zeros so far), 17 for 3600.
    ``step[state][digit]`` is the next state; ``start`` is the empty number's (0), and the state
    of every multiple.

    Two remainders are one state when the same digits, and only those, complete each to a
    multiple. With ``divisor = p · 2**a · 5**b`` (``p`` prime to 10) and ``c = max(a, b)``: a
    remainder ``r`` followed by ``k`` more digits spelling ``v`` is a multiple when ``v ≡ -r · 10**k``.
    For ``k < c``, the ``v`` below ``10**k`` that do are the smallest of them and those a multiple
    of ``divisor`` above it, or none: that smallest one (or none) is ``r``'s mark for ``k``; for ``k >= c``,
    ``10**k`` is 0 modulo ``2**a · 5**b`` and invertible modulo ``p``, so the ``v`` that complete
    ``r`` are those of every remainder with the same value modulo ``p``, and only theirs. So a
    state is a remainder's marks for ``k < c`` and its value modulo ``p``."""

    def __init__(self, divisor: int) -> None:
        prime_to_ten, tens = _prime_to_ten(divisor)
        remainders = np.arange(divisor, dtype=np.int64)
        state = remainders % prime_to_ten
        for k in range(tens):  # told apart by one more mark: numbered again, so the numbers stay small
            v = (-remainders * pow(10, k, divisor)) % divisor
            mark = np.where(v < 10 ** k, v, -1)
            _, state = np.unique(state * (divisor + 1) + mark + 1, return_inverse=True)
        some = np.zeros(int(state.max()) + 1, dtype=np.int64)
        some[state] = remainders  # a remainder of each state
        after = (some[:, None] * 10 + np.arange(10)) % divisor  # [state, digit]
        self.start = int(state[0])
        self.step = tuple(tuple(int(s) for s in row) for row in state[after])

    @property
    def states(self) -> int:
        return len(self.step)


@functools.lru_cache(maxsize=64)
def divisibility(divisor: int) -> Divisibility:
    return Divisibility(divisor)


class NumberText:
    """The texts of ``regex`` (a number's pattern) that are multiples of ``multiple`` (None: any)
    and, if ``digits`` is set, have at most that many significant digits; read as the grammar
    reads a ``ByteRegex``: ``start``, ``step`` (falsy: the byte cannot come), ``matches``."""

    def __init__(self, regex: ByteRegex, *, multiple: Decimal | None = None, digits: int | None = None) -> None:
        self.places, self.divisible = None, divisibility(1)  # the multiple's decimal places (None: no multiple)
        if multiple is not None:
            multiple = multiple.normalize()
            if not multiple.is_finite() or multiple <= 0:
                raise RegexError("multipleOf must be a number greater than 0")
            self.places = max(0, -multiple.as_tuple().exponent)
            divisor = int(multiple.scaleb(self.places))
            if divisor > MAX_DIVISOR:
                raise RegexError(f"multipleOf {_plain(multiple)} has more digits than this engine follows (its "
                                 f"digits read as a whole number must be at most {MAX_DIVISOR:,})")
            if (_prime_to_ten(divisor)[0] * (self.places + 2) > MAX_STATES_PER_PATTERN_STATE
                    or divisibility(divisor).states * (self.places + 2) > MAX_STATES_PER_PATTERN_STATE):
                raise RegexError(f"multipleOf {_plain(multiple)} has more digits than this engine follows (the "
                                 "remainders that tell its multiples apart, times its decimal places plus 2, must stay "
                                 f"under {MAX_STATES_PER_PATTERN_STATE})")
            self.divisible = divisibility(divisor)
        self.digits = digits
        # Places are counted as far as anything reads them: MAX_PLACES where digits are counted, else
        # the multiple's places (past them only zeros come, whatever their number): states stay few.
        self._places_counted = MAX_PLACES if digits is not None else self.places
        # What a schema's size counts it as: the states one reading of the pattern may meet, which
        # a compile's search for a match may all visit (a second each, at the most).
        self.cost = 0 if multiple is None else self.divisible.states * (self.places + 2)
        self.regex = regex
        self.edges = regex.edges  # (what a schema's size is counted by)
        self.start: State = (regex.start, self.divisible.start, None, 0, 0)
        self._known: dict[State, bool] = {}
        if not self._alive(self.start):
            raise RegexError("no number of the range " + " and ".join(filter(None, (
                multiple is not None and f"is a multiple of {_plain(multiple)}",
                digits is not None and f"has at most {digits} significant digits (what a double holds)"))))

    def step(self, state: State, b: int) -> State | None:
        after = self._advance(state, b)
        return after if after is not None and self._alive(after) else None

    def matches(self, state: State) -> bool:
        states, remainder, places, _, _ = state
        if not self.regex.matches(states):
            return False
        if self.places is None:
            return True
        for _ in range(self.places - min(places or 0, self.places)):  # read as padded with zeros to its places
            remainder = self.divisible.step[remainder][0]
        return remainder == self.divisible.start

    def _advance(self, state: State, b: int) -> State | None:
        states, remainder, places, significant, zeros = state
        after = self.regex.step(states, b)
        if not after:
            return None
        if b in _DIGIT_BYTES:
            if self.digits is not None:
                if b != 0x30:
                    significant, zeros = significant + zeros + 1, 0
                elif significant:
                    if places is not None and significant + zeros + 1 >= self.digits:
                        return None  # after the point, a zero no nonzero digit can follow only pads
                    zeros += 1
                if significant > self.digits or zeros > MAX_PLACES or (places is not None and places >= MAX_PLACES):
                    return None
            if self.places is not None and places is not None and places >= self.places:
                if b != 0x30:  # past the multiple's places: zeros only
                    return None
            else:
                remainder = self.divisible.step[remainder][b - 0x30]
            if places is not None:
                places = min(places + 1, self._places_counted)
        elif b == 0x2E:
            places = 0
        return after, remainder, places, significant, zeros

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


def _prime_to_ten(divisor: int) -> tuple[int, int]:
    """``divisor`` without its factors 2 and 5, and the larger of their powers in it."""
    powers = []
    for factor in (2, 5):
        powers.append(0)
        while divisor % factor == 0:
            divisor, powers[-1] = divisor // factor, powers[-1] + 1
    return divisor, max(powers)


def _plain(value: Decimal) -> str:
    return format(value, "f")
