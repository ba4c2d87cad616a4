"""Turn a scheduled step into tensors, run the model over the paged KV cache, sample.

The step's sequences are flattened into one run of tokens without padding. Index arithmetic
(positions, cache slots) is done with numpy on whole arrays, so building a step costs a few
array operations plus one short loop over the sequences, never a loop over tokens.

On CUDA, decode steps (one new token per sequence) replay a CUDA graph captured for their
batch-size bucket (``cuda_graphs.py``), their inputs written straight from the sequences into
pinned memory with no planning pass (between two batch-1 steps the GPU waits for exactly this
host work); other steps run eagerly. Inputs reach the device through
asynchronous copies and the results come back in one transfer at the end of the step, which
``launch`` only starts: the caller works on the previous step's tokens meanwhile.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .attention.base import AttentionMetadata
from .cpuinfo import cpuinfo_field
from .cuda_graphs import DecodeGraphs, DecodeStep
from .guided import VocabBytes
from .sampling import HostCopy, Sampler, SamplerOutput, SamplingBatch
from . import prompt_scoring
from .sequence import SamplingParams, Sequence, TokenLogprob


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
    flags = set((cpuinfo_field("flags") or "").split())
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def device_name(device: str | torch.device) -> str:
    """The GPU's name on CUDA; the CPU's model name otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpuinfo_field("model name") or platform.processor() or device.type


