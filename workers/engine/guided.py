"""Guided decoding: each step, the best-ranked token that a request's grammar allows.

The sampler ranks every token as it would anyway (logits for greedy rows, the exponential race's
keys for random ones), so taking the best *allowed* token samples exactly from the distribution
restricted to what the grammar allows. Checking candidates best first costs a handful of grammar
checks a step: a model asked for JSON mostly wants what the grammar allows. When none of the first
``CANDIDATES`` is allowed, the vocabulary is narrowed by first byte on the device and searched in
order. Tokens the sampler's top-k/top-p/min-p filters dropped come last, by logit, so that a
filter that happens to drop every allowed token leaves the likeliest allowed one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .json_grammar import Matcher

CANDIDATES = 32


@dataclass
class Guide:
    """A request's grammar state and the tokens that may end it (EOS, its stop tokens)."""

    matcher: Matcher
    end_ids: frozenset[int]
    stuck: bool = False  # the grammar allowed no token at all (it never should): the request fails

    def allows(self, token: int, vocab: "VocabBytes") -> bool:
        if token in self.end_ids:
            return self.matcher.done
        data = vocab.table[token]
        return data is not None and self.matcher.accepts(data)

    def advance(self, token: int, vocab: "VocabBytes") -> None:
        if token not in self.end_ids:
            self.matcher.advance(vocab.table[token] or b"")


class VocabBytes:
    """The bytes of each token id of the model's output layer (None: a control token or an id
    the tokenizer lacks), and each one's first byte (256 for those) to narrow searches."""

    def __init__(self, table: list[bytes | None], vocab_size: int):
        self.table = list(table[:vocab_size]) + [None] * max(0, vocab_size - len(table))
        first = np.full(vocab_size, 256, dtype=np.int64)
        for token, data in enumerate(self.table):
            if data:
                first[token] = data[0]
        self._first = torch.from_numpy(first)
        self._on: dict[torch.device, torch.Tensor] = {}

    def first_byte(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = self._first.to(device)
        return self._on[device]


def pick(keys: torch.Tensor, logits: torch.Tensor, guides: list[Guide], vocab: VocabBytes) -> list[int]:
    """Per row, the allowed token with the largest key (``-inf``: dropped by the sampler's
    filters), ``logits`` breaking ties among those. A row whose grammar allows nothing is marked
    ``stuck`` (and given a token that does not matter)."""
    values, ids = keys.topk(min(CANDIDATES, keys.shape[1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    chosen = []
    for row, guide in enumerate(guides):
        token = next((t for v, t in zip(values[row], ids[row])
                      if v != float("-inf") and guide.allows(t, vocab)), None)
        if token is None:
            token = _search(keys[row], logits[row], guide, vocab)
        chosen.append(token)
    return chosen


def _search(keys: torch.Tensor, logits: torch.Tensor, guide: Guide, vocab: VocabBytes) -> int:
    device = keys.device
    first_ok = torch.tensor(guide.matcher.allowed_first_bytes() + [False], device=device)
    mask = first_ok[vocab.first_byte(device)]
    ends = [t for t in guide.end_ids if t < mask.shape[0]]
    if ends and guide.matcher.done:
        mask[torch.tensor(ends, device=device)] = True
    candidates = mask.nonzero().squeeze(1)
    ranked = keys[candidates]
    kept = torch.isfinite(ranked)
    order = torch.cat([candidates[kept][ranked[kept].argsort(descending=True)],
                       candidates[~kept][logits[candidates[~kept]].argsort(descending=True)]])
    for token in order.tolist():
        if guide.allows(token, vocab):
            return token
    guide.stuck = True
    return int(order[0]) if len(order) else 0
