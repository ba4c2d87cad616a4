"""The engine: one step loop in its own thread, and a thread-safe API around it.

Callers (a worker's task threads, the CLI, tests) ``submit`` requests from any thread and read
each request's outputs from its own queue through a ``RequestHandle``. Everything else — the
scheduler, the block manager, the sequences, the model — is touched only by the loop thread, so
none of it needs locks. The lock guards only the inbox the loop drains between steps and the
table of live requests.

A step that raises fails the requests in it (finish_reason "error", with the message) and the
loop goes on serving everyone else.

A step's tokens are taken in at once (appended; a stop token, EOS or the length limit ends the
request) and handed out (detokenized, checked for stop strings, delivered) before the next step
is scheduled, or on a GPU during the next step, while the device computes it. A stop string
found then ends a request that is already in that step: its token from there is dropped, never
delivered nor counted.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .guided import Guide, VocabBytes
from .json_grammar import JsonGrammar
from .kv_cache import BlockManager
from .model_runner import (
    ModelRunner,
    device_memory,
    device_name,
    kv_bytes_per_block,
    pick_dtype,
    step_memory_reserve,
)
from .scheduler import Scheduler
from .sequence import (
    FinishReason,
    InvalidRequestError,
    Release,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    Sequence,
    SequenceStatus,
    TokenLogprob,
)
from .tool_calls import ToolGrammar, chat_messages
from .weights import WeightsError, safetensors_files

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY = 2 << 30  # bytes; the cache is allocated lazily by the OS as it fills
# Of the GPU memory free once the weights are loaded: what the KV cache, the step activations
# and the CUDA graphs may take together (the rest is slack for the CUDA context and others).
DEFAULT_CUDA_KV_FRACTION = 0.9


class EngineError(RuntimeError):
    """The engine cannot take the request (stopped, or its loop died)."""


class RequestHandle:
    """A submitted request: iterate it for its outputs, or wait for the whole ``result()``.
    A request submitted with a ``listener`` has its outputs go there instead."""

    def __init__(self, engine: "Engine", request_id: str, prompt_tokens: int,
                 listener: Callable[[RequestOutput], None] | None = None):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._engine = engine
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._put = self._queue.put if listener is None else _guarded(listener, request_id)
        self._parts: list[RequestOutput] = []  # everything handed out so far
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    def __iter__(self) -> Iterator[RequestOutput]:
        return self.outputs()

    def outputs(self, timeout: float | None = None) -> Iterator[RequestOutput]:
        """Outputs as they come; the last has ``finished`` set. ``timeout`` bounds each wait."""
        while not self._done:
            yield self._next(timeout)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the end; one output holding every token, all text and logprobs (including
        any already read through ``outputs()``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            self._next(None if deadline is None else max(0.0, deadline - time.monotonic()),
                       whole=timeout)
        last = self._parts[-1]
        logprobs = None
        if any(p.logprobs is not None for p in self._parts):
            logprobs = [lp for p in self._parts for lp in (p.logprobs or [])]
        return replace(
            last,
            prompt_token_ids=self._parts[0].prompt_token_ids,
            prompt_logprobs=self._parts[0].prompt_logprobs,
            token_ids=[t for p in self._parts for t in p.token_ids],
            text="".join(p.text for p in self._parts),
            logprobs=logprobs,
        )

    def _next(self, timeout: float | None, whole: float | None = None) -> RequestOutput:
        try:
            out = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"request {self.request_id}: no output within "
                               f"{timeout if whole is None else whole} s") from None
        self._parts.append(out)
        self._done = out.finished
        return out

    def abort(self) -> bool:
        return self._engine.abort(self.request_id)

    @property
    def computed_tokens(self) -> int:
        """Its tokens in the KV cache so far: a long prompt, computed chunk by chunk, makes
        progress before its first output. 0 once it ended; it may fall back (a preemption)."""
        return self._engine.computed_tokens(self.request_id)


@dataclass
class _Unhanded:
    """A token the loop took in but has not handed out yet."""

    seq: Sequence
    token: int
    logprob: TokenLogprob | None
    by_token: bool  # a stop token or EOS: it ended the request and adds no text


@dataclass
class _Live:
    """A request between submit and its final output, as the loop tracks it."""

    seq: Sequence
    handle: RequestHandle
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_logprob: TokenLogprob | None = None  # the entry of the stop token that ended it
    delivered: bool = False  # an output went out (the first carries the prompt's logprobs)
    # The timings its outputs carry: a copy, made again only when they change (at the first token
    # and at the end): a dataclass copy per token cost about as much as detokenizing it.
    timings: RequestTimings | None = None


class Engine:
    """Continuous-batching inference over a paged KV cache.

    ``model`` is a path (GGUF file or Hugging Face folder) or an already ``LoadedModel``.
    ``dtype`` defaults to bfloat16 on CUDA; on CPU to float32, unless the chip has native
    bfloat16 (AMX / AVX512-BF16) and a probe matmul runs faster in it (see ``pick_dtype``). The KV
    cache holds ``num_kv_blocks`` blocks, or as many as ``kv_memory`` bytes allow; by default on
    CUDA, ``kv_memory_fraction`` of the memory free after loading the weights, less the measured
    memory of the largest step (and of the CUDA graphs); on CPU, 2 GiB (the fraction is ignored).
    ``cuda_graphs``: on CUDA, replay decode steps from graphs captured per batch-size bucket at
    start (False runs every step eagerly); ignored on CPU.
    ``quantization``: ``"fp8"`` or ``"fp8-per-tensor"`` loads the decoder layers' linear weights
    in FP8 (on CUDA: compute capability 8.9+, bfloat16; see ``fp8.py``); None keeps ``dtype``.
    ``batch_window_ms``: when idle, how long to wait for more requests before the first prefill,
    so that a burst starts as one batch (a full batch starts at once).
    ``warm_up``: run a few dummy steps before serving, so that the first request does not pay
    for what first steps cost (a server wants it; tests that make many engines do not).

    Requests: a prompt that leaves no room in the context, or less than its ``max_tokens``, is
    refused (``InvalidRequestError``, param "prompt"); without ``max_tokens`` a request may fill
    the context, and then ends with finish_reason "length".
    """

    def __init__(self, model: Any, **options: Any):
        """Load ``model`` (a path, or a ``LoadedModel``) with the options above."""
        # The loading runs on a thread of its own, which ends with it. PyTorch's CPU operators run
        # on an OpenMP thread pool that belongs to the thread calling them and lives as long as
        # that thread: a pool left on the caller's thread by the loading would double the
        # threads OpenMP manages, and with more threads than cores it stops spinning between
        # operators and sleeps instead, which made the engine loop's decode steps a quarter
        # slower on two cores. The loop thread then has the only pool.
        on_a_passing_thread(self._build, model, **options)

    def _build(
        self,
        model: Any,
        *,
        dtype: torch.dtype | str | None = None,
        device: str | None = None,
        max_batch_size: int = 64,
        max_batched_tokens: int = 2048,
        num_kv_blocks: int | None = None,
        kv_memory: int | None = None,
        block_size: int = 16,
        batch_window_ms: float = 0.0,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        seed: int | None = None,
        kv_memory_fraction: float | None = None,
        cuda_graphs: bool = True,
        quantization: str | None = None,
        warm_up: bool = False,
    ):
        from .loader import LoadedModel, load_model

        if batch_window_ms < 0:
            raise ValueError(f"batch_window_ms must be >= 0, got {batch_window_ms}")
        if isinstance(dtype, str):
            dtype = _parse_dtype(dtype)
        if isinstance(model, LoadedModel):
            loaded = model
            model_dtype = next(loaded.model.parameters()).dtype
            if dtype is not None and dtype != model_dtype:
                raise ValueError(f"the loaded model is {model_dtype}, not {dtype}")
            if quantization is not None and quantization != loaded.model.quantization:
                raise ValueError(f"the loaded model's quantization is "
                                 f"{loaded.model.quantization}, not {quantization}")
            dtype = model_dtype
            device = str(next(loaded.model.parameters()).device)
        else:
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            dtype = dtype or pick_dtype(device)
            loaded = load_model(model, dtype=dtype, device=device, quantization=quantization)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self.device = device
        self.dtype = dtype

        self.max_model_len = self.config.max_position_embeddings
        if max_model_len is not None:
            if max_model_len < 2:
                raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
            self.max_model_len = min(max_model_len, self.max_model_len)
        self.block_size = block_size
        self.kv_sizing: dict[str, Any] | None = None  # how a CUDA pool was sized, for reports
        self.num_kv_blocks = self._kv_blocks(num_kv_blocks, kv_memory, max_batch_size,
                                             max_batched_tokens=max_batched_tokens,
                                             kv_memory_fraction=kv_memory_fraction,
                                             cuda_graphs=cuda_graphs)
        self.block_manager = BlockManager(self.num_kv_blocks, block_size,
                                          enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_batch_size=max_batch_size,
                                   max_batched_tokens=max_batched_tokens)
        self.runner = ModelRunner(loaded.model, num_blocks=self.num_kv_blocks,
                                  block_size=block_size, device=device, dtype=dtype, seed=seed,
                                  max_batch_size=max_batch_size, max_model_len=self.max_model_len,
                                  cuda_graphs=cuda_graphs)
        if warm_up:
            started = time.perf_counter()
            self.runner.warm_up()
            log.info("engine warmed up in %.2fs", time.perf_counter() - started)
        self.device_name = device_name(device)
        self.fingerprint = fingerprint(model=_weights_identity(loaded.path), dtype=dtype,
                                       quantization=loaded.model.quantization, device=torch.device(device).type)
        self._memory_checked = 0.0  # when device memory was last read (for the stats)
        self._memory = device_memory(device)
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.batch_window = batch_window_ms / 1000.0
        self.enable_prefix_caching = enable_prefix_caching
        self._eos_ids = frozenset(self.config.eos_token_ids) | self.tokenizer.eos_token_ids
        self.tokenizer.text_bytes()  # the detokenizers' table, built now rather than in the first request's submit

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple[str, Any]] = []
        self._live: dict[str, _Live] = {}
        self._unhanded: dict[str, _Unhanded] = {}  # request id -> its one token not handed out
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._crashed: BaseException | None = None
        self.instance = uuid.uuid4().hex[:12]  # tells this engine's counters from a predecessor's
        self._counters = {"steps": 0, "batch_size_max": 0, "batch_size_last": 0,
                          "tokens_last_step": 0, "generated_tokens": 0, "requests_finished": 0,
                          "requests_failed": 0, "requests_aborted": 0, "step_errors": 0,
                          # Where the loop's time goes: choosing the batch, the model step
                          # (inputs, forward, sampling, the wait for its result), and handing the
                          # new tokens out (detokenizing, stop checks, delivery).
                          "schedule_seconds": 0.0, "execute_seconds": 0.0,
                          "postprocess_seconds": 0.0,
                          # Of those, moving JSON output's grammars on (picking is the sampler's).
                          "guide_advance_seconds": 0.0}
        self._stats = self._collect_stats()

    def _kv_blocks(self, num_kv_blocks: int | None, kv_memory: int | None,
                   max_batch_size: int, *, max_batched_tokens: int,
                   kv_memory_fraction: float | None, cuda_graphs: bool) -> int:
        if kv_memory_fraction is not None:
            if isinstance(kv_memory_fraction, bool) \
                    or not isinstance(kv_memory_fraction, (int, float)) \
                    or not 0 < kv_memory_fraction <= 1:
                raise ValueError(f"kv_memory_fraction must be a number in (0, 1], got "
                                 f"{kv_memory_fraction!r}")
        sizes = [name for name, value in (("num_kv_blocks", num_kv_blocks),
                                          ("kv_memory", kv_memory),
                                          ("kv_memory_fraction", kv_memory_fraction))
                 if value is not None]
        if len(sizes) > 1:
            raise ValueError(f"give one of num_kv_blocks, kv_memory and kv_memory_fraction, "
                             f"not {' and '.join(sizes)}")
        if num_kv_blocks is not None:
            if num_kv_blocks < 1:
                raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
            return num_kv_blocks
        per_block = kv_bytes_per_block(self.config, self.block_size, self.dtype)
        # More than every sequence at full length is never needed.
        ceiling = max_batch_size * -(-self.max_model_len // self.block_size)
        if kv_memory is None:
            if str(self.device).startswith("cuda"):
                kv_memory = self._cuda_kv_memory(
                    kv_memory_fraction or DEFAULT_CUDA_KV_FRACTION, max_batch_size,
                    max_batched_tokens, cuda_graphs)
            else:
                kv_memory = DEFAULT_CPU_KV_MEMORY
        # One block more than the pool is allocated: the zeroed block padded rows attend over.
        blocks = min(kv_memory // per_block - 1, ceiling)
        if blocks < 1:
            raise ValueError(f"kv_memory {kv_memory} bytes holds no block beside the padding "
                             f"block ({per_block} bytes each)")
        return int(blocks)

    def _cuda_kv_memory(self, fraction: float, max_batch_size: int, max_batched_tokens: int,
                        cuda_graphs: bool) -> int:
        """Bytes for the KV cache: ``fraction`` of the memory free now that the weights are
        loaded, less what the largest step and the CUDA graphs were measured to need."""
        reserve = step_memory_reserve(
            self.loaded.model, max_batched_tokens=max_batched_tokens,
            max_batch_size=max_batch_size, max_model_len=self.max_model_len,
            block_size=self.block_size, dtype=self.dtype, cuda_graphs=cuda_graphs)
        free, _total = torch.cuda.mem_get_info(torch.device(self.device))
        budget = int(free * fraction) - reserve
        self.kv_sizing = {"free_after_weights": int(free), "fraction": fraction,
                          "step_reserve": reserve, "kv_memory": budget}
        log.info("KV cache: %.2f GiB (%.2f of %.2f GiB free, less %.2f GiB for steps)",
                 budget / 2**30, fraction, free / 2**30, reserve / 2**30)
        if budget <= 0:
            raise ValueError(f"no GPU memory is left for the KV cache: {fraction} of the "
                             f"{free} bytes free after loading the weights is less than the "
                             f"{reserve} bytes the largest step needs (raise kv_memory_fraction, "
                             f"or lower max_batched_tokens or max_batch_size)")
        return budget

    # ------------------------------------------------------------------------------ lifetime

    def start(self) -> "Engine":
        with self._lock:
            if self._stopping:
                raise EngineError("the engine was stopped; make a new one")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="engine-loop",
                                                daemon=True)
                self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop; requests still in flight end with finish_reason "abort"."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fail_all(FinishReason.ABORT, "the engine stopped")

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # ---------------------------------------------------------------------------- public API

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, *,
               request_id: str | None = None,
               listener: Callable[[RequestOutput], None] | None = None) -> RequestHandle:
        """Queue a request; returns at once. Bad input raises ``InvalidRequestError``.

        With a ``listener``, each output is passed to it on the engine's thread, as the step that
        made it ends, instead of waiting in the handle: a server relaying many streams can then
        move a whole step's outputs at once rather than wake a thread per stream and token. It
        must return quickly and not call back into the engine except ``abort``."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, not {type(params).__name__}")
        prompt_ids = self._prompt_ids(prompt)
        max_tokens = self._check_fits(prompt_ids, params)
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id: must be a non-empty string", param="request_id")
        seq = Sequence(request_id, prompt_ids, params, max_tokens=max_tokens,
                       arrival_time=time.monotonic(), detokenizer=self._detokenizer())
        grammar = params.grammar
        if grammar is not None:
            seq.guide = self._guide(params, grammar)
        handle = RequestHandle(self, request_id, len(prompt_ids), listener)
        self.start()
        with self._wake:
            if self._crashed is not None:
                raise EngineError(f"the engine loop died: {self._crashed!r}")
            if self._stopping:
                raise EngineError("the engine is stopped")
            if request_id in self._live:
                raise InvalidRequestError(f"request_id: {request_id!r} is already running",
                                          param="request_id")
            self._live[request_id] = _Live(seq, handle)
            self._inbox.append(("add", seq))
            self._wake.notify()
        return handle

    def submit_chat(self, messages: list[dict], params: SamplingParams | None = None, *,
                    request_id: str | None = None,
                    listener: Callable[[RequestOutput], None] | None = None) -> RequestHandle:
        """Like ``submit``, with the prompt rendered from chat messages by the model's template."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages: must be a non-empty list", param="messages")
        for message in messages:
            if not isinstance(message, dict) or "role" not in message:
                raise InvalidRequestError("messages: each message needs a role",
                                          param="messages")
        shown = params.tools if params is not None else None
        try:
            messages = chat_messages(messages, shown)
        except (KeyError, TypeError, AttributeError) as exc:
            raise InvalidRequestError(f"messages: a tool call is malformed ({exc!r})", param="messages") from exc
        try:
            ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        except (ValueError, TypeError) as exc:  # the template or the tokenizer refused the messages
            raise InvalidRequestError(f"messages: {exc}", param="messages") from exc
        # A template that writes the BOS itself, on a tokenizer that adds one too (Llama 3,
        # Mistral GGUFs), gave two: keep one. One that does not write it keeps the tokenizer's.
        bos = self.tokenizer.bos_token_id
        if bos is not None and ids[:2] == [bos, bos]:
            ids = ids[1:]
        if not ids:
            raise InvalidRequestError("messages: the chat template rendered nothing", param="messages")
        return self.submit(ids, params, request_id=request_id, listener=listener)

    def computed_tokens(self, request_id: str) -> int:
        """See ``RequestHandle.computed_tokens`` (read from any thread: one int of the loop's)."""
        live = self._live.get(request_id)
        return 0 if live is None else live.seq.num_computed_tokens

    def abort(self, request_id: str) -> bool:
        """End a request now (finish_reason "abort"); False if it is not running."""
        with self._wake:
            if request_id not in self._live:
                return False
            self._inbox.append(("abort", request_id))
            self._wake.notify()
        return True

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 *, timeout: float | None = None):
        """Run prompts to the end. One prompt (a str or a list of token ids) → one output;
        a list of prompts → a list of outputs, in order."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts))
        batch = [prompts] if single else list(prompts)
        if isinstance(params, list):
            if len(params) != len(batch):
                raise ValueError("give one SamplingParams per prompt")
            per_prompt = params
        else:
            per_prompt = [params] * len(batch)
        handles: list[RequestHandle] = []
        try:
            for prompt, sp in zip(batch, per_prompt):
                handles.append(self.submit(prompt, sp))
            results = [h.result(timeout=timeout) for h in handles]
        except BaseException:
            for handle in handles:  # leave nothing running that nobody will read
                handle.abort()
            raise
        return results[0] if single else results

    def stats(self) -> dict[str, Any]:
        """A snapshot of the engine's state, refreshed after every step."""
        return dict(self._stats)

    # ----------------------------------------------------------------------------- validation

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty", param="prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            vocab = self.config.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                       for t in ids):
                raise InvalidRequestError(
                    f"prompt: token ids must be this model's own, integers in [0, {vocab}) (ids of "
                    f"another tokenizer, such as tiktoken's, mean other text here: send the text)",
                    param="prompt")
        else:
            raise InvalidRequestError("prompt: must be a string or a list of token ids",
                                      param="prompt")
        if not ids:
            raise InvalidRequestError("prompt: must not be empty", param="prompt")
        return ids

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens: what the context leaves when none is given. A prompt that
        leaves no room for one token or for the max_tokens asked for, or that needs more KV blocks
        than the engine has, is refused."""
        n = len(prompt_ids)
        # An embedding, or a prompt scored without an answer (max_tokens 0): nothing is generated,
        # so the whole context is the prompt's.
        generates = not (params.embed or params.max_tokens == 0)
        if not generates and n > self.max_model_len:
            raise InvalidRequestError(
                f"prompt: {n} tokens are more than this model's context takes ({self.max_model_len})", param="prompt")
        if n >= self.max_model_len and generates:
            raise InvalidRequestError(
                f"prompt: {n} tokens leave no room to generate in this model's context of "
                f"{self.max_model_len} tokens", param="prompt")
        if self.block_manager.blocks_for(n + 1) > self.num_kv_blocks:
            raise InvalidRequestError(
                f"prompt: {n} tokens do not fit in the engine's KV cache "
                f"({self.num_kv_blocks * self.block_size} tokens)", param="prompt")
        vocab = self.config.vocab_size
        for token in params.logit_bias or {}:
            if token >= vocab:
                raise InvalidRequestError(f"logit_bias: token id {token} is not in the "
                                          f"vocabulary of {vocab}", param="logit_bias")
        for token in params.stop_token_ids:
            if token >= vocab:
                raise InvalidRequestError(f"stop_token_ids: token id {token} is not in the "
                                          f"vocabulary of {vocab}", param="stop_token_ids")
        room = self.max_model_len - n
        if params.max_tokens is not None and params.max_tokens > room:
            # As OpenAI: an asked-for length that does not fit is refused, not silently cut.
            raise InvalidRequestError(
                f"prompt: this model's context holds {self.max_model_len} tokens, but "
                f"{n + params.max_tokens} were asked for ({n} in the prompt, {params.max_tokens} "
                f"to generate); shorten the prompt or lower max_tokens", param="prompt")
        return room if params.max_tokens is None else params.max_tokens

    def _guide(self, params: SamplingParams, grammar: JsonGrammar | ToolGrammar) -> Guide:
        """The grammar state of a request whose output must be JSON, ended by its end tokens."""
        ends = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_ids)
        if not ends and grammar.needs_end:
            raise InvalidRequestError(f"{params.guided_by}: this model has no end-of-sequence token to end "
                                      "guided output with", param=params.guided_by)
        if self.runner.vocab_bytes is None:  # once per engine; before the loop can see the request
            self.runner.vocab_bytes = VocabBytes(self.tokenizer.byte_table(), self.config.vocab_size)
        return Guide(grammar.matcher(), ends)

    def _detokenizer(self):
        return self.tokenizer.detokenizer()

    # ------------------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        try:
            while self._wait_for_work():
                self._step()
                self._stats = self._collect_stats()
        except BaseException as exc:  # a bug outside a step: nobody may hang on a dead engine
            log.exception("engine loop died")
            with self._lock:
                self._crashed = exc
            self._fail_all(FinishReason.ERROR, f"the engine loop died: {exc!r}")

    def _wait_for_work(self) -> bool:
        """Take in new requests and aborts; return when a step should run (False: stop)."""
        scheduler = self.scheduler
        with self._wake:
            while True:
                if self._stopping:
                    return False
                inbox, self._inbox = self._inbox, []
                for kind, item in inbox:
                    if kind == "add":
                        scheduler.add(item)
                    else:
                        self._abort_now(item)
                if inbox:
                    self._stats = self._collect_stats()
                if scheduler.running:
                    return True  # the last step's tokens go out while the next one runs
                if self._unhanded:
                    self._hand_out(locked=True)  # nothing to overlap with: deliver now
                    self._stats = self._collect_stats()  # it finished requests: an idle engine reports them
                if scheduler.waiting:
                    # Idle: give a burst of requests the batch window to arrive together.
                    wait = scheduler.waiting[0].timings.arrival_time + self.batch_window \
                        - time.monotonic()
                    if wait <= 0 or len(scheduler.waiting) >= self.max_batch_size:
                        return True
                    self._wake.wait(wait)
                else:
                    self._wake.wait()

    def _abort_now(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None:
            return
        if live.seq.status is SequenceStatus.FINISHED:
            # It ended at the last step and only its final output is pending: that is how it
            # ended, not an abort.
            self._finish_live(live.seq, locked=True)
            return
        self.scheduler.finish(live.seq, FinishReason.ABORT)
        self._counters["requests_aborted"] += 1
        self._absorb_unhanded(live)
        self._deliver(live, finished=True, locked=True)

    def _step(self) -> None:
        """Schedule and launch a step; while the device runs it, hand out the previous step's
        tokens (detokenizing, stop strings, delivery); then take this step's tokens in."""
        scheduler = self.scheduler
        counters = self._counters
        if not self.runner.launches_async:
            # Nothing would run meanwhile: handing out after the step would only delay tokens.
            handing_out = time.perf_counter()
            self._hand_out()
            counters["postprocess_seconds"] += time.perf_counter() - handing_out
        started = time.perf_counter()
        batch = scheduler.schedule()
        scheduled = time.perf_counter()
        counters["schedule_seconds"] += scheduled - started
        for seq in batch.finished:  # ended by the scheduler: the pool cannot hold them
            self._finish_live(seq)
        if not batch.seqs:
            self._hand_out()
            if not scheduler.running and scheduler.waiting:
                # Cannot happen while submit() checks prompts against the pool; never spin.
                seq = scheduler.waiting[0]
                seq.error = "the request cannot be scheduled"
                scheduler.finish(seq, FinishReason.ERROR)
                self._finish_live(seq)
            return
        try:
            pending = self.runner.launch(batch.seqs, batch.num_new_tokens)
            launched = time.perf_counter()
            self._hand_out()
            handed_out = time.perf_counter()
            result = pending.result()
        except Exception as exc:
            log.exception("engine step failed; failing its %d requests", len(batch.seqs))
            counters["step_errors"] += 1
            for seq in batch.seqs:
                if seq.status is SequenceStatus.FINISHED:
                    continue
                seq.error = f"the engine step failed: {type(exc).__name__}: {exc}"
                scheduler.finish(seq, FinishReason.ERROR, invalidate=True)
                self._finish_live(seq)
            return
        executed = time.perf_counter()
        counters["execute_seconds"] += (launched - scheduled) + (executed - handed_out)
        counters["postprocess_seconds"] += handed_out - launched
        counters["steps"] += 1
        counters["batch_size_last"] = len(batch.seqs)
        counters["batch_size_max"] = max(counters["batch_size_max"], len(batch.seqs))
        counters["tokens_last_step"] = batch.num_tokens
        counters["generated_tokens"] += len(result.sampled)

        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is not SequenceStatus.FINISHED:  # a stop string ended it meanwhile
                seq.num_computed_tokens += num_new
        for seq, start, entries in result.prompt_logprobs:
            seq.prompt_logprobs[start:start + len(entries)] = entries
        for seq, vector in result.embeddings:  # the sequence ends as it takes its (dropped) token
            seq.embedding = vector
        now = time.monotonic()
        batch_size = len(result.sampled)
        for row, seq in enumerate(result.sampled):
            seq.sampled_steps += 1
            seq.sampled_alongside += batch_size
            logprob = None
            if seq.params.logprobs:
                top = []
                if seq.params.top_logprobs:
                    k = seq.params.top_logprobs
                    top = list(zip(result.top_ids[row][:k], result.top_logprobs[row][:k]))
                logprob = TokenLogprob(result.token_ids[row], result.logprobs[row], top)
            self._take_token(seq, result.token_ids[row], logprob, now)
        counters["postprocess_seconds"] += time.perf_counter() - executed

    def _take_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None,
                    now: float) -> None:
        """A new token, as far as scheduling needs it: appended, and the request finished if
        the token or its count ends it. Its text and delivery wait for ``_hand_out``."""
        live = self._live.get(seq.request_id)
        if live is None or live.seq is not seq:
            return  # aborted, or ended by a stop string while this step ran: token dropped
        if seq.max_tokens == 0:  # its prompt is scored or embedded: the token after it is not wanted
            self.scheduler.finish(seq, FinishReason.LENGTH)
            self._finish_live(seq)
            return
        if seq.guide is not None and seq.guide.stuck:  # a grammar left nothing to pick: a bug, said so
            seq.error = "the reply could not go on in the requested format"
            self.scheduler.finish(seq, FinishReason.ERROR)
            self._finish_live(seq)
            return
        seq.token_ids.append(token)
        if seq.guide is not None:
            started = time.perf_counter()
            seq.guide.advance(token, self.runner.vocab_bytes)
            self._counters["guide_advance_seconds"] += time.perf_counter() - started
        if seq.first_token_time is None:
            seq.first_token_time = now
            seq.timings.time_to_first_token = now - seq.timings.arrival_time
        seq.last_token_time = now
        params = seq.params
        by_token = token in params.stop_token_ids or (
            not params.ignore_eos and token in self._eos_ids)
        if by_token:
            seq.stop_reason = token
            self.scheduler.finish(seq, FinishReason.STOP)
        elif seq.num_output_tokens >= seq.max_tokens:
            self.scheduler.finish(seq, FinishReason.LENGTH)
        self._unhanded[seq.request_id] = _Unhanded(seq, token, logprob, by_token)

    def _hand_out(self, *, locked: bool = False) -> None:
        """Deliver the tokens ``_take_token`` took: text, stop strings, outputs."""
        unhanded, self._unhanded = self._unhanded, {}
        for request_id, item in unhanded.items():
            live = self._live.get(request_id)
            if live is None or live.seq is not item.seq:
                continue
            seq = item.seq
            try:
                stop = self._absorb(live, item)
            except Exception as exc:  # e.g. the tokenizer choking on a token: this request only
                log.exception("request %s failed after its step", request_id)
                seq.error = f"processing the new token failed: {type(exc).__name__}: {exc}"
                self.scheduler.finish(seq, FinishReason.ERROR)
                seq.finish_reason = FinishReason.ERROR  # also if its last token had ended it
                self._finish_live(seq, locked=locked)
                continue
            if stop is not None:
                seq.stop_reason = stop
                if seq.status is SequenceStatus.FINISHED:
                    seq.finish_reason = FinishReason.STOP  # found on a length-ending token
                else:
                    # It may be in the step now running: its token from there is dropped.
                    self.scheduler.finish(seq, FinishReason.STOP)
            if seq.status is SequenceStatus.FINISHED:
                self._finish_live(seq, locked=locked)
            else:
                self._deliver(live, finished=False)

    def _absorb_unhanded(self, live: _Live) -> None:
        """A request about to end: its token not handed out yet goes with the final output."""
        item = self._unhanded.pop(live.seq.request_id, None)
        if item is None or item.seq is not live.seq:
            return
        try:
            self._absorb(live, item)
        except Exception:  # the request is ending anyway: its last piece of text is lost
            log.exception("request %s: its last token could not be decoded", item.seq.request_id)

    def _absorb(self, live: _Live, item: "_Unhanded") -> str | None:
        """Add a taken token to its request's pending output; the stop string its text
        completes, if any."""
        gate = item.seq.output_gate
        if item.by_token:
            # It ends the request, so the text held back is plain text after all, and goes
            # before this token, which adds no text nor a logprob entry (as OpenAI's chat; its
            # entry goes apart, for completions: ``RequestOutput.stop_token_logprob``).
            self._add_pending(live, gate.flush())
            live.pending_ids.append(item.token)
            live.stop_logprob = item.logprob
            return None
        gate.add(item.token, item.logprob)
        guide = item.seq.guide
        released = gate.feed(item.seq.detokenizer.push(item.token),
                             stops=guide is None or guide.matcher.stops_apply)
        self._add_pending(live, released)
        return released.stop

    @staticmethod
    def _add_pending(live: _Live, released: Release) -> None:
        live.pending_ids += released.token_ids
        live.pending_text += released.text
        live.pending_logprobs += released.logprobs

    def _finish_live(self, seq: Sequence, *, locked: bool = False) -> None:
        live = self._live.get(seq.request_id)
        if live is None or live.seq is not seq:
            return
        self._absorb_unhanded(live)
        if seq.finish_reason is FinishReason.ERROR:
            self._counters["requests_failed"] += 1
        else:
            self._counters["requests_finished"] += 1
        # Text held back as a possible start of a stop string is plain text after all, however
        # the sequence ended (a matched stop string leaves nothing held); its tokens go with it.
        self._add_pending(live, seq.output_gate.flush())
        self._deliver(live, finished=True, locked=locked)

    def _deliver(self, live: _Live, *, finished: bool, locked: bool = False) -> None:
        seq = live.seq
        timings = seq.timings
        if finished:
            now = time.monotonic()
            timings.e2e_latency = now - timings.arrival_time
            if seq.first_token_time is not None and seq.num_output_tokens > 1:
                timings.time_per_output_token = (seq.last_token_time - seq.first_token_time) \
                    / (seq.num_output_tokens - 1)
            if seq.sampled_steps:
                timings.mean_batch_size = seq.sampled_alongside / seq.sampled_steps
        if finished or live.timings is None or live.timings.time_to_first_token != timings.time_to_first_token:
            live.timings = replace(timings)  # the sequence's own keeps changing
        out = RequestOutput(
            request_id=seq.request_id,
            token_ids=live.pending_ids,
            text=live.pending_text,
            logprobs=live.pending_logprobs if seq.params.logprobs else None,
            finished=finished,
            finish_reason=seq.finish_reason.value if finished and seq.finish_reason else None,
            prompt_tokens=seq.num_prompt_tokens,
            cached_prompt_tokens=seq.num_cached_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            timings=live.timings,
            stop_reason=seq.stop_reason if finished else None,
            error=seq.error if finished else None,
            embedding=seq.embedding if finished else None,
            stop_token_logprob=live.stop_logprob if finished and seq.params.logprobs else None,
        )
        # The prompt's logprobs go with the first output, if whole (a request ended while its
        # prompt was being computed has some missing); a copy: a preemption recomputes them.
        if not live.delivered and seq.prompt_logprobs is not None and None not in seq.prompt_logprobs[1:]:
            out.prompt_token_ids = seq.token_ids[:seq.num_prompt_tokens]
            out.prompt_logprobs = list(seq.prompt_logprobs)
        live.delivered = True
        live.pending_ids, live.pending_text, live.pending_logprobs = [], "", []
        if finished:
            if locked:
                self._live.pop(seq.request_id, None)
            else:
                with self._lock:
                    self._live.pop(seq.request_id, None)
        live.handle._put(out)

    def _fail_all(self, reason: FinishReason, message: str) -> None:
        """End every request still known (engine stopping or dead)."""
        with self._lock:
            lives = list(self._live.values())
            self._live.clear()
            self._inbox.clear()
        for live in lives:
            seq = live.seq
            self._absorb_unhanded(live)
            if seq.status is not SequenceStatus.FINISHED:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
                seq.error = message if reason is FinishReason.ERROR else None
            self._deliver(live, finished=True, locked=True)

    def _collect_stats(self) -> dict[str, Any]:
        bm = self.block_manager
        scheduler = self.scheduler
        return {
            "instance": self.instance,
            **self._counters,
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "preemptions": scheduler.num_preemptions,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_cached": bm.num_cached_blocks,
            "kv_block_size": bm.block_size,
            "prefix_cache_hit_tokens": bm.prefix_hits,
            "prefix_cache_query_tokens": bm.prefix_queries,
            "prefix_cache_hit_rate": bm.prefix_hits / bm.prefix_queries if bm.prefix_queries
            else 0.0,
            "max_batch_size": self.max_batch_size,
            "max_batched_tokens": self.max_batched_tokens,
            "max_model_len": self.max_model_len,
            "dtype": str(self.dtype).removeprefix("torch."),
            "quantization": self.runner.model.quantization,
            "device": str(self.device),
            "device_name": self.device_name,
            **self._device_memory_stats(),
            "kv_capacity_tokens": bm.num_blocks * bm.block_size,
            "guide_seconds": self._counters["guide_advance_seconds"] + self.runner.sampler.guide_seconds,
            **self.runner.graph_stats(),
        }

    def _device_memory_stats(self) -> dict[str, int | None]:
        # Read at most once a second: the stats are refreshed after every step.
        now = time.monotonic()
        if self._memory[0] is not None and now - self._memory_checked >= 1.0:
            self._memory = device_memory(self.device)
            self._memory_checked = now
        total, free = self._memory
        return {"device_memory_total": total, "device_memory_free": free}