def device_memory(device: str | torch.device) -> tuple[int | None, int | None]:
    """(total, free) bytes of a CUDA device's memory; (None, None) elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    free, total = torch.cuda.mem_get_info(device)
    return int(total), int(free)


def dummy_step(model: torch.nn.Module, kv_caches, *, seq_lens: list[int], num_logit_rows: int,
               max_context_len: int | None = None, sample: bool = False) -> torch.Tensor:
    """Run a step of fresh sequences of ``seq_lens`` tokens (all token 0) over ``kv_caches``,
    laid out one after another from block 0; logits for the last ``num_logit_rows`` tokens,
    sampled with every sampling feature on when ``sample``. For measuring how much memory a
    step takes. ``max_context_len`` overrides what the attention is told (a decode graph is
    captured with the longest allowed context)."""
    cache = kv_caches[0][0]
    device, block_size = cache.device, cache.shape[1]
    lens = np.asarray(seq_lens, dtype=np.int64)
    blocks_per_seq = -(-lens // block_size)
    if int(blocks_per_seq.sum()) > cache.shape[0]:
        raise ValueError(f"the dummy step needs {int(blocks_per_seq.sum())} blocks, the cache "
                         f"has {cache.shape[0]}")
    width = int(blocks_per_seq.max())
    first_block = np.concatenate([[0], np.cumsum(blocks_per_seq)[:-1]])
    block_tables = first_block[:, None] + np.arange(width)[None, :]
    query_start = np.concatenate([[0], np.cumsum(lens)])
    seq_of_token = np.repeat(np.arange(len(lens)), lens)
    positions = np.arange(int(lens.sum())) - query_start[:-1][seq_of_token]
    slots = block_tables[seq_of_token, positions // block_size] * block_size \
        + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device),
        block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(device),
        context_lens=torch.from_numpy(lens.astype(np.int32)).to(device),
        query_start_loc=torch.from_numpy(query_start.astype(np.int32)).to(device),
        max_query_len=int(lens.max()),
        max_context_len=max_context_len or int(lens.max()),
    )
    input_ids = torch.zeros(positions.shape[0], dtype=torch.long, device=device)
    with torch.inference_mode():
        hidden = model(input_ids, torch.from_numpy(positions).to(device), meta, kv_caches)
        logits = model.compute_logits(hidden[-num_logit_rows:])
        if sample:
            vocab = logits.shape[-1]
            params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01,
                                    presence_penalty=0.5, repetition_penalty=1.1,
                                    logprobs=True, top_logprobs=20, seed=0)
            rows = logits.shape[0]
            batch = SamplingBatch.build([params] * rows, [[0] * 8] * rows, [4] * rows,
                                        vocab_size=vocab, device=device)
            Sampler(device, seed=0)(logits, batch).to_host()
    return logits


def measure_peak_memory(device: str | torch.device, run) -> int:
    """Bytes of CUDA memory ``run()`` allocates at its peak beyond what was allocated before."""
    device = torch.device(device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return max(0, int(peak))


def step_memory_reserve(model: torch.nn.Module, *, max_batched_tokens: int, max_batch_size: int,
                        max_model_len: int, block_size: int, dtype: torch.dtype,
                        cuda_graphs: bool) -> int:
    """GPU memory to keep free beside the KV cache, measured: the largest eager step (a prefill
    of ``max_batched_tokens`` sampling ``max_batch_size`` rows with every feature on) plus, with
    CUDA graphs, a decode step of ``max_batch_size`` rows (what the graphs' own pool holds)."""
    config = model.config
    device = next(model.parameters()).device
    num_tokens = max(max_batched_tokens, max_batch_size)
    chunk = max(1, min(num_tokens, max_model_len - 1))
    prefill = [chunk] * (num_tokens // chunk) + ([num_tokens % chunk] if num_tokens % chunk else [])
    blocks = sum(-(-n // block_size) for n in prefill) + max_batch_size
    shape = (blocks, block_size, config.num_kv_heads, config.head_dim)
    scratch = [(torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device)) for _ in range(config.num_layers)]
    rows = min(max_batch_size, num_tokens)
    reserve = measure_peak_memory(device, lambda: dummy_step(
        model, scratch, seq_lens=prefill, num_logit_rows=rows, sample=True))
    if cuda_graphs:
        reserve += measure_peak_memory(device, lambda: dummy_step(
            model, scratch, seq_lens=[1] * max_batch_size, num_logit_rows=max_batch_size,
            max_context_len=max_model_len))
    del scratch
    torch.cuda.empty_cache()
    return reserve


class SmallStepThreads:
    """How many CPU threads the smallest steps (single-stream decode) should use, by measurement.

    A one-token step is a chain of small, memory-bound operations; waking and joining the other
    threads for each one can cost more than the work they share, or not: on a 2-core Zen 4 two
    threads win (14 ms per token), and one thread won (55 against 64 ms) while a second OpenMP
    pool made the threads sleep between operators (see ``Engine.__init__``). So the first small
    steps alternate between one thread and all of them, and the faster (by best time) is kept.
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
    # Prompt tokens scored this step: (sequence, first prompt position, their logprobs).
    prompt_logprobs: list[tuple[Sequence, int, list[TokenLogprob]]] = field(default_factory=list)
    # Embedding requests whose prompt this step finished: (sequence, its embedding, float32).
    embeddings: list[tuple[Sequence, np.ndarray]] = field(default_factory=list)


class PendingStep:
    """A launched step; ``result()`` waits for the device (the step's one wait)."""

    def __init__(self, sampled: list[Sequence], copy: HostCopy | None,
                 prompt_logprobs: list[tuple[Sequence, int, list[TokenLogprob]]] | None = None,
                 embedded: tuple[list[Sequence], torch.Tensor] | None = None) -> None:
        self._sampled = sampled
        self._copy = copy
        self._prompt_logprobs = prompt_logprobs or []
        # The sequences embedded, and their embeddings on their way to the host: they are copied
        # before the sampler's results, so once those are in, so are they.
        self._embedded = embedded

    def result(self) -> StepResult:
        if self._copy is None:
            return StepResult([], [], None, None, None, self._prompt_logprobs)
        token_ids, logprobs, top_ids, top_logprobs = self._copy.lists()
        embeddings = []
        if self._embedded is not None:
            seqs, vectors = self._embedded
            embeddings = list(zip(seqs, vectors.numpy().copy()))
        return StepResult(sampled=self._sampled, token_ids=token_ids, logprobs=logprobs,
                          top_ids=top_ids, top_logprobs=top_logprobs, prompt_logprobs=self._prompt_logprobs,
                          embeddings=embeddings)


class ModelRunner:
    """Runs steps over a KV cache of ``num_blocks`` blocks, plus one zeroed block (index
    ``num_blocks``, never handed out) that padded decode rows attend over.

    ``cuda_graphs`` (CUDA only; ignored elsewhere): capture decode graphs for batch sizes up to
    ``max_batch_size`` and contexts up to ``max_model_len`` (the config's length by default).
    """

    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 device: str | torch.device, dtype: torch.dtype, seed: int | None = None,
                 max_batch_size: int = 64, max_model_len: int | None = None,
                 cuda_graphs: bool = False):
        config = model.config
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pad_block = num_blocks
        self.device = torch.device(device)
        # Whether ``launch`` returns before the step is computed (a GPU runs it meanwhile); on
        # a CPU it returns only when the step is done.
        self.launches_async = self.device.type == "cuda"
        self.vocab_size = config.vocab_size
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len or config.max_position_embeddings
        shape = (num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        # On CPU, empty() leaves a large cache to the OS to back with memory as blocks are first
        # written, so an engine sized for a big pool costs RAM only for what it uses. Attention
        # never reads a slot before it is written (unused tails are masked). On GPUs, zeros.
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        self.kv_caches = [
            (alloc(shape, dtype=dtype, device=self.device),
             alloc(shape, dtype=dtype, device=self.device))
            for _ in range(config.num_layers)
        ]
        for k_cache, v_cache in self.kv_caches:
            k_cache[self.pad_block].zero_()
            v_cache[self.pad_block].zero_()
        self.sampler = Sampler(self.device, seed=seed)
        self.vocab_bytes: VocabBytes | None = None  # set by the engine once a request is guided
        self.threads = SmallStepThreads() if self.device.type == "cpu" else None
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graphs and self.device.type == "cuda":
            self.decode_graphs = self.padded_decode()
            self.decode_graphs.capture()

    def warm_up(self) -> None:
        """Take the first steps' one-time costs before a request does: a short prefill sampled with
        every feature on (kernels and caches built on first use), and on a CPU the single-token
        steps that settle how many threads such steps run with (``SmallStepThreads``)."""
        dummy_step(self.model, self.kv_caches, seq_lens=[16], num_logit_rows=1, sample=True)
        tuner, default_threads = self.threads, torch.get_num_threads()
        while tuner is not None and tuner.choice is None:
            threads = tuner.threads_for(1)
            torch.set_num_threads(threads)
            try:
                started = time.perf_counter()
                dummy_step(self.model, self.kv_caches, seq_lens=[1], num_logit_rows=1)
                tuner.record(1, threads, time.perf_counter() - started)
            finally:
                torch.set_num_threads(default_threads)

    def padded_decode(self) -> DecodeGraphs:
        """Static, padded decode inputs over this runner's cache (captured or not)."""
        return DecodeGraphs(self.model, self.kv_caches, max_batch_size=self.max_batch_size,
                            max_model_len=self.max_model_len, block_size=self.block_size,
                            pad_block=self.pad_block, device=self.device)

    def graph_stats(self) -> dict:
        graphs = self.decode_graphs
        captured = graphs is not None and graphs.captured
        return {
            "cuda_graphs": captured,
            "cuda_graph_batch_sizes": graphs.sizes if captured else None,
            "cuda_graph_capture_s": graphs.capture_seconds if captured else None,
            "cuda_graph_memory_bytes": graphs.memory_bytes if captured else None,
        }

    def execute(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepResult:
        """Run one step; sequences whose new tokens reach their end get a sampled token."""
        return self.launch(seqs, num_new_tokens).result()

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], num_new_tokens: list[int]) -> "PendingStep":
        """Start one step: on a GPU it runs on while the caller does other work, until
        ``result()`` waits for it. The sequences' token lists are read here, not later."""
        graphs = self.decode_graphs
        embeds = any(s.params.embed for s in seqs)
        if graphs is not None and not embeds and _each_takes_its_next_token(seqs, num_new_tokens):
            logits = graphs.run_decode(seqs)  # the lean path of every decode step
            if logits is not None:
                return self._sample(seqs, logits)
        plan = self._plan(seqs, num_new_tokens)
        sampled = [seqs[i] for i in plan.sample_index.tolist()]
        scoring = prompt_scoring.plan(seqs, num_new_tokens, plan.query_start)
        pooling = [row for row, seq in enumerate(sampled) if seq.params.embed] if embeds else []
        if scoring or pooling:  # rare: prompts scored (echo) or embedded, eagerly, along the way
            logits, scored, pooled = self._forward(plan, scoring, pooling)
            embedded = ([sampled[row] for row in pooling], pooled) if pooling else None
            return self._sample(sampled, logits, scored, embedded) if sampled else PendingStep([], None, scored)
        if graphs is not None and plan.max_query_len == 1 \
                and graphs.fits(len(seqs), plan.block_tables.shape[1]):
            logits = graphs.run(DecodeStep(plan.tokens, plan.positions, plan.slots,
                                           plan.context_lens.astype(np.int32),
                                           plan.block_tables))
            if len(sampled) < len(seqs):
                logits = logits[_on(plan.sample_index, self.device)]
        else:
            logits = self._run_eager(plan)
        if not sampled:
            return PendingStep([], None)
        return self._sample(sampled, logits)

    def _sample(self, sampled: list[Sequence], logits: torch.Tensor, scored=None, embedded=None) -> "PendingStep":
        batch = SamplingBatch.build(
            [s.params for s in sampled], [s.token_ids for s in sampled],
            [s.num_prompt_tokens for s in sampled], vocab_size=logits.shape[-1],
            device=self.device, guides=[s.guide for s in sampled], vocab=self.vocab_bytes)
        out: SamplerOutput = self.sampler(logits, batch)
        return PendingStep(sampled, out.to_host_async(), scored, embedded)

    def _run_eager(self, plan: "_StepPlan") -> torch.Tensor | None:
        """Logits of the sampled rows (None when no row samples)."""
        return self._forward(plan)[0]

    def _forward(self, plan: "_StepPlan", scoring: list | None = None, pooling: list[int] = ()):
        """The eager step: the logits of the sampled rows (None when no row samples), the
        prompt logprobs ``scoring`` asks for (``prompt_scoring.plan``; None without), and the
        embeddings of the sampled rows ``pooling`` lists (their last token's final hidden state,
        L2-normalized, float32, on the host or, from a GPU, on their way there)."""
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=_on(plan.slots, device),
            block_tables=_on(plan.block_tables, device),
            context_lens=_on(plan.context_lens.astype(np.int32), device),
            query_start_loc=_on(plan.query_start.astype(np.int32), device),
            max_query_len=plan.max_query_len,
            max_context_len=plan.max_context_len,
        )
        input_ids = _on(plan.tokens, device)
        positions = _on(plan.positions, device)
        num_tokens = plan.tokens.shape[0]
        threads = self.threads.threads_for(num_tokens) if self.threads else 0
        started = time.perf_counter()
        default_threads = torch.get_num_threads()
        if threads and threads != default_threads:
            torch.set_num_threads(threads)
        logits = scored = pooled = None
        try:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
            if scoring:
                scored = prompt_scoring.score(self.model, hidden, scoring, chunk_rows=self.max_batch_size)
            if plan.sample_index.shape[0]:
                last = hidden[_on(plan.last_rows, device)]
                logits = self.model.compute_logits(last)
                if pooling:
                    pooled = _to_host_async(F.normalize(last[_on(np.asarray(pooling), device)].float(), dim=-1))
        finally:
            if threads and threads != default_threads:
                torch.set_num_threads(default_threads)  # MKL's setting is process-wide
        if self.threads:
            self.threads.record(num_tokens, threads, time.perf_counter() - started)
        return logits, scored, pooled

    def _plan(self, seqs: list[Sequence], num_new_tokens: list[int]) -> "_StepPlan":
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
        return _StepPlan(
            tokens=np.asarray(tokens, dtype=np.int64),
            positions=np.ascontiguousarray(positions, dtype=np.int64),
            slots=slots, block_tables=block_tables, context_lens=context_lens,
            query_start=query_start, max_query_len=max_query_len,
            max_context_len=max_context_len, sample_index=sample_index,
            last_rows=query_start[1:][sample_index] - 1,
        )


@dataclass
class _StepPlan:
    """A step's inputs as host arrays."""

    tokens: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    slots: np.ndarray  # int64 [num_tokens]
    block_tables: np.ndarray  # int32 [num_seqs, width]
    context_lens: np.ndarray  # int64 [num_seqs]
    query_start: np.ndarray  # int64 [num_seqs + 1]
    max_query_len: int
    max_context_len: int
    sample_index: np.ndarray  # int64: the rows that sample
    last_rows: np.ndarray  # int64: their last token's index in the flattened batch


def _each_takes_its_next_token(seqs: list[Sequence], num_new_tokens: list[int]) -> bool:
    """Whether a step is a pure decode step: one new token per sequence, its last."""
    return all(n == 1 and s.num_computed_tokens + 1 == s.num_tokens
               for s, n in zip(seqs, num_new_tokens))


def _to_host_async(values: torch.Tensor) -> torch.Tensor:
    """A device tensor copied into pinned host memory without waiting (the step's one wait, in
    ``PendingStep.result``, covers it); a host tensor as it is."""
    if values.device.type == "cpu":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


def _on(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device``, copied without waiting for the device (a copy from pageable
    memory is staged before it returns, so the array may go away at once)."""
    return torch.from_numpy(values).to(device, non_blocking=True)
