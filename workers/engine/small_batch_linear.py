"""Matmuls of a decode step's few rows on NVIDIA GPUs: a Triton kernel where it beats cuBLAS.

A decode step multiplies a handful of rows by each weight matrix, so its matmuls are reads of the
weights: a good one keeps every SM streaming them. cuBLAS chooses its tiles for larger products
and for some decode shapes leaves SMs idle (measured on an H100: a Llama-3-8B ``o_proj``,
4096 x 4096 at batch 1, took 20.7 us in a decode step, 54% of the copy bandwidth, on 64 tiles
for 132 SMs; this kernel takes 14). The kernel here gives each
program a narrow band of output columns and streams that band's weight rows through the
pipeline, so even a square weight makes one or two programs per SM.

Nothing is assumed about which wins where: ``SmallBatchLinear.tune`` times both on the model's own
weights (a CUDA graph of one call per layer, as decode steps replay them), per weight shape and
per decode batch-size bucket, and a call goes to the kernel only where it measured faster.

FP8 weights (``fp8.Fp8Weight``: e4m3 values and per-channel or per-tensor scales) go through the
same kernel: it reads the e4m3 values (half the bytes), widens them to the activations' dtype in
registers and applies the scales to the result. The activations stay as they are, so at decode
sizes this skips the two kernels per matmul that quantizing them and scaling the result cost the
``torch._scaled_mm`` path, and is closer to the unquantized model besides.

With ``TRITON_INTERPRET=1`` set while this module is imported, the kernel runs on CPU tensors in
Triton's interpreter (how the tests check it without a GPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

# The kernel pads the rows to this (the smallest tile a Triton dot takes): up to it, a call
# reads each weight once whatever the row count.
MAX_ROWS = 16
ROW_BUCKETS = (1, 2, 4, 8, 16)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)  # of the activations (and unscaled weights)
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)

# Triton decided at decoration time (at import) whether the kernel is interpreted. The
# interpreter's dot misreads bfloat16 operands, so interpreted, it multiplies in float32.
_INTERPRETED = bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True)
class TileConfig:
    block_n: int  # output columns per program
    block_k: int  # weight columns per pipeline stage
    num_warps: int
    num_stages: int


# Candidates for ``tune``: bands of columns narrow enough to give every SM one or more programs
# on the common shapes, each with a deep pipeline; wider bands with more warps for the widest
# weights (an MLP's gate/up), where there are programs to spare.
CANDIDATES = (
    TileConfig(16, 256, 4, 4),
    TileConfig(16, 512, 4, 3),
    TileConfig(16, 128, 2, 8),
    TileConfig(32, 256, 4, 4),
    TileConfig(32, 128, 4, 6),
    TileConfig(32, 512, 8, 3),
    TileConfig(64, 128, 4, 4),
    TileConfig(64, 256, 8, 4),
    TileConfig(128, 128, 8, 4),
)


@triton.jit
def _small_batch_linear_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr,
    M, N,
    stride_x, stride_w, stride_y,
    K: tl.constexpr,  # a constant: one compile per weight shape, and no masks where it divides
    HAS_BIAS: tl.constexpr,
    SCALES: tl.constexpr,  # 0: none; 1: one per output column; 2: one for the whole weight
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """y[M, N] = x[M, K] @ (w[N, K] * scale)^T (+ bias) for M <= BLOCK_M; one program per
    BLOCK_N columns. ``w`` may be narrower than ``x`` (FP8): it is widened to x's dtype."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros is not a builtin (interpreter)
    for k in range(0, K, BLOCK_K):
        x_mask = row_ok[:, None]
        w_mask = col_ok[:, None]
        if not EVEN_K:
            k_ok = (k + ks) < K
            x_mask = x_mask & k_ok[None, :]
            w_mask = w_mask & k_ok[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(x.dtype)
        if INTERPRETED:  # the interpreter's dot misreads bfloat16 operands
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALES == 1:
        acc *= tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    elif SCALES == 2:
        acc *= tl.load(scale_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: TileConfig = CANDIDATES[0], *,
                       scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight * scale, bias)`` for at most ``MAX_ROWS`` rows of ``x`` through the
    kernel. ``scale`` (float32, one per output row of ``weight`` or a single one) comes with FP8
    weights; without it the weight has x's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply "
                         f"(need x [M, K], weight [N, K])")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"small_batch_linear takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"small_batch_linear needs bfloat16 or float16 x, got {x.dtype}")
    if weight.dtype != x.dtype and (scale is None or weight.dtype != FP8_DTYPE):
        raise ValueError(f"small_batch_linear needs a weight of x's dtype ({x.dtype}), or FP8 "
                         f"with its scales; got {weight.dtype}"
                         + ("" if scale is not None else " and no scales"))
    if scale is not None and (scale.dtype != torch.float32
                              or scale.shape not in ((), (weight.shape[0],))):
        raise ValueError(f"scales must be float32, one per output ({weight.shape[0]}) or one "
                         f"in all; got {scale.dtype} {tuple(scale.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not match {weight.shape[0]} outputs")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("small_batch_linear needs x and weight contiguous along K")
    m = x.shape[0]
    n, k = weight.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    _small_batch_linear_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, scale if scale is not None else y, bias if bias is not None else y, y,
        m, n,
        x.stride(0), weight.stride(0), y.stride(0),
        K=k, HAS_BIAS=bias is not None,
        SCALES=0 if scale is None else 1 if scale.dim() == 1 else 2, EVEN_K=k % config.block_k == 0,
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        INTERPRETED=_INTERPRETED,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y


