"""The CPU attention kernels in ``csrc/``: built on first use, called through ctypes.

``paged_decode.c`` (one new token per sequence) is plain C99 plus OpenMP pragmas; ``paged_prefill.c``
(several new tokens per sequence) uses the AVX-512 BF16 instructions where the CPU has them and
builds to a stub elsewhere (``prefill_available()`` says which); ``fused_ops.c`` has the
decoder's elementwise ops for a bfloat16 model (used by ``workers.engine.cpu_ops``). The
system C compiler (the one Triton needs on GPU workers anyway) builds them into one library in
a second or two. The library is cached per source, flags and CPU, so later processes only load
it. Without a compiler, or with
``ENGINE_NATIVE_KERNELS=0``, ``available()`` is False and the caller keeps its PyTorch path.

The kernels parallelise themselves with OpenMP, on the runtime (and so the threads) PyTorch uses;
ctypes releases the GIL for the call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..cpuinfo import cpuinfo_field

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # every .c file in it goes into the one library
# Vectorised float reductions need reassociation; full -ffast-math would also assume no
# infinities, which the softmax's running maximum starts from.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
if platform.machine() in ("x86_64", "AMD64"):
    # Where AVX-512 is there, use all of it: compilers default to half width on some CPUs.
    FLAGS.insert(2, "-mprefer-vector-width=512")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failed = False


def available() -> bool:
    return _load() is not None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(os.environ.get("ENGINE_KERNEL_CACHE") or Path(base) / "inference-platform" / "kernels")


def _cpu_signature() -> str:
    return cpuinfo_field("flags") or platform.processor() or platform.machine()


def _build() -> Path:
    compiler = os.environ.get("CC", "cc")
    sources = sorted(CSRC.glob("*.c"))
    # Headers too: a change to any file is a new library.
    digest = hashlib.sha256()
    for path in sorted([*sources, *CSRC.glob("*.h")]):
        digest.update(path.read_bytes() + b"\0")
    digest.update("\0".join([compiler, *FLAGS, _cpu_signature()]).encode())
    key = digest.hexdigest()[:16]
    target = cache_dir() / f"attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed, so processes building at once never load half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", partial, *map(str, sources), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _load() -> ctypes.CDLL | None:
    global _library, _failed
    if _library is not None or _failed:
        return _library
    with _lock:
        if _library is not None or _failed:
            return _library
        if os.environ.get("ENGINE_NATIVE_KERNELS", "1").lower() in ("0", "false", "no", "off"):
            _failed = True
            return None
        try:
            library = ctypes.CDLL(str(_build()))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("CPU attention kernel unavailable, using the PyTorch path: %s", detail)
            _failed = True
            return None
        ptr, num = ctypes.c_void_p, ctypes.c_int
        for fn in (library.paged_decode_f32, library.paged_decode_bf16):
            fn.argtypes = [ptr, ptr, ptr, ptr, num, ptr, ptr, num, num, num, num, num, num,
                           ctypes.c_float]
            fn.restype = ctypes.c_int
        library.paged_prefill_bf16.argtypes = [ptr, ctypes.c_int64, ptr, ptr, ptr, num, ptr, ptr, ptr,
                                               num, num, num, num, num, ctypes.c_float]
        library.paged_prefill_bf16.restype = ctypes.c_int
        library.paged_prefill_supported.restype = ctypes.c_int
        library.add_rms_norm_bf16.argtypes = [ptr, ptr, ptr, ptr, num, num, ctypes.c_float]
        library.rope_bf16.argtypes = [ptr, ctypes.c_int64, num, num, num, ptr, ptr]
        library.silu_and_mul_bf16.argtypes = [ptr, ptr, num, num]
        for fn in (library.add_rms_norm_bf16, library.rope_bf16, library.silu_and_mul_bf16):
            fn.restype = None
        _library = library
        return library


CACHE_DTYPES = (torch.float32, torch.bfloat16)


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these tensors are the kernel's case: on the CPU, the caches contiguous and both
    float32 or both bfloat16 (the query may be either; the kernel computes in float32), and a
    head size the kernel's 16-float vectors divide, up to 256."""
    head_dim = query.shape[-1]
    return head_dim % 16 == 0 and head_dim <= 256 \
        and all(t.device.type == "cpu" for t in (query, k_cache, v_cache)) \
        and query.dtype in CACHE_DTYPES and k_cache.dtype in CACHE_DTYPES \
        and k_cache.dtype == v_cache.dtype \
        and k_cache.is_contiguous() and v_cache.is_contiguous()


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context: [S, H, D] → [S, H, D]."""
    library = _load()
    if library is None:
        raise RuntimeError("the CPU attention kernel is not available")
    if not supports(query, k_cache, v_cache):  # past these, the kernel would read out of bounds
        raise ValueError(f"the CPU attention kernel does not take these tensors (head size "
                         f"{query.shape[-1]}, {query.dtype}, cache {k_cache.dtype})")
    dtype = query.dtype
    query = query.to(torch.float32).contiguous()
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    args = (query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            tables.shape[1], lens.data_ptr(), out.data_ptr())
    shape = (num_heads, num_kv_heads, head_dim, block_size, float(scale))

    kernel = library.paged_decode_bf16 if k_cache.dtype == torch.bfloat16 \
        else library.paged_decode_f32
    if kernel(*args, num_seqs, int(lens.max()), *shape):
        raise MemoryError("the CPU attention kernel could not allocate its score buffer")
    return out.to(dtype)


def prefill_available() -> bool:
    """Whether the prefill kernel was built for real (the CPU has AVX-512 BF16)."""
    library = _load()
    return library is not None and bool(library.paged_prefill_supported())


def prefill_supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these tensors are the prefill kernel's case: all bfloat16 on the CPU, the caches
    contiguous, each token's query heads contiguous, a head size that 32 divides (up to 256) and
    blocks of a multiple of 16 tokens."""
    head_dim = query.shape[-1]
    return head_dim % 32 == 0 and head_dim <= 256 and k_cache.shape[1] % 16 == 0 \
        and all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in (query, k_cache, v_cache)) \
        and k_cache.is_contiguous() and v_cache.is_contiguous() \
        and query.stride(2) == 1 and query.stride(1) == head_dim


