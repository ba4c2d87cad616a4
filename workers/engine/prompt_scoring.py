"""The logprobs of a prompt's own tokens (``SamplingParams.prompt_logprobs``): what evaluation
harnesses ask for with ``echo``, to score a text under the model rather than continue it.

A step that computes prompt positions of such a sequence has their hidden states anyway: the
logits of position ``p`` give the logprob of prompt token ``p + 1``. They are taken in chunks of
rows no larger than a step's sampled rows (the runner's memory reserve is measured with those),
so that a long prompt never holds a logits tensor of its whole length times the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .sequence import Sequence, TokenLogprob


@dataclass
class Scoring:
    """One sequence's share of a step: its prompt positions ``start..start + len(rows) - 1``
    sit at ``rows`` of the step's flattened tokens; each predicts the prompt token after it."""

    seq: Sequence
    start: int
    rows: np.ndarray
    targets: list[int]


def plan(seqs: list[Sequence], num_new_tokens: list[int], query_start: np.ndarray) -> list[Scoring]:
    """What a step scores: for each sequence asking for prompt logprobs, the positions it
    computes that are followed by another prompt token (the last one's logits sample instead)."""
    scoring = []
    for i, (seq, count) in enumerate(zip(seqs, num_new_tokens)):
        if seq.prompt_logprobs is None:
            continue
        first = seq.num_computed_tokens
        end = min(first + count, seq.num_prompt_tokens - 1)
        if end > first:
            rows = np.arange(end - first, dtype=np.int64) + int(query_start[i])
            scoring.append(Scoring(seq, first, rows, seq.token_ids[first + 1:end + 1]))
    return scoring


def score(model, hidden: torch.Tensor, scoring: list[Scoring], *,
          chunk_rows: int) -> list[tuple[Sequence, int, list[TokenLogprob]]]:
    """Each scored sequence, the prompt position its entries start at, and its entries."""
    rows = torch.from_numpy(np.concatenate([s.rows for s in scoring])).to(hidden.device)
    targets = torch.tensor([t for s in scoring for t in s.targets], device=hidden.device)
    k = max(s.seq.params.prompt_logprobs for s in scoring)
    chosen, top_values, top_ids = [], [], []
    for at in range(0, rows.shape[0], chunk_rows):
        logprobs = torch.log_softmax(model.compute_logits(hidden[rows[at:at + chunk_rows]]).float(), dim=-1)
        chosen.append(logprobs.gather(1, targets[at:at + chunk_rows, None]).squeeze(1))
        if k:
            top = logprobs.topk(k, dim=-1)
            top_values.append(top.values)
            top_ids.append(top.indices)
    chosen_list = torch.cat(chosen).tolist()
    values_list = torch.cat(top_values).tolist() if k else None
    ids_list = torch.cat(top_ids).tolist() if k else None
    out, at = [], 0
    for s in scoring:
        wanted = s.seq.params.prompt_logprobs
        entries = []
        for j, target in enumerate(s.targets):
            top = list(zip(ids_list[at + j][:wanted], values_list[at + j][:wanted])) if wanted else []
            entries.append(TokenLogprob(target, chosen_list[at + j], top))
        out.append((s.seq, s.start + 1, entries))  # position p's logits score token p + 1
        at += len(s.targets)
    return out
