"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with the batch padded.

A decode step is a few dozen small kernels per layer; at small batch sizes launching them costs
more than running them on a GPU. A graph captured once per bucket replays the whole step (the
forward pass and the logits) with one launch. A graph replays fixed shapes at fixed addresses, so:

- every input lives in a static buffer sized for the largest bucket; a step writes its rows and
  pads the rest of its bucket in a pinned host twin of those buffers, then sends them in one
  copy. Padded rows write no KV (slot -1) and attend over one position of a zeroed block kept
  for them, so they compute finite values that nobody reads;
- block tables are as wide as the longest sequence the engine allows;
- the attention is told that longest length (``max_model_len``) instead of the step's, so its
  launch grid is the same on every replay; the decode kernel reads each row's true length from
  ``context_lens`` (its last context split runs to the row's end, whatever the bound).

Before ``capture()`` (and on CPU, where nothing is captured) ``run`` executes the same padded
step eagerly on the same buffers, which is how the padding is tested without a GPU.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import numpy as np
import torch

from .attention.base import AttentionMetadata


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The buckets: 1, 2, 4, then every multiple of 8 below ``max_batch_size``, and it."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = {s for s in (1, 2, 4) if s < max_batch_size}
    sizes.update(range(8, max_batch_size, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` rows; None when the largest is too small."""
    if num_seqs < 1:
        raise ValueError(f"a decode step needs at least one sequence, got {num_seqs}")
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


@dataclass
class DecodeStep:
    """A decode step's inputs on the host, one row per sequence (one new token each)."""

    input_ids: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [n]
    slot_mapping: np.ndarray  # int64 [n]
    context_lens: np.ndarray  # int32 [n]
    block_tables: np.ndarray  # int32 [n, width]

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]


def pad_decode_step(step: DecodeStep, size: int, pad_block: int) -> DecodeStep:
    """``step`` grown to ``size`` rows. An added row holds token 0 at position 0, writes nothing
    (slot -1) and attends over the first position of ``pad_block`` (context length 1)."""
    width = step.block_tables.shape[1]
    padded = DecodeStep(np.empty(size, np.int64), np.empty(size, np.int64),
                        np.empty(size, np.int64), np.empty(size, np.int32),
                        np.zeros((size, width), np.int32))
    write_padded(step, padded, pad_block)
    return padded


def write_padded(step: DecodeStep, into: DecodeStep, pad_block: int) -> None:
    """Write ``step`` into the first rows of ``into``'s arrays and make the rest of them padding
    rows (see ``pad_decode_step``); block table columns past the step's width are left alone."""
    n, size = step.num_seqs, into.num_seqs
    if size < n:
        raise ValueError(f"cannot pad a step of {n} sequences to {size} rows")
    into.input_ids[:n] = step.input_ids
    into.positions[:n] = step.positions
    into.slot_mapping[:n] = step.slot_mapping
    into.context_lens[:n] = step.context_lens
    into.block_tables[:n, :step.block_tables.shape[1]] = step.block_tables
    pad_rows(into, n, size, pad_block)


def pad_rows(into: DecodeStep, start: int, stop: int, pad_block: int) -> None:
    """Make rows ``start:stop`` of ``into``'s arrays padding rows (see ``pad_decode_step``)."""
    into.input_ids[start:stop] = 0
    into.positions[start:stop] = 0
    into.slot_mapping[start:stop] = -1
    into.context_lens[start:stop] = 1
    into.block_tables[start:stop, 0] = pad_block


class DecodeGraphs:
    """Static decode inputs for up to ``max_batch_size`` sequences and a graph per bucket."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 *, max_batch_size: int, max_model_len: int, block_size: int, pad_block: int,
                 device: str | torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.block_size = block_size
        self.pad_block = pad_block
        self.device = torch.device(device)
        rows, dev = self.sizes[-1], self.device
        # The inputs share one byte buffer, the per-row fields first and the block tables last,
        # with a twin in pinned host memory: a step writes its rows into the twin and sends
        # them over in ONE copy (its rows of the fields and of the tables, a prefix of the
        # buffer), where five copies from pageable memory each cost the host a staging pass.
        self._tables_offset = rows * (3 * 8 + 4)
        nbytes = self._tables_offset + rows * self.max_blocks * 4
        self._device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        self._host_bytes = torch.empty(nbytes, dtype=torch.uint8,
                                       pin_memory=dev.type == "cuda")
        self._sent: torch.cuda.Event | None = None  # recorded after the last copy
        (self.input_ids, self.positions, self.slot_mapping, self.context_lens,
         self.block_tables) = self._views(self._device_bytes)
        self._host = DecodeStep(*(t.numpy() for t in self._views(self._host_bytes)))
        # Filled as padding: the graphs are captured over these rows, writing nothing.
        self._host.block_tables[:] = pad_block
        pad_rows(self._host, 0, rows, pad_block)
        self._device_bytes.copy_(self._host_bytes)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output, in the graphs' pool
        self.capture_seconds: float | None = None
        self.memory_bytes: int | None = None

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def fits(self, num_seqs: int, width: int) -> bool:
        """Whether a decode step of ``num_seqs`` rows and block tables ``width`` wide fits."""
        return width <= self.max_blocks and bucket_for(num_seqs, self.sizes) is not None

    def run(self, step: DecodeStep) -> torch.Tensor:
        """Float32 logits [num_seqs, vocab] of the step's rows. They live in static memory that
        the next ``run`` overwrites: use them (or copy them) first."""
        n = step.num_seqs
        size = bucket_for(n, self.sizes)
        if size is None or step.block_tables.shape[1] > self.max_blocks:
            raise ValueError(f"a decode step of {n} sequences, {step.block_tables.shape[1]} "
                             f"blocks wide, does not fit the graphs (at most {self.sizes[-1]} "
                             f"sequences, {self.max_blocks} blocks)")
        self._wait_for_last_copy()
        host = self._host
        write_padded(step, DecodeStep(host.input_ids[:size], host.positions[:size],
                                      host.slot_mapping[:size], host.context_lens[:size],
                                      host.block_tables[:size]), self.pad_block)
        return self._send_and_replay(n, size)

    def run_decode(self, seqs: list) -> torch.Tensor | None:
        """``run`` for sequences that each take their next token (one new token, the last one
        they hold), read straight from the sequences into the pinned inputs: this is the host
        work the GPU waits for between two decode steps, so it is kept to one pass. None when
        the step does not fit the graphs."""
        n, bs = len(seqs), self.block_size
        size = bucket_for(n, self.sizes)
        if size is None or max(s.num_computed_tokens for s in seqs) // bs >= self.max_blocks:
            return None
        self._wait_for_last_copy()
        host = self._host
        ids, positions, slots, lens, tables = (host.input_ids, host.positions, host.slot_mapping,
                                               host.context_lens, host.block_tables)
        for i, seq in enumerate(seqs):
            position = seq.num_computed_tokens
            table = seq.block_table
            width = position // bs + 1
            ids[i] = seq.token_ids[position]
            positions[i] = position
            slots[i] = table[width - 1] * bs + position % bs
            lens[i] = position + 1
            tables[i, :width] = table[:width]
        if size > n:
            pad_rows(host, n, size, self.pad_block)
        return self._send_and_replay(n, size)

    def _views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """input_ids, positions, slot_mapping, context_lens, block_tables over ``buffer``."""
        rows = self.sizes[-1]
        int64s = buffer[:rows * 24].view(torch.int64)
        context_lens = buffer[rows * 24:self._tables_offset].view(torch.int32)
        tables = buffer[self._tables_offset:].view(torch.int32).view(rows, self.max_blocks)
        return int64s[:rows], int64s[rows:2 * rows], int64s[2 * rows:], context_lens, tables

    def _wait_for_last_copy(self) -> None:
        """Before the host buffer is written again: the last copy has read it (long since)."""
        if self._sent is not None:
            self._sent.synchronize()

    def _send_and_replay(self, n: int, size: int) -> torch.Tensor:
        """Send the first ``size`` rows of the host buffer over in one copy, then run the
        bucket's graph (or, uncaptured, the same padded step eagerly). Block table columns past
        a row's length keep stale entries, which the attention never reads."""
        # Every per-row field for all rows (a few KB), then this step's rows of the tables.
        nbytes = self._tables_offset + size * self.max_blocks * 4
        self._device_bytes[:nbytes].copy_(self._host_bytes[:nbytes], non_blocking=True)
        if self.device.type == "cuda":
            self._sent = torch.cuda.Event()
            self._sent.record()
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        return self.logits[size][:n]

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_start_loc=self.query_start_loc[:size + 1],
            max_query_len=1,
            max_context_len=self.max_model_len,  # a fixed bound: the same launch grid every time
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture a graph per bucket, largest first so that the smaller ones reuse its memory
        pool. Records how long it took and how much GPU memory the graphs hold."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        pool = None
        for size in reversed(self.sizes):
            # Every row is padding here (the buffers start so): nothing is written to the cache.
            self._forward(size)  # compiles the Triton kernels and settles the allocator first
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another engine's loop thread in this process may keep running
            # kernels meanwhile, which the default mode would refuse.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.logits[size] = self._forward(size)
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        torch.cuda.empty_cache()  # hand back the warm-up runs' memory: count only the graphs'
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
