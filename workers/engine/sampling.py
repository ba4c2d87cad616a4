"""Pick the next token for every sequence of a step with one set of tensor ops.

Per-row settings travel as tensors, so a batch of 64 costs about what one row does. Features no
row uses are skipped entirely (penalties, logit bias, logprobs, top-k, top-p, min-p), since each is
a pass over a [rows, vocab] tensor.

Random rows draw with the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``), which samples
exactly from ``p``. A seeded row takes its noise from a generator keyed by (seed, output index),
so its tokens depend on nothing else in the batch, nor on how often it was preempted.

On a GPU a step never waits for the device until its results are read: the per-row settings go
over in asynchronous copies, whatever shapes depend on them (the widest top-k) are known on the
host, and ``SamplerOutput.to_host`` brings every result back in one transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch

from .guided import Guide, VocabBytes, pick
from .sequence import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the generator's seed space


def seed_for_step(seed: int, step: int) -> int:
    return (seed * _SEED_MIX + step * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


@dataclass
class SamplingBatch:
    """Per-row sampling settings for one step; fields are ``None`` when no row needs them."""

    num_rows: int
    all_greedy: bool
    sampled_rows: torch.Tensor | None  # long [S]: rows that draw at random
    sampled_index: list[int]  # the same rows, on the host
    temperature: torch.Tensor | None  # float [S] for the sampled rows
    top_k: torch.Tensor | None  # long [S], vocab size where disabled
    top_k_max: int  # the largest of top_k, kept on the host (the width of one topk over the rows)
    top_p: torch.Tensor | None  # float [S]
    min_p: torch.Tensor | None  # float [S]
    seeds: list[int | None]  # per sampled row
    steps: list[int]  # per sampled row: index of the token being drawn
    # Penalties act on every row (greedy rows too).
    presence: torch.Tensor | None  # float [N, 1]
    frequency: torch.Tensor | None  # float [N, 1]
    repetition: torch.Tensor | None  # float [N, 1]
    output_ids: torch.Tensor | None  # long [N, L] padded with vocab_size
    seen_ids: torch.Tensor | None  # long [N, L'] prompt + output, padded, for repetition
    bias_rows: torch.Tensor | None
    bias_cols: torch.Tensor | None
    bias_values: torch.Tensor | None
    max_top_logprobs: int
    want_logprobs: bool
    # Rows whose output follows a grammar (JSON mode): (row, its guide); empty when none does.
    guided: list[tuple[int, Guide]] = ()
    vocab: VocabBytes | None = None

    @classmethod
    def build(cls, params: Seq[SamplingParams], token_ids: Seq[list[int]],
              num_prompt_tokens: Seq[int], *, vocab_size: int,
              device: torch.device | str = "cpu", guides: Seq[Guide | None] = (),
              vocab: VocabBytes | None = None) -> "SamplingBatch":
        """``token_ids[i]`` is row i's prompt + output so far; only read when penalties apply.
        ``guides[i]`` (with ``vocab``, the tokens' bytes) constrains row i's output."""
        n = len(params)
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        sp = [params[i] for i in sampled]

        def rows_tensor(values, dtype):
            return _to_device(torch.tensor(values, dtype=dtype), device)

        temperature = top_k = top_p = min_p = sampled_rows = None
        top_k_max = 0
        if sampled:
            sampled_rows = rows_tensor(sampled, torch.long)
            temperature = rows_tensor([p.temperature for p in sp], torch.float32)
            if any(0 < p.top_k < vocab_size for p in sp):
                ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in sp]
                top_k, top_k_max = rows_tensor(ks, torch.long), max(ks)
            if any(p.top_p < 1.0 for p in sp):
                top_p = rows_tensor([p.top_p for p in sp], torch.float32)
            if any(p.min_p > 0 for p in sp):
                min_p = rows_tensor([p.min_p for p in sp], torch.float32)

        presence = frequency = repetition = output_ids = seen_ids = None
        if any(p.uses_penalties for p in params):
            if any(p.presence_penalty or p.frequency_penalty for p in params):
                presence = rows_tensor([[p.presence_penalty] for p in params], torch.float32)
                frequency = rows_tensor([[p.frequency_penalty] for p in params], torch.float32)
                outputs = [ids[start:] for ids, start in zip(token_ids, num_prompt_tokens)]
                output_ids = _padded(outputs, vocab_size, device)
            if any(p.repetition_penalty != 1.0 for p in params):
                repetition = rows_tensor([[p.repetition_penalty] for p in params], torch.float32)
                seen_ids = _padded(token_ids, vocab_size, device)

        bias_rows = bias_cols = bias_values = None
        if any(p.logit_bias for p in params):
            rows, cols, values = [], [], []
            for i, p in enumerate(params):
                for token, value in (p.logit_bias or {}).items():
                    rows.append(i)
                    cols.append(token)
                    values.append(value)
            bias_rows = rows_tensor(rows, torch.long)
            bias_cols = rows_tensor(cols, torch.long)
            bias_values = rows_tensor(values, torch.float32)

        guided = [(i, g) for i, g in enumerate(guides) if g is not None]
        if guided and vocab is None:
            raise ValueError("guided rows need the vocabulary's bytes")
        return cls(
            num_rows=n, all_greedy=not sampled, sampled_rows=sampled_rows, sampled_index=sampled,
            temperature=temperature, top_k=top_k, top_k_max=top_k_max, top_p=top_p, min_p=min_p,
            seeds=[p.seed for p in sp],
            steps=[len(token_ids[i]) - num_prompt_tokens[i] for i in sampled],
            presence=presence, frequency=frequency, repetition=repetition,
            output_ids=output_ids, seen_ids=seen_ids,
            bias_rows=bias_rows, bias_cols=bias_cols, bias_values=bias_values,
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
            want_logprobs=any(p.logprobs for p in params),
            guided=guided, vocab=vocab,
        )


def _padded(rows: Seq[list[int]], pad: int, device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return _to_device(torch.from_numpy(out), device)


def _to_device(values: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: a copy from pageable memory
    is staged at once, so the host tensor may go away as soon as this returns."""
    return values.to(device, non_blocking=True)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # long [N]
    logprobs: torch.Tensor | None  # float [N]: the chosen token's logprob
    top_ids: torch.Tensor | None  # long [N, K]
    top_logprobs: torch.Tensor | None  # float [N, K]

    def to_host(self) -> tuple[list[int], list[float] | None, list[list[int]] | None,
                               list[list[float]] | None]:
        """(token ids, logprobs, top ids, top logprobs) as Python lists."""
        return self.to_host_async().lists()

    def to_host_async(self) -> "HostCopy":
        """Start the one copy of the results to the host (from a GPU: into pinned memory,
        without waiting); ``lists()`` on the returned copy waits for it. With logprobs, all
        is packed as float64, which holds token ids and float32 logprobs exactly."""
        if self.logprobs is None:
            packed, k = self.token_ids, None
        else:
            parts = [self.token_ids[:, None].double(), self.logprobs[:, None].double()]
            k = 0
            if self.top_ids is not None:
                k = self.top_ids.shape[1]
                parts += [self.top_ids.double(), self.top_logprobs.double()]
            packed = torch.cat(parts, dim=1)
        if not packed.is_cuda:
            return HostCopy(packed, None, k)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return HostCopy(host, done, k)


@dataclass
class HostCopy:
    """Sampler results on their way to the host."""

    values: torch.Tensor  # token ids [N], or the float64 packing of ids and logprobs
    done: "torch.cuda.Event | None"  # recorded after the copy; None when already on the host
    top_k: int | None  # None: no logprobs; else how many top logprobs per row

    def lists(self) -> tuple[list[int], list[float] | None, list[list[int]] | None,
                             list[list[float]] | None]:
        if self.done is not None:
            self.done.synchronize()
        if self.top_k is None:
            return self.values.tolist(), None, None, None
        packed = self.values.numpy()
        k = self.top_k
        token_ids = packed[:, 0].astype(np.int64).tolist()
        logprobs = packed[:, 1].tolist()
        if k == 0:
            return token_ids, logprobs, None, None
        return (token_ids, logprobs, packed[:, 2:2 + k].astype(np.int64).tolist(),
                packed[:, 2 + k:].tolist())


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``. On a GPU, a few rows over a large vocabulary go in two stages:
    PyTorch reduces each row with one thread block, which leaves the GPU idle (27 us for one row
    of 128k logits on an H100); the first stage spreads the row over many blocks."""
    rows, vocab = logits.shape
    if not logits.is_cuda or rows > 8 or vocab < 32768:
        return logits.argmax(dim=-1)
    return chunked_argmax(logits, chunk=1024)


def chunked_argmax(logits: torch.Tensor, *, chunk: int) -> torch.Tensor:
    """The argmax of each row from the maxima of its ``chunk``-wide pieces: the first index of
    the largest value, as ``argmax`` gives it (the first maximum of the first chunk holding it)."""
    rows, vocab = logits.shape
    chunks = -(-vocab // chunk)
    padded = torch.nn.functional.pad(logits, (0, chunks * chunk - vocab), value=float("-inf"))
    values, index = padded.view(rows, chunks, chunk).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)
    return (best * chunk + index.gather(1, best)).squeeze(1)


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None):
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._seeded = torch.Generator(device=self.device)
        self.guide_seconds = 0.0  # spent picking the tokens of guided rows (JSON output)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        logits = self.process_logits(logits, batch)

        logprobs = top_ids = top_logprobs = None
        log_probs = torch.log_softmax(logits, dim=-1) if batch.want_logprobs else None

        token_ids = argmax_rows(logits)
        race = None
        if not batch.all_greedy:
            race = self._race_keys(logits[batch.sampled_rows], batch)
            token_ids[batch.sampled_rows] = race.argmax(dim=-1)
        if batch.guided:
            started = time.perf_counter()
            self._guide(token_ids, logits, race, batch)
            self.guide_seconds += time.perf_counter() - started

        if log_probs is not None:
            logprobs = log_probs.gather(1, token_ids[:, None]).squeeze(1)
            if batch.max_top_logprobs:
                top_logprobs, top_ids = log_probs.topk(batch.max_top_logprobs, dim=-1)
        return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Penalties and logit bias: what logprobs are reported on, and greedy picks from."""
        vocab = logits.shape[1]
        if batch.repetition is not None:
            seen = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
            seen.scatter_(1, batch.seen_ids, True)
            seen = seen[:, :vocab]
            penalised = torch.where(logits > 0, logits / batch.repetition,
                                    logits * batch.repetition)
            logits = torch.where(seen, penalised, logits)
        if batch.output_ids is not None:
            counts = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.float32,
                                 device=logits.device)
            counts.scatter_add_(1, batch.output_ids, torch.ones_like(batch.output_ids,
                                                                     dtype=torch.float32))
            counts = counts[:, :vocab]
            logits = logits - batch.frequency * counts - batch.presence * (counts > 0)
        if batch.bias_rows is not None:
            logits = logits.index_put((batch.bias_rows, batch.bias_cols), batch.bias_values,
                                      accumulate=True)
        return logits

    @staticmethod
    def _guide(token_ids: torch.Tensor, logits: torch.Tensor, race: torch.Tensor | None,
               batch: SamplingBatch) -> None:
        """Replace the guided rows' tokens by the best their grammars allow: a greedy row ranks by
        logit, a random one by its race key (the same draw, restricted to the allowed tokens).
        The token drawn is the best-ranked one: where the grammar allows it (mostly), it stays."""
        drawn = token_ids[[row for row, _ in batch.guided]].tolist()
        refused = [(row, guide) for (row, guide), token in zip(batch.guided, drawn)
                   if not guide.allows(token, batch.vocab)]
        if not refused:
            return
        rows = [row for row, _ in refused]
        keys = logits[rows]
        position = {row: i for i, row in enumerate(batch.sampled_index)}
        for i, row in enumerate(rows):
            if row in position:  # a key of 0: a token the filters dropped
                row_keys = race[position[row]]
                keys[i] = row_keys.masked_fill(row_keys == 0, float("-inf"))
        chosen = pick(keys, logits[rows], [guide for _, guide in refused], batch.vocab)
        token_ids[torch.tensor(rows, device=token_ids.device)] = torch.tensor(chosen, device=token_ids.device)

    def _race_keys(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The sampled rows' race keys, whose argmax is the random token: temperature, top-k,
        top-p, min-p, then ``p / q`` (0 for the tokens a filter dropped)."""
        logits = logits / batch.temperature[:, None]
        if batch.top_k is not None:
            k_max = batch.top_k_max
            top_values = logits.topk(k_max, dim=-1).values
            threshold = top_values.gather(1, (batch.top_k.clamp(max=k_max) - 1)[:, None])
            disabled = batch.top_k[:, None] >= logits.shape[1]
            logits = logits.masked_fill((logits < threshold) & ~disabled, float("-inf"))
        if batch.top_p is not None:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p.
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= batch.top_p[:, None]
            drop[:, 0] = False
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        if batch.min_p is not None:
            floor = probs.max(dim=-1, keepdim=True).values * batch.min_p[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs / self._noise(probs.shape, batch)

    def _noise(self, shape: torch.Size, batch: SamplingBatch) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device)
        noise.exponential_(generator=self._generator)
        for row, (seed, step) in enumerate(zip(batch.seeds, batch.steps)):
            if seed is not None:
                self._seeded.manual_seed(seed_for_step(seed, step))
                noise[row].exponential_(generator=self._seeded)
        return noise
