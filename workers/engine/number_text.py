"""A bounded number's text, read beside its pattern (a range's, or that of any number written
without an exponent) for what a pattern cannot say: ``multipleOf``, and what a double can hold.

A multiple ``m = p / 10**q`` (``p`` a whole number) divides a number when the number's digits past
the ``q``-th after its point are zeros and its digits up to there, read as a whole number padded
with zeros to ``q`` places, are divisible by ``p``: 7.50 is a multiple of 0.25 (750 = 30 × 25),
7.6 is not. So the remainder of what the digits spell is kept as they come.

Readers parse a JSON number into a binary double (JavaScript, pydantic's ``float``), which holds
15 significant digits. One written with more may round onto the bound it kept clear of:
0.49999999999999999999 is below 0.5, but reads as 0.5, and a field with ``lt=0.5`` refuses it. A
number whose digits from its first nonzero one to its last are at most 15 never crosses so. Two
such texts that differ read as doubles that differ, in the same order (a double keeps 15 digits).
A bound is a double's shortest text (integers past 2**53, which no double holds, aside): a
number of 15 digits or fewer that read as the bound's double would be a shorter text of it, so
it would be the bound. Zeros count only once a nonzero digit follows them (``1732800000000000``
and ``0.5000`` are fine); a run of them is at most ``MAX_PLACES`` long, as are the digits after
the point: no bound has more, and it keeps the states to search few.

A state is (the pattern's states, the remainder, digits after the point so far or None before it,
significant digits so far, zeros since the last nonzero digit after the first). A byte is taken
only if a match can still follow, as the grammar needs of every step: whether one can is a search
of the few states ahead, kept once known.
"""

from __future__ import annotations

from collections import deque
from decimal import Decimal

from .byte_regex import MAX_BOUND_DIGITS, ByteRegex, RegexError

DOUBLE_DIGITS = 15  # the significant digits a double holds (C's DBL_DIG)
MAX_PLACES = MAX_BOUND_DIGITS  # digits after the point, where digits are counted
MAX_STATES_PER_PATTERN_STATE = 1_000  # p × (q + 2): what one reading of the pattern may meet (a search each)
MAX_KNOWN = 100_000  # states whose fate is kept
_DIGIT_BYTES = b"0123456789"
_NUMBER_BYTES = b"-0123456789."

State = tuple  # (pattern states, remainder, places or None, significant digits, zeros pending)


class NumberText:
    """The texts of ``regex`` (a number's pattern) that are multiples of ``multiple`` (None: any)
    and, if ``digits`` is set, have at most that many significant digits; read as the grammar
    reads a ``ByteRegex``: ``start``, ``step`` (falsy: the byte cannot come), ``matches``."""

    def __init__(self, regex: ByteRegex, *, multiple: Decimal | None = None, digits: int | None = None) -> None:
        self.places, self.divisor = None, 1  # the multiple's decimal places (None: no multiple)
        if multiple is not None:
            multiple = multiple.normalize()
            if not multiple.is_finite() or multiple <= 0:
                raise RegexError("multipleOf must be a number greater than 0")
            self.places = max(0, -multiple.as_tuple().exponent)
            self.divisor = int(multiple.scaleb(self.places))
            if self.divisor * (self.places + 2) > MAX_STATES_PER_PATTERN_STATE:
                raise RegexError(f"multipleOf {_plain(multiple)} has more digits than this engine follows "
                                 f"(its digits times its decimal places must stay under {MAX_STATES_PER_PATTERN_STATE})")
        self.digits = digits
        # Places are counted as far as anything reads them: MAX_PLACES where digits are counted, else
        # the multiple's places (past them only zeros come, whatever their number): states stay few.
        self._places_counted = MAX_PLACES if digits is not None else self.places
        # What a schema's size counts it as: the states one reading of the pattern may meet, which
        # a compile's search for a match may all visit (a second each, at the most).
        self.cost = 0 if multiple is None else self.divisor * (self.places + 2)
        self.regex = regex
        self.edges = regex.edges  # (what a schema's size is counted by)
        self.start: State = (regex.start, 0, None, 0, 0)
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
        return remainder * pow(10, self.places - min(places or 0, self.places), self.divisor) % self.divisor == 0

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
                    zeros += 1
                if significant > self.digits or zeros > MAX_PLACES or (places is not None and places >= MAX_PLACES):
                    return None
            if self.places is not None and places is not None and places >= self.places:
                if b != 0x30:  # past the multiple's places: zeros only
                    return None
            else:
                remainder = (remainder * 10 + b - 0x30) % self.divisor
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


def _plain(value: Decimal) -> str:
    return format(value, "f")
