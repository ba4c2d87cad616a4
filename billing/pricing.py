"""The one place a request's cost is computed.

Prices are USD per million tokens (input, cached input, output) plus a flat price per request,
all :class:`~decimal.Decimal`. A request's cost is exact Decimal arithmetic (:func:`exact_cost`:
at most :data:`EXACT_PLACES` decimal places); nothing here ever touches a float, and a float given
as a price or a token count is refused (TypeError) rather than silently rounded.

Money moves in whole micro-dollars (:data:`COST_QUANTUM`, 0.000001 USD), and a request may cost
less than one: an embedding of a few tokens at 0.02 USD per million costs a tenth of one. Rounding
each request on its own would make such requests free, or double their price. Instead an
organization carries the fraction of a micro-dollar its requests cost beyond their charges to its
next request (:func:`charge`): its charges add up to its usage's exact cost, rounded down, at every
moment. A million such embeddings cost 0.1 USD, as they would billed all at once.

Which requests are billed (``status``):

- ``completed``: every token, plus the per-request price.
- ``cancelled`` or ``failed`` with at least one output token (a stream the client closed, an engine
  error mid-generation): billed like a completed request for the tokens actually processed, i.e.
  the whole prompt and the output produced so far, plus the per-request price.
- ``cancelled`` or ``failed`` with no output token: free (0). The caller got nothing. A request whose
  worker died mid-stream is recorded so (``workers.fleet.fail_interrupted``): what that worker
  produced died with it, and its client was told the request is not billed.

Reserved capacity (``models_catalog.models.billed_by_the_hour``) is recorded like a request: one
usage record per deployment and minute, with no tokens and its ``replica_seconds`` (replicas ready ×
seconds), at the model's price per replica-hour. An hour's price over 3,600 seconds does not always
end, so its exact cost is rounded up at :data:`EXACT_PLACES` places, by less than 10**-16 USD:
rounded down, the sixty minutes of an hour at 0.20 USD would add up to just under 0.20 and be
charged 0.199999; rounded up they add up to just over, and are charged 0.20, the hour's price.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, ROUND_HALF_UP, Decimal, localcontext
from typing import Any

#: Charges are whole micro-dollars (6 decimal places).
COST_QUANTUM = Decimal("0.000001")
COST_DECIMAL_PLACES = 6
#: A price as a usage record stores it: 10 decimal places, below 10**10 USD (``billing.models.PRICE``).
PRICE_DECIMAL_PLACES = 10
PRICE_MAX_DIGITS = 20
TOKENS_PER_PRICE_UNIT = Decimal(1_000_000)
SECONDS_PER_HOUR = 3600
#: The decimal places of an exact cost: a price's, over a million tokens.
EXACT_PLACES = PRICE_DECIMAL_PLACES + 6

STATUS_COMPLETED = "completed"
STATUS_CANCELLED = "cancelled"
STATUS_FAILED = "failed"
STATUSES = (STATUS_COMPLETED, STATUS_CANCELLED, STATUS_FAILED)

PRICE_FIELDS = ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok", "per_request")


def _price(name: str, value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, Decimal):
        raise TypeError(f"price {name} must be a Decimal, not {type(value).__name__} ({value!r})")
    if not value.is_finite() or value < 0:
        raise ValueError(f"price {name} must be a finite Decimal >= 0, not {value}")
    return value


def _tokens(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, not {value}")
    return value


@dataclass(frozen=True)
class Prices:
    """The four prices of a catalog model, USD: per million input / cached input / output tokens,
    and per request. Stored on every usage record as the prices applied."""

    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal
    per_request: Decimal
    # Per hour of one ready replica: only a reserved-capacity record's replica_seconds pay it.
    per_replica_hour: Decimal = Decimal(0)

    def __post_init__(self):
        for name in (*PRICE_FIELDS, "per_replica_hour"):
            _price(name, getattr(self, name))

    @classmethod
    def of(cls, catalog_model) -> "Prices":
        """The prices of a ``models_catalog.models.CatalogModel``, or those a ``UsageRecord`` applied."""
        return cls(
            input_per_mtok=catalog_model.price_input_per_mtok,
            cached_input_per_mtok=catalog_model.price_cached_input_per_mtok,
            output_per_mtok=catalog_model.price_output_per_mtok,
            per_request=catalog_model.price_per_request,
            per_replica_hour=getattr(catalog_model, "price_per_replica_hour", Decimal(0)),
        )

    def as_strings(self) -> dict[str, str]:
        """The prices as decimal strings, in positional notation ("0.000001", never "1E-6"): the four,
        and ``per_replica_hour`` unless it is 0 (the wire form of a request's prices is unchanged)."""
        strings = {name: format(getattr(self, name), "f") for name in PRICE_FIELDS}
        if self.per_replica_hour:
            strings["per_replica_hour"] = format(self.per_replica_hour, "f")
        return strings


FREE = Prices(Decimal(0), Decimal(0), Decimal(0), Decimal(0))


def is_billed(*, status: str, completion_tokens: int) -> bool:
    """Whether a request is charged at all (see the module's docstring): a completed one, or one
    that produced output before it was cancelled or failed. What is not billed counts toward no
    limit either: its tokens are nobody's."""
    return status == STATUS_COMPLETED or completion_tokens > 0


def request_cost(**usage) -> Decimal:
    """The cost in USD of one request on its own (:func:`exact_cost`'s arguments), to the nearest
    micro-dollar (half up): an estimate of its charge, which carries its fraction of a micro-dollar
    (:func:`charge`)."""
    return exact_cost(**usage).quantize(COST_QUANTUM, rounding=ROUND_HALF_UP)


def exact_cost(
    *,
    prices: Prices,
    prompt_tokens: int,
    cached_prompt_tokens: int,
    completion_tokens: int,
    status: str = STATUS_COMPLETED,
    replica_seconds: int = 0,
) -> Decimal:
    """The exact cost in USD of one request, with at most :data:`EXACT_PLACES` decimal places.

    ``prompt_tokens`` counts every prompt token, cached ones included; ``cached_prompt_tokens`` of
    them (served from the prefix cache) are billed at the cached input price, the rest at the input
    price. ``replica_seconds`` of reserved capacity are billed at the price per replica-hour, rounded
    up at :data:`EXACT_PLACES` places (see the module's docstring). Raises TypeError for a float (or any non-Decimal price /
    non-int count) and ValueError for
    negative counts, more cached tokens than prompt tokens, or an unknown status.
    """
    if not isinstance(prices, Prices):
        raise TypeError(f"prices must be billing.pricing.Prices, not {type(prices).__name__}")
    prompt_tokens = _tokens("prompt_tokens", prompt_tokens)
    cached_prompt_tokens = _tokens("cached_prompt_tokens", cached_prompt_tokens)
    completion_tokens = _tokens("completion_tokens", completion_tokens)
    replica_seconds = _tokens("replica_seconds", replica_seconds)
    if cached_prompt_tokens > prompt_tokens:
        raise ValueError(
            f"cached_prompt_tokens ({cached_prompt_tokens}) cannot exceed prompt_tokens ({prompt_tokens})"
        )
    if status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")

    if not is_billed(status=status, completion_tokens=completion_tokens):
        return Decimal(0)

    # A private context with ample precision: every step is exact (products of integers and
    # prices, then a division by a power of ten).
    with localcontext() as ctx:
        ctx.prec = 60
        token_cost = (
            (prompt_tokens - cached_prompt_tokens) * prices.input_per_mtok
            + cached_prompt_tokens * prices.cached_input_per_mtok
            + completion_tokens * prices.output_per_mtok
        ) / TOKENS_PER_PRICE_UNIT
        capacity_cost = (replica_seconds * prices.per_replica_hour / SECONDS_PER_HOUR).quantize(
            Decimal(1).scaleb(-EXACT_PLACES), rounding=ROUND_CEILING)
        return token_cost + prices.per_request + capacity_cost


def charge(*, cost: Decimal, carry: Decimal) -> tuple[Decimal, Decimal]:
    """What to charge, in whole micro-dollars, for an exact ``cost`` after ``carry`` (what the
    organization's earlier requests cost beyond their charges), and the carry after it.

    The charge is the total rounded down, never below zero; the carry keeps the rest, so charges
    plus carry always equal the exact costs. It stays under a micro-dollar either way: a record
    replaced by a cheaper one may leave it negative, which the next charges take back."""
    with localcontext() as ctx:
        ctx.prec = 60
        total = carry + cost
        charged = max(total.quantize(COST_QUANTUM, rounding=ROUND_FLOOR), Decimal(0).quantize(COST_QUANTUM))
        return charged, total - charged