def paged_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Causal attention of each sequence's new tokens (more than one) over its cached context,
    written into ``out`` [T, H, D]; the rows of sequences with one new token are left alone."""
    if not prefill_available():
        raise RuntimeError("the CPU prefill attention kernel is not available on this CPU")
    if not prefill_supports(query, k_cache, v_cache) or out.dtype != torch.bfloat16 \
            or not out.is_contiguous() or out.shape != query.shape:
        raise ValueError(f"the CPU prefill attention kernel does not take these tensors (head size "
                         f"{query.shape[-1]}, {query.dtype}, cache {k_cache.dtype}, block size "
                         f"{k_cache.shape[1]})")
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = block_tables.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    _check_prefill_metadata(query, k_cache, v_cache, tables, starts, lens)
    status = _load().paged_prefill_bf16(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.shape[1], starts.data_ptr(), lens.data_ptr(), out.data_ptr(), lens.shape[0], num_heads,
        num_kv_heads, head_dim, block_size, float(scale))
    if status == -1:
        raise MemoryError("the CPU prefill attention kernel could not allocate its scratch")
    if status:
        raise ValueError("the CPU prefill attention kernel refused these shapes")


def _check_prefill_metadata(query, k_cache, v_cache, tables, starts, lens) -> None:
    """What the kernel trusts, checked in O(sequences): past these it would read or write out of
    bounds, or attend a row to nothing."""
    num_seqs = lens.shape[0]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    q_lens = starts[1:] - starts[:-1] if starts.shape[0] == num_seqs + 1 else None
    problem = None
    if v_cache.shape != k_cache.shape or head_dim != query.shape[2] \
            or query.shape[1] % num_kv_heads:
        problem = "the caches and the query do not fit together"
    elif q_lens is None or tables.dim() != 2 or tables.shape[0] < num_seqs:
        problem = "query_start_loc, context_lens and block_tables do not describe the same sequences"
    elif num_seqs and (int(starts[0]) != 0 or int(starts[-1]) > query.shape[0] or bool((q_lens < 0).any())):
        problem = "query_start_loc does not lie within the query"
    elif num_seqs and (bool((lens < q_lens).any()) or int(lens.max()) > tables.shape[1] * block_size):
        problem = "a context is shorter than its new tokens or longer than its block table"
    elif tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        problem = "a block table names a block outside the cache"
    if problem:
        raise ValueError(f"the CPU prefill attention kernel refused its metadata: {problem}")