def _guarded(listener: Callable[[RequestOutput], None], request_id: str) -> Callable[[RequestOutput], None]:
    """A listener's failure is its own: the engine's loop goes on."""
    def put(out: RequestOutput) -> None:
        try:
            listener(out)
        except Exception:
            log.exception("the listener of request %s failed", request_id)

    return put


# Changed whenever the engine's numerics change (its kernels, its sampling): part of every
# engine's fingerprint.
NUMERICS_REVISION = 1


def fingerprint(*, model: str, dtype: torch.dtype, quantization: str | None, device: str) -> str:
    """What OpenAI's ``system_fingerprint`` says: the backend configuration the outputs came from.
    Two engines with the same one compute the same logits for the same batch; a changed dtype
    (which ``pick_dtype`` may choose differently on another machine), quantization, device or
    engine revision changes it, telling a client that seeded outputs may differ."""
    config = f"{NUMERICS_REVISION}|{model}|{str(dtype).removeprefix('torch.')}|{quantization or ''}|{device}"
    return "fp_" + hashlib.sha256(config.encode()).hexdigest()[:12]


def _weights_identity(path) -> str:
    """The weights' name and size: a file replaced by other weights under its name changes it."""
    path = Path(path)
    try:
        files = safetensors_files(path) if path.is_dir() else [path]
        return f"{path.name}:{sum(f.stat().st_size for f in files)}"
    except (OSError, WeightsError):
        return path.name


def on_a_passing_thread(fn, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on a new thread that ends when it returns; its result or error.
    An interrupt while waiting (Ctrl-C) reaches the caller, and the thread runs on to its end."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller as is
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="engine-setup", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome.pop("error")  # popped: its traceback would otherwise keep ``outcome`` alive
    return outcome["result"]


def _parse_dtype(name: str) -> torch.dtype:
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    try:
        return names[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(names)})") from None
