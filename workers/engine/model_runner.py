"""Turn a scheduled step into tensors, run the model over the paged KV cache, sample.

The step's sequences are flattened into one run of tokens without padding. Index arithmetic
(positions, cache slots) is done with numpy on whole arrays, so building a step costs a few
array operations plus one short loop over the sequences, never a loop over tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .attention.base import AttentionMetadata
from .sampling import Sampler, SamplerOutput, SamplingBatch
from .sequence import Sequence


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    """Memory one block takes across all layers, keys and values."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


def pick_dtype(device: str | torch.device) -> torch.dtype:
    """The compute dtype to serve in when none is asked for.

    On CUDA: bfloat16 where supported (else float16). On CPU it depends on the chip: with AMX or
    AVX512-BF16, bfloat16 matmuls are several times faster than float32; without them they are
    emulated and many times slower (measured: ~10x on an AVX2-only EPYC). So: float32 unless the
    CPU has native bfloat16, and then whichever a matmul shaped like a decode step runs faster in.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type != "cpu" or not cpu_has_native_bf16():
        return torch.float32
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(64, 576, dtype=dtype)
        b = torch.randn(1536, 576, dtype=dtype)
        torch.nn.functional.linear(a, b)  # warm up
        times = []
        for _ in range(10):
            start = time.perf_counter()
            torch.nn.functional.linear(a, b)
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)  # the minimum is the figure least disturbed by other work
    return torch.bfloat16 if best[torch.bfloat16] < best[torch.float32] else torch.float32


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16 instructions (Linux; elsewhere assume not)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return False


class SmallStepThreads:
    """How many CPU threads the smallest steps (single-stream decode) should use, by measurement.

    A one-token step is a chain of small, memory-bound operations; on a small CPU, waking and
    joining the other threads for each one can cost more than the work they share (measured on
    a 2-core machine: 55 ms per token on one thread against 64 ms on two). On a big server one
    core cannot saturate memory bandwidth and the answer flips. So the first small steps
    alternate between one thread and all of them, and the faster (by best time) is kept.
    Larger steps always use every thread.
    """

    def __init__(self, *, max_tokens: int = 2, samples: int = 8):
        self.max_tokens = max_tokens
        self.samples = samples
        self.all_threads = torch.get_num_threads()
        self.choice: int | None = 1 if self.all_threads == 1 else None
        self._timings: dict[int, list[float]] = {1: [], self.all_threads: []}

    def threads_for(self, num_tokens: int) -> int:
        if num_tokens > self.max_tokens:
            return self.all_threads
        if self.choice is not None:
            return self.choice
        one, every = self._timings[1], self._timings[self.all_threads]
        return 1 if len(one) <= len(every) else self.all_threads

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        if self.choice is not None or num_tokens > self.max_tokens:
            return
        self._timings[threads].append(seconds)
        if all(len(t) >= self.samples for t in self._timings.values()):
            self.choice = min(self._timings, key=lambda n: min(self._timings[n]))


@dataclass
class StepResult:
    """Sequences that reached the end of their tokens this step, and what they sampled."""

    sampled: list[Sequence]
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 device: str | torch.device, dtype: torch.dtype, seed: int | None = None):
        config = model.config
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.vocab_size = config.vocab_size
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # On CPU, empty() leaves a large cache to the OS to back with memory as blocks are first
        # written, so an engine sized for a big pool costs RAM only for what it uses. Attention
        # never reads a slot before it is written (unused tails are masked). On GPUs, zeros.
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        self.kv_caches = [
            (alloc(shape, dtype=dtype, device=self.device),
             alloc(shape, dtype=dtype, device=self.device))
            for _ in range(config.num_layers)
        ]
        self.sampler = Sampler(self.device, seed=seed)
        self.threads = SmallStepThreads() if self.device.type == "cpu" else None

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepResult:
        """Run one step; sequences whose new tokens reach their end get a sampled token."""
        input_ids, positions, meta, last_rows, sample_index = self._prepare(seqs, num_new_tokens)
        sampled = [seqs[i] for i in sample_index]
        num_tokens = input_ids.shape[0]
        threads = self.threads.threads_for(num_tokens) if self.threads else 0
        started = time.perf_counter()
        default_threads = torch.get_num_threads()
        if threads and threads != default_threads:
            torch.set_num_threads(threads)
        try:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
            if not sampled:
                return StepResult([], [], None, None, None)
            logits = self.model.compute_logits(hidden[last_rows])
        finally:
            if threads and threads != default_threads:
                torch.set_num_threads(default_threads)  # MKL's setting is process-wide
        if self.threads:
            self.threads.record(num_tokens, threads, time.perf_counter() - started)
        batch = SamplingBatch.build(
            [s.params for s in sampled], [s.token_ids for s in sampled],
            [s.num_prompt_tokens for s in sampled], vocab_size=logits.shape[-1],
            device=self.device)
        out: SamplerOutput = self.sampler(logits, batch)
        return StepResult(
            sampled=sampled,
            token_ids=out.token_ids.tolist(),
            logprobs=out.logprobs.tolist() if out.logprobs is not None else None,
            top_ids=out.top_ids.tolist() if out.top_ids is not None else None,
            top_logprobs=out.top_logprobs.tolist() if out.top_logprobs is not None else None,
        )

    def _prepare(self, seqs: list[Sequence], num_new_tokens: list[int]):
        bs = self.block_size
        num_seqs = len(seqs)
        q_lens = np.asarray(num_new_tokens, dtype=np.int64)
        computed = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64,
                               count=num_seqs)
        context_lens = computed + q_lens
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start[1:])
        num_tokens = int(query_start[-1])
        max_query_len = int(q_lens.max())

        if max_query_len == 1:
            tokens = [s.token_ids[c] for s, c in zip(seqs, computed.tolist())]
            positions = computed
            seq_of_token = np.arange(num_seqs)
        else:
            tokens = []
            for s, start, n in zip(seqs, computed.tolist(), num_new_tokens):
                tokens.extend(s.token_ids[start:start + n])
            seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
            positions = np.arange(num_tokens) - query_start[:-1][seq_of_token] \
                + computed[seq_of_token]

        max_context_len = int(context_lens.max())
        width = -(-max_context_len // bs)
        block_tables = np.zeros((num_seqs, width), dtype=np.int32)
        for i, s in enumerate(seqs):
            table = s.block_table
            block_tables[i, :min(len(table), width)] = table[:width]
        slots = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs

        # Rows whose step reaches the end of their sequence's tokens produce the next token.
        reaches_end = context_lens == np.fromiter((s.num_tokens for s in seqs), dtype=np.int64,
                                                  count=num_seqs)
        sample_index = np.flatnonzero(reaches_end)
        last_rows = query_start[1:][sample_index] - 1

        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device),
            block_tables=torch.from_numpy(block_tables).to(device),
            context_lens=torch.from_numpy(context_lens.astype(np.int32)).to(device),
            query_start_loc=torch.from_numpy(query_start.astype(np.int32)).to(device),
            max_query_len=max_query_len,
            max_context_len=max_context_len,
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=device)
        positions_t = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(device)
        last_rows_t = torch.from_numpy(last_rows).to(device)
        return input_ids, positions_t, meta, last_rows_t, sample_index.tolist()
