"""Benchmark the Triton paged-attention kernels against baselines measured in the same run.

Decode (one new token per sequence; memory-bound): achieved bytes/s (K and V read through the
block tables, plus the query and the output) as a fraction of a plain device-to-device copy of a
large buffer, and the time against PyTorch's scaled_dot_product_attention on the same data laid
out contiguously (no paging).

Prefill (causal, fresh prompts; compute-bound): TFLOP/s against scaled_dot_product_attention
(causal) on the same data.

Writes bench/results/kernels-<device>.json. Needs an NVIDIA GPU; not part of the test suite.

    python bench/kernels.py
    python bench/kernels.py --batch 32 --context 8192 --dtype float16
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
DECODE_TARGET_FRACTION_OF_COPY = 0.70

DEVICE = "cuda"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark the Triton paged-attention kernels (decode and prefill) against a "
                    "device-to-device copy and PyTorch SDPA measured in the same run. Needs CUDA.")
    parser.add_argument("--batch", type=int, default=64, help="decode: sequences (default 64)")
    parser.add_argument("--context", type=int, default=4096,
                        help="decode: context tokens per sequence (default 4096)")
    parser.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (default 16)")
    parser.add_argument("--prefill-seqs", type=int, default=8, help="prefill: sequences (default 8)")
    parser.add_argument("--prefill-len", type=int, default=2048,
                        help="prefill: tokens per sequence (default 2048)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--copy-mib", type=int, default=1024,
                        help="size of the buffer for the copy baseline in MiB (default 1024)")
    parser.add_argument("--rep-ms", type=int, default=200, help="timed milliseconds per figure")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON path (default bench/results/kernels-<device>.json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/kernels.py needs an NVIDIA GPU with CUDA, and torch sees none "
              "(torch.cuda.is_available() is False). Nothing was measured.", file=sys.stderr)
        return 2
    if args.heads % args.kv_heads:
        print(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}",
              file=sys.stderr)
        return 2

    sys.path.insert(0, str(REPO_ROOT))
    import triton

    from workers.engine.attention import triton_kernels

    torch.manual_seed(0)
    device = torch.device(DEVICE)
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device)
    print(f"device: {name}; torch {torch.__version__}; triton {triton.__version__}")

    copy = bench_copy(torch, triton, args.copy_mib, args.rep_ms)
    print(f"device-to-device copy: {copy['bytes_per_s'] / 1e9:.0f} GB/s "
          f"({args.copy_mib} MiB read + written)")
    decode = bench_decode(torch, triton, triton_kernels, args, dtype, copy["bytes_per_s"])
    prefill = bench_prefill(torch, triton, triton_kernels, args, dtype)

    result = {
        "device": name,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
        "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "dtype": args.dtype,
        "copy": copy,
        "decode": decode,
        "prefill": prefill,
    }
    output = args.output or RESULTS_DIR / f"kernels-{slug(name)}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


def slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def timed_ms(triton, fn, rep_ms: int) -> float:
    """Median milliseconds per call, with warmup, the L2 cache flushed before every call."""
    return triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms,
                                   return_mode="median")


def bench_copy(torch, triton, mib: int, rep_ms: int) -> dict:
    src = torch.empty(mib << 20, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    ms = timed_ms(triton, lambda: dst.copy_(src), rep_ms)
    moved = 2 * src.numel()  # every byte read once and written once
    return {"bytes": moved, "ms": ms, "bytes_per_s": moved / (ms * 1e-3)}


def paged_cache(torch, num_seqs, context, kv_heads, head_dim, block_size, dtype):
    """K/V for ``num_seqs`` sequences of ``context`` tokens, in shuffled cache blocks."""
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    # A long-running server's free list hands out blocks in no particular order.
    block_tables = torch.randperm(num_blocks, device=DEVICE).to(torch.int32).view(
        num_seqs, blocks_per_seq)
    return k_cache, v_cache, block_tables


def contiguous_kv(torch, cache, block_tables, context):
    """[num_seqs, kv_heads, context, head_dim]: the same K or V laid out densely, for SDPA."""
    num_seqs = block_tables.shape[0]
    blocks = cache[block_tables.long()]  # [S, blocks, block_size, KV, D]
    dense = blocks.reshape(num_seqs, -1, *cache.shape[2:])[:, :context]
    return dense.transpose(1, 2).contiguous()


def sdpa_gqa(torch, q, k, v, *, causal: bool, scale: float):
    """SDPA with grouped K/V; repeats the K/V heads if this PyTorch refuses enable_gqa here."""
    import torch.nn.functional as F

    try:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                             enable_gqa=True)
        return out, "enable_gqa"
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        return out, "repeated kv heads"


def bench_decode(torch, triton, kernels, args, dtype, copy_bytes_per_s: float) -> dict:
    import torch.nn.functional as F

    batch, context, heads, kv_heads, dim = (args.batch, args.context, args.heads, args.kv_heads,
                                            args.head_dim)
    k_cache, v_cache, block_tables = paged_cache(torch, batch, context, kv_heads, dim,
                                                 args.block_size, dtype)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, heads, dim, dtype=dtype, device=DEVICE)
    out = torch.empty_like(query)
    scale = dim ** -0.5
    config = kernels.default_decode_config(dim, dtype, query.device)
    splits = kernels.default_num_splits(batch, kv_heads, context, config.block_n, query.device)

    def triton_decode(num_splits=None):
        kernels.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                                       max_context_len=context, num_splits=num_splits, out=out)

    # SDPA on the same K/V, laid out densely: [S, KV, L, D] and one query row per sequence.
    k_dense = contiguous_kv(torch, k_cache, block_tables, context)
    v_dense = contiguous_kv(torch, v_cache, block_tables, context)
    q_dense = query.unsqueeze(2)  # [S, H, 1, D]
    reference, sdpa_variant = sdpa_gqa(torch, q_dense, k_dense, v_dense, causal=False, scale=scale)
    triton_decode()
    max_error = (out.float() - reference.squeeze(2).float()).abs().max().item()
    if not max_error < 5e-2:
        raise SystemExit(f"decode: Triton and SDPA disagree (max abs difference {max_error:.3g})")

    triton_ms = timed_ms(triton, triton_decode, args.rep_ms)
    # The split count is a heuristic; timing a few alternatives shows how far it is from the best.
    sweep = {}
    for num_splits in sorted({1, 2, 4, 8, 16, splits}):
        used, _ = kernels.plan_decode_splits(context, num_splits, config.block_n)
        if used == num_splits:
            sweep[num_splits] = timed_ms(triton, lambda n=num_splits: triton_decode(n), args.rep_ms)
    best_splits = min(sweep, key=sweep.get)
    if sdpa_variant == "enable_gqa":
        sdpa_fn = lambda: F.scaled_dot_product_attention(q_dense, k_dense, v_dense,  # noqa: E731
                                                         scale=scale, enable_gqa=True)
    else:
        group = heads // kv_heads
        k_rep, v_rep = k_dense.repeat_interleave(group, 1), v_dense.repeat_interleave(group, 1)
        sdpa_fn = lambda: F.scaled_dot_product_attention(q_dense, k_rep, v_rep,  # noqa: E731
                                                         scale=scale)
    sdpa_ms = timed_ms(triton, sdpa_fn, args.rep_ms)

    kv_bytes = 2 * batch * context * kv_heads * dim * dtype.itemsize
    moved = kv_bytes + 2 * query.numel() * dtype.itemsize + block_tables.numel() * 4
    achieved = moved / (triton_ms * 1e-3)
    fraction = achieved / copy_bytes_per_s
    print(f"decode  batch {batch} x context {context}, {heads}/{kv_heads} heads, dim {dim}: "
          f"Triton {triton_ms * 1e3:.0f} us = {achieved / 1e9:.0f} GB/s = {fraction:.0%} of copy "
          f"(target {DECODE_TARGET_FRACTION_OF_COPY:.0%}); SDPA ({sdpa_variant}, contiguous) "
          f"{sdpa_ms * 1e3:.0f} us; Triton / SDPA speed {sdpa_ms / triton_ms:.2f}x")
    print("        splits: " + ", ".join(f"{n}: {ms * 1e3:.0f} us" for n, ms in sweep.items())
          + f" (heuristic chose {splits}, fastest {best_splits})")
    return {
        "batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads,
        "head_dim": dim, "block_size": args.block_size,
        "config": {"block_n": config.block_n, "num_warps": config.num_warps,
                   "num_stages": config.num_stages, "num_splits": splits},
        "bytes": moved,
        "triton_ms": triton_ms,
        "triton_bytes_per_s": achieved,
        "fraction_of_copy": fraction,
        "target_fraction_of_copy": DECODE_TARGET_FRACTION_OF_COPY,
        "meets_target": fraction >= DECODE_TARGET_FRACTION_OF_COPY,
        "sdpa_variant": sdpa_variant,
        "sdpa_ms": sdpa_ms,
        "sdpa_bytes_per_s": moved / (sdpa_ms * 1e-3),
        "speedup_vs_sdpa": sdpa_ms / triton_ms,
        "max_abs_difference_vs_sdpa": max_error,
        "splits_sweep_ms": {str(n): ms for n, ms in sweep.items()},
        "fastest_splits": best_splits,
        "fastest_fraction_of_copy": moved / (sweep[best_splits] * 1e-3) / copy_bytes_per_s,
    }


def bench_prefill(torch, triton, kernels, args, dtype) -> dict:
    import torch.nn.functional as F

    seqs, length, heads, kv_heads, dim = (args.prefill_seqs, args.prefill_len, args.heads,
                                          args.kv_heads, args.head_dim)
    k_cache, v_cache, block_tables = paged_cache(torch, seqs, length, kv_heads, dim,
                                                 args.block_size, dtype)
    context_lens = torch.full((seqs,), length, dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.arange(0, (seqs + 1) * length, length, dtype=torch.int32,
                                   device=DEVICE)
    query = torch.randn(seqs * length, heads, dim, dtype=dtype, device=DEVICE)
    out = torch.empty_like(query)
    scale = dim ** -0.5
    config = kernels.default_prefill_config(dim, dtype, query.device)

    def triton_prefill():
        kernels.paged_prefill_attention(query, k_cache, v_cache, block_tables, context_lens,
                                        query_start_loc, scale, max_query_len=length, out=out)

    k_dense = contiguous_kv(torch, k_cache, block_tables, length)
    v_dense = contiguous_kv(torch, v_cache, block_tables, length)
    q_dense = query.view(seqs, length, heads, dim).transpose(1, 2).contiguous()  # [S, H, L, D]
    reference, sdpa_variant = sdpa_gqa(torch, q_dense, k_dense, v_dense, causal=True, scale=scale)
    triton_prefill()
    max_error = (out.view(seqs, length, heads, dim).transpose(1, 2).float()
                 - reference.float()).abs().max().item()
    if not max_error < 5e-2:
        raise SystemExit(f"prefill: Triton and SDPA disagree (max abs difference {max_error:.3g})")

    triton_ms = timed_ms(triton, triton_prefill, args.rep_ms)
    if sdpa_variant == "enable_gqa":
        sdpa_fn = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q_dense, k_dense, v_dense, is_causal=True, scale=scale, enable_gqa=True)
    else:
        group = heads // kv_heads
        k_rep, v_rep = k_dense.repeat_interleave(group, 1), v_dense.repeat_interleave(group, 1)
        sdpa_fn = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q_dense, k_rep, v_rep, is_causal=True, scale=scale)
    sdpa_ms = timed_ms(triton, sdpa_fn, args.rep_ms)

    # Two matmuls (QK^T and PV) of 2*L*L*D flops per head and sequence; causal keeps half.
    flops = seqs * heads * 2 * (2 * length * length * dim) / 2
    tflops = flops / (triton_ms * 1e-3) / 1e12
    sdpa_tflops = flops / (sdpa_ms * 1e-3) / 1e12
    print(f"prefill {seqs} x {length} tokens causal, {heads}/{kv_heads} heads, dim {dim}: "
          f"Triton {triton_ms:.2f} ms = {tflops:.0f} TFLOP/s; SDPA ({sdpa_variant}, contiguous) "
          f"{sdpa_ms:.2f} ms = {sdpa_tflops:.0f} TFLOP/s; Triton / SDPA {tflops / sdpa_tflops:.2f}x")
    return {
        "seqs": seqs, "tokens_per_seq": length, "heads": heads, "kv_heads": kv_heads,
        "head_dim": dim, "block_size": args.block_size,
        "config": {"block_m": config.block_m, "block_n": config.block_n,
                   "num_warps": config.num_warps, "num_stages": config.num_stages},
        "flops": flops,
        "triton_ms": triton_ms,
        "triton_tflops": tflops,
        "sdpa_variant": sdpa_variant,
        "sdpa_ms": sdpa_ms,
        "sdpa_tflops": sdpa_tflops,
        "ratio_vs_sdpa": tflops / sdpa_tflops,
        "max_abs_difference_vs_sdpa": max_error,
    }


if __name__ == "__main__":
    sys.exit(main())