@dataclass
class ShapeChoice:
    """What ``tune`` decided for one weight shape."""

    config: TileConfig | None  # the fastest tile configuration; None: the fallback everywhere
    max_rows: int  # the kernel runs calls of up to this many rows (0: none)
    timings: dict = field(default_factory=dict)  # per bucket: kernel and fallback, seconds a call


class SmallBatchLinear:
    """The model's ``linear``: its ``fallback`` (``F.linear``, or the FP8 matmul for FP8 weights)
    unless ``tune`` found the kernel faster for the weight's shape at the call's row count.
    Untuned, it is the fallback."""

    def __init__(self, fallback: Callable[..., torch.Tensor] = F.linear) -> None:
        self.fallback = fallback
        self.choices: dict[tuple, ShapeChoice] = {}
        self.tune_seconds: float | None = None

    def __call__(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > MAX_ROWS:  # a prefill: no key to look up
            return self.fallback(x, weight, bias)
        choice = self.choices.get(_key(weight))
        if choice is not None and x.shape[0] <= choice.max_rows:
            values, scale = _operands(weight)
            return small_batch_linear(x, values, bias, choice.config, scale=scale)
        return self.fallback(x, weight, bias)

    def tune(self, layers: list[list[tuple]], *, activation_dtype: torch.dtype,
             candidates: tuple[TileConfig, ...] = CANDIDATES, replays: int = 5) -> None:
        """Decide per weight shape. ``layers[i]`` holds layer i's (weight, bias) pairs, the same
        shapes in the same order in every layer; each timing runs one call per layer, so that
        the weights stream from memory as in a decode step rather than sit in the L2 cache."""
        started = time.perf_counter()
        for column in zip(*layers):
            key = _key(column[0][0])
            if key in self.choices or not _tunable(column[0][0], activation_dtype):
                continue
            self.choices[key] = _tune_shape(list(column), candidates, replays,
                                            activation_dtype, self.fallback)
        self.tune_seconds = time.perf_counter() - started

    def report(self) -> dict:
        """The decisions, for the engine's statistics and the benchmarks."""
        return {
            "tune_s": self.tune_seconds,
            "shapes": {
                f"{n}x{k}" + ("" if scales is None
                              else f" {str(dtype).removeprefix('torch.')} scaled"): {
                    "config": None if c.config is None else vars(c.config),
                    "max_rows": c.max_rows, "timings": c.timings}
                for (n, k, dtype, scales), c in self.choices.items()},
        }


def _operands(weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values, scales or None): an FP8 weight (``fp8.Fp8Weight``) is its e4m3 values and scales."""
    if isinstance(weight, torch.Tensor):
        return weight, None
    return weight.qweight, weight.scale


def _key(weight) -> tuple:
    values, scale = _operands(weight)
    return values.shape[0], values.shape[1], values.dtype, None if scale is None else scale.dim()


def _tunable(weight, activation_dtype: torch.dtype) -> bool:
    values, scale = _operands(weight)
    if not values.is_cuda or activation_dtype not in SUPPORTED_DTYPES:
        return False
    return values.dtype == activation_dtype if scale is None else values.dtype == FP8_DTYPE


def _tune_shape(pairs: list[tuple], candidates: tuple[TileConfig, ...], replays: int,
                dtype: torch.dtype, fallback: Callable[..., torch.Tensor]) -> ShapeChoice:
    """The fastest configuration at one row (what the kernel is for), then per bucket whether it
    beats the fallback."""
    values = _operands(pairs[0][0])[0]
    x = {rows: torch.randn(rows, values.shape[1], device=values.device, dtype=dtype)
         for rows in ROW_BUCKETS}
    operands = [(*_operands(w), b) for w, b in pairs]

    def kernel(config, rows):
        return lambda: [small_batch_linear(x[rows], v, b, config, scale=s)
                        for v, s, b in operands]

    def other(rows):
        return lambda: [fallback(x[rows], w, b) for w, b in pairs]

    best, best_s = None, float("inf")
    for config in candidates:
        try:
            seconds = _time_per_call(kernel(config, 1), len(pairs), replays)
        except OutOfResources:  # more shared memory than this GPU has: not a candidate here
            continue
        if seconds < best_s:
            best, best_s = config, seconds
    if best is None:
        return ShapeChoice(config=None, max_rows=0)
    timings, max_rows = {}, 0
    for rows in ROW_BUCKETS:
        ours = best_s if rows == 1 else _time_per_call(kernel(best, rows), len(pairs), replays)
        theirs = _time_per_call(other(rows), len(pairs), replays)
        timings[rows] = {"kernel_s": ours, "fallback_s": theirs}
        if ours >= theirs:
            break
        max_rows = rows
    return ShapeChoice(config=best if max_rows else None, max_rows=max_rows, timings=timings)


def _time_per_call(run, calls: int, replays: int) -> float:
    """Seconds per call of ``run`` (``calls`` matmuls) replayed from a CUDA graph."""
    run()  # compiles the kernel, settles the allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: another engine's loop thread in this process may be running kernels.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000 / (replays * calls)
    del graph
    return seconds
