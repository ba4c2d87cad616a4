"""Benchmark the engine's serving throughput against Hugging Face transformers, in the same run.

The workload: ``--requests`` (64) prompts of 128–512 tokens, each generating exactly
``--output-tokens`` (128) tokens, all submitted at once. Measured on the same token ids:

- our engine, all requests at once: output tokens/s, TTFT and TPOT p50/p99;
- our engine, one request at a time (single stream): decode tokens/s;
- transformers ``generate``, all requests in one left-padded batch, in float32 and bfloat16;
- transformers ``generate``, one request at a time, in float32 and bfloat16.

The headline figure is ``ratio_vs_transformers_batched``: the engine's output tokens/s (the mean
of a run before and a run after the transformers batched run, to bracket changes in how busy a
shared machine is) divided by the faster of the transformers batched runs. On CPUs without
native bfloat16 matmuls (no AMX or AVX512-BF16) bfloat16 is emulated and far slower; the CPU
flags and a quick matmul probe detect that, and the bfloat16 transformers runs then shrink to a
reduced workload that is reported but cannot be the faster baseline (``--full-bf16`` runs them in
full anyway). Single-stream figures alternate engine and transformers request by request, and
transformers runs both on every thread and on one; its best is the baseline.

Writes bench/results/engine-cpu.json. Not part of the test suite; it takes minutes.

With ``--device cuda`` (the default where a GPU is present) it measures instead, on the GPU:

- single-stream decode tokens/s of the bundled model (CUDA graphs on, and off for reference);
- the decode step time at batch 1 of a Llama-3-8B-shaped model with random bfloat16 weights,
  against the floor of weight bytes read per step / device-to-device copy bandwidth measured in
  the same run (target <= 1.25x), and the same with FP8 weights (per channel and per tensor);
- output tokens/s at 256 concurrent requests (prompts 128-1024 tokens, 256 out) against
  transformers ``generate`` on the same GPU and prompts (target >= 10x).

To show where time goes it also records the profiler's kernels of each timed step (GPU busy time
against the step's wall time), the 8B matmul shapes in both weight layouts, the engine loop's
milliseconds per step (schedule / execute / postprocess) in the batched run, and a decode step of
the bundled model at the batched run's width. It writes bench/results/engine-<gpu name>.json
(``--llama8b-only``: the copy and 8B figures alone, engine-<gpu name>-step.json, no bundled
model needed).

    python bench/engine.py
    python bench/engine.py --requests 16 --output-tokens 32 --skip-transformers-single
    python bench/engine.py --device cuda
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
TARGET_RATIO_BATCHED = 3.0
TARGET_RATIO_BATCHED_CUDA = 10.0
TARGET_RATIO_FLOOR = 1.25
# The workload per device: (requests, shortest prompt, longest prompt, output tokens, tokens a
# step may batch).
WORKLOADS = {"cpu": (64, 128, 512, 128, 2048), "cuda": (256, 128, 1024, 256, 8192)}
# Llama-3-8B's shape (random weights: only the step time is measured).
LLAMA3_8B = dict(architecture="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                 head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                 max_position_embeddings=8192, tie_word_embeddings=False,
                 attention_bias=False, bos_token_id=128000, eos_token_ids=(128001,))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Engine throughput vs transformers generate on the bundled model.")
    parser.add_argument("--requests", type=int, default=None,
                        help="concurrent requests (64 on CPU, 256 on CUDA)")
    parser.add_argument("--min-prompt", type=int, default=None, help="shortest prompt (128)")
    parser.add_argument("--max-prompt", type=int, default=None,
                        help="longest prompt (512 on CPU, 1024 on CUDA)")
    parser.add_argument("--output-tokens", type=int, default=None,
                        help="tokens per request (128 on CPU, 256 on CUDA)")
    parser.add_argument("--single-requests", type=int, default=4,
                        help="requests run one at a time for the single-stream figures (4)")
    parser.add_argument("--engine-dtype", default="auto",
                        help="auto (measured), float32 or bfloat16")
    parser.add_argument("--max-batched-tokens", type=int, default=None,
                        help="tokens one step may batch (2048 on CPU, 8192 on CUDA)")
    parser.add_argument("--batch-window-ms", type=float, default=0.0)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--transformers-dtypes", default=None,
                        help="float32,bfloat16 on CPU; bfloat16 on CUDA")
    parser.add_argument("--full-bf16", action="store_true",
                        help="run transformers in bfloat16 in full even where it is emulated")
    parser.add_argument("--reduced-requests", type=int, default=4,
                        help="requests in a reduced (emulated-bfloat16) transformers run")
    parser.add_argument("--reduced-output-tokens", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-transformers-batched", action="store_true")
    parser.add_argument("--skip-transformers-single", action="store_true")
    parser.add_argument("--skip-engine-single", action="store_true")
    parser.add_argument("--no-repeat", action="store_true",
                        help="run the engine's batched phase once, not before and after "
                             "transformers (the ratio then uses the one run)")
    parser.add_argument("--seed", type=int, default=0)
    gpu = parser.add_argument_group("CUDA only")
    gpu.add_argument("--skip-llama8b", action="store_true",
                     help="skip the Llama-3-8B-shaped step time (bf16 and FP8)")
    gpu.add_argument("--skip-fp8", action="store_true", help="skip the FP8 step times")
    gpu.add_argument("--llama8b-only", action="store_true",
                     help="only the copy bandwidth and the Llama-3-8B-shaped step times (no "
                          "bundled model needed); writes engine-<gpu>-step.json")
    gpu.add_argument("--skip-eager-reference", action="store_true",
                     help="skip the runs with CUDA graphs off")
    gpu.add_argument("--step-context", type=int, default=512,
                     help="context length at which the 8B decode step is timed (512)")
    gpu.add_argument("--timed-steps", type=int, default=200,
                     help="decode steps timed for the 8B step time (200)")
    gpu.add_argument("--copy-bytes", type=int, default=1 << 30,
                     help="buffer size for the copy-bandwidth measurement (1 GiB)")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON path (default bench/results/engine-<device>.json)")
    args = parser.parse_args(argv)
    return args


def apply_workload_defaults(args: argparse.Namespace, kind: str) -> None:
    """Fill the workload options left unset with the defaults for ``kind`` (cpu or cuda)."""
    requests, lo, hi, out, batched = WORKLOADS[kind]
    for name, value in (("requests", requests), ("min_prompt", lo), ("max_prompt", hi),
                        ("output_tokens", out), ("max_batched_tokens", batched)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.transformers_dtypes is None:
        args.transformers_dtypes = "float32,bfloat16" if kind == "cpu" else "bfloat16"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    index = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[index]


def machine_info(torch) -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "native_bf16": bool(flags & {"amx_bf16", "avx512_bf16"}),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def make_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n prompts of token ids, lengths uniform in [lo, hi], from varied (nonsense) English."""
    rng = random.Random(seed)
    words = ("time person year way day thing man world life hand part child eye woman place "
             "work week case point government company number group problem fact river stone "
             "garden little north window bright copper silent morning engine paper orange "
             "valley winter whisper market candle forest silver thunder harbor question answer "
             "because although however during without under between always never often "
             "quickly slowly carefully build write read think grow open close follow").split()
    prompts = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        ids: list[int] = []
        while len(ids) < length:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 18)))
            ids += tokenizer.encode(sentence.capitalize() + ". ")
        prompts.append(ids[:length])
    return prompts


class Progress:
    """Prints a progress line every few seconds from a background thread."""

    def __init__(self, describe, every: float = 5.0):
        self.describe, self.every = describe, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.every):
            log("  " + self.describe())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# ----------------------------------------------------------------------------- our engine


def run_engine_batched(engine, prompts, output_tokens) -> dict:
    from workers.engine import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts[0][:16], SamplingParams(max_tokens=2, temperature=0))  # warm up
    before = engine.stats()
    start = time.perf_counter()
    handles = [engine.submit(p, params) for p in prompts]

    def describe():
        s = engine.stats()
        return (f"engine: running {s['running']}, waiting {s['waiting']}, "
                f"{s['generated_tokens']} tokens generated, step {s['steps']}")

    with Progress(describe):
        results = [h.result() for h in handles]
    wall = time.perf_counter() - start
    tokens = sum(r.completion_tokens for r in results)
    ttft = [r.timings.time_to_first_token for r in results]
    tpot = [r.timings.time_per_output_token for r in results if r.timings.time_per_output_token]
    stats = engine.stats()
    return {
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "steps": stats["steps"] - before["steps"], "batch_size_max": stats["batch_size_max"],
        "preemptions": stats["preemptions"] - before["preemptions"],
        "loop_ms_per_step": loop_breakdown(before, stats),
    }


def loop_breakdown(before: dict, after: dict) -> dict | None:
    """The engine loop's milliseconds per step between two ``stats()``: choosing the batch, the
    model step (the wait for the device included), and handing out the new tokens."""
    steps = after["steps"] - before["steps"]
    keys = ("schedule_seconds", "execute_seconds", "postprocess_seconds")
    if steps <= 0 or any(k not in after for k in keys):
        return None
    return {k.removesuffix("_seconds"): (after[k] - before[k]) / steps * 1e3 for k in keys}


def run_engine_single(engine, prompts, output_tokens) -> dict:
    from workers.engine import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    walls, tokens, tpots = [], 0, []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        result = engine.generate(prompt, params)
        walls.append(time.perf_counter() - start)
        tokens += result.completion_tokens
        tpots.append(result.timings.time_per_output_token)
        log(f"  engine single {i + 1}/{len(prompts)}: {result.completion_tokens / walls[-1]:.1f} "
            f"tok/s end to end, decode {1 / tpots[-1]:.1f} tok/s")
    return {
        "requests": len(prompts),
        "output_tokens": tokens,
        "wall_s": sum(walls),
        "output_tokens_per_s": tokens / sum(walls),
        "decode_tokens_per_s": 1 / statistics.median(tpots),
    }


# --------------------------------------------------------------------------- transformers


def load_transformers(path: Path, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=dtype)
    return model.eval()


def run_transformers_batched(model, prompts, output_tokens, pad_id: int, torch,
                             device: str = "cpu") -> dict:
    from transformers import StoppingCriteria, StoppingCriteriaList

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    steps = {"n": 0, "first": None}
    start = time.perf_counter()

    class Count(StoppingCriteria):
        def __call__(self, ids, scores, **kw):
            steps["n"] += 1
            if steps["first"] is None:
                steps["first"] = time.perf_counter() - start
            return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)

    with Progress(lambda: f"transformers batched: {steps['n']}/{output_tokens} steps"), \
            torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=output_tokens, min_new_tokens=output_tokens,
                             pad_token_id=pad_id, stopping_criteria=StoppingCriteriaList([Count()]))
    wall = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(prompts)
    return {"requests": len(prompts), "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall, "time_to_first_token_s": steps["first"]}


def run_transformers_single(model, prompts, output_tokens, torch, threads=None,
                            device: str = "cpu") -> dict:
    """One request at a time; ``threads`` runs it on that many CPU threads (then restores)."""
    if threads is not None:
        default = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            result = run_transformers_single(model, prompts, output_tokens, torch, device=device)
        finally:
            torch.set_num_threads(default)
        result["threads"] = threads
        return result
    from transformers import StoppingCriteria, StoppingCriteriaList

    walls, tokens, decode_rates = [], 0, []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device=device)
        first: list[float] = []

        class FirstToken(StoppingCriteria):  # called once per generated token
            def __call__(self, input_ids, scores, **kw):
                if not first:
                    first.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool,
                                   device=input_ids.device)

        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=output_tokens,
                                 min_new_tokens=output_tokens, pad_token_id=0,
                                 stopping_criteria=StoppingCriteriaList([FirstToken()]))
            end = time.perf_counter()
        n = out.shape[1] - ids.shape[1]
        walls.append(end - start)
        tokens += n
        if n > 1:
            decode_rates.append((n - 1) / (end - first[0]))
        log(f"  transformers single {i + 1}/{len(prompts)}: {n / walls[-1]:.1f} tok/s end to "
            f"end" + (f", decode {decode_rates[-1]:.1f} tok/s" if n > 1 else ""))
    return {"requests": len(prompts), "output_tokens": tokens, "wall_s": sum(walls),
            "output_tokens_per_s": tokens / sum(walls),
            "decode_tokens_per_s": statistics.median(decode_rates) if decode_rates else None}


def bf16_is_emulated(torch) -> tuple[bool, dict]:
    """Whether bfloat16 matmuls are emulated here: no AMX / AVX512-BF16 in the CPU flags, or a
    probe matmul clearly slower than in float32. Returns the probe's best times too."""
    from workers.engine.model_runner import cpu_has_native_bf16

    timings = {}
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        a, b = torch.randn(64, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
        torch.nn.functional.linear(a, b)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            torch.nn.functional.linear(a, b)
            best = min(best, time.perf_counter() - start)
        timings[name] = best
    emulated = not cpu_has_native_bf16() or timings["bfloat16"] > 2 * timings["float32"]
    return emulated, timings


# ----------------------------------------------------------------------------------- main


def contention() -> dict:
    """How busy the machine is right now (other work on the same cores skews every figure)."""
    out: dict = {"load_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    try:  # Linux pressure stall information: % of time some task waited for a CPU
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0].split()
        out.update({k: float(v) for k, v in (f.split("=") for f in some[1:3])})
    except (OSError, IndexError, ValueError):
        pass
    return out


def phase(run):
    """Run one measurement, recording how contended the machine was around it."""
    before = contention()
    result = run()
    result["contention"] = {"before": before, "after": contention()}
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    from workers.engine import Engine
    from workers.engine.engine import on_a_passing_thread
    from workers.engine.loader import bundled_model_path

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    apply_workload_defaults(args, "cuda" if device.startswith("cuda") else "cpu")
    if not (0 < args.min_prompt <= args.max_prompt):
        print("need 0 < --min-prompt <= --max-prompt", file=sys.stderr)
        return 2
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device is available", file=sys.stderr)
            return 2
        return main_cuda(args, device)
    path = bundled_model_path()
    report: dict = {"benchmark": "engine", "model": path.name, "machine": machine_info(torch),
                    "note": "Measured on a shared machine: other work on the same cores during "
                            "the run slows every figure (each phase records the load and CPU "
                            "pressure around it); single-stream runs alternate engine and "
                            "transformers request by request so both see the same conditions.",
                    "workload": {"requests": args.requests, "prompt_tokens": [args.min_prompt,
                                                                              args.max_prompt],
                                 "output_tokens": args.output_tokens, "greedy": True,
                                 "single_stream_requests": args.single_requests}}
    log(f"machine: {report['machine']['cpu']}, {report['machine']['logical_cpus']} CPUs, "
        f"torch {torch.__version__}, device {device}")

    log("loading the engine")
    engine_dtype = None if args.engine_dtype == "auto" else getattr(torch, args.engine_dtype)
    max_len = args.max_prompt + args.output_tokens
    blocks = args.requests * -(-max_len // 16) + 16

    def make_engine(model):
        return Engine(model, dtype=engine_dtype, device=device, max_batch_size=args.requests,
                      max_batched_tokens=args.max_batched_tokens, num_kv_blocks=blocks,
                      batch_window_ms=args.batch_window_ms).start()

    engine = make_engine(path)
    prompts = make_prompts(engine.tokenizer, args.requests, args.min_prompt, args.max_prompt,
                           args.seed)
    # Other prompts than the batch's, so that the prefix cache does not flatter the engine.
    singles = make_prompts(engine.tokenizer, args.single_requests, args.min_prompt,
                           args.max_prompt, args.seed + 1)
    report["engine_config"] = {"dtype": str(engine.dtype).removeprefix("torch."),
                               "device": device, "max_batch_size": args.requests,
                               "max_batched_tokens": args.max_batched_tokens,
                               "num_kv_blocks": blocks, "block_size": 16,
                               "prefix_caching": True}
    log(f"engine ({report['engine_config']['dtype']}): {args.requests} requests at once")
    report["engine_batched"] = phase(lambda: run_engine_batched(
        engine, prompts, args.output_tokens))
    log(f"  → {report['engine_batched']['output_tokens_per_s']:.1f} output tok/s")

    report["transformers"] = {}
    dtypes = [] if args.skip_transformers else \
        [d.strip() for d in args.transformers_dtypes.split(",") if d.strip()]
    # Whatever runs PyTorch operators here does so on a passing thread, and no engine runs
    # while transformers does: each thread that calls them keeps an OpenMP pool, and with more
    # pooled threads than cores OpenMP sleeps between operators, which would slow whichever side
    # ran second (see Engine.__init__). Alternating single streams share the machine evenly.
    loaded = engine.loaded
    engine.stop()
    emulated, probe = on_a_passing_thread(bf16_is_emulated, torch) \
        if device == "cpu" and dtypes else (False, {})
    if probe:
        report["bf16_probe_s"] = probe
    for name in dtypes:
        reduced = name == "bfloat16" and emulated and not args.full_bf16
        log(f"loading transformers ({name})")
        model = on_a_passing_thread(load_transformers, path, getattr(torch, name)).to(device)
        runs: dict = {}
        if reduced:
            runs["reduced"] = (
                f"bfloat16 matmuls are emulated on this CPU (no AMX / AVX512-BF16; probe "
                f"{probe['bfloat16'] * 1e3:.1f} ms vs {probe['float32'] * 1e3:.1f} ms for "
                f"float32), so this run uses {args.reduced_requests} requests x "
                f"{args.reduced_output_tokens} tokens and is not a candidate for the faster "
                f"baseline")
        batch_prompts = prompts[:args.reduced_requests] if reduced else prompts
        out_tokens = args.reduced_output_tokens if reduced else args.output_tokens
        if not args.skip_transformers_batched:
            log(f"transformers {name}: {len(batch_prompts)} requests in one padded batch")
            runs["batched"] = phase(lambda: on_a_passing_thread(
                run_transformers_batched, model, batch_prompts, out_tokens, 0, torch))
            log(f"  → {runs['batched']['output_tokens_per_s']:.1f} output tok/s")
            if not reduced and not args.no_repeat and "engine_batched_repeat" not in report:
                # Again after transformers, on a fresh engine (cold prefix cache), so that a
                # change in how busy the machine is shows up instead of skewing the ratio.
                engine = make_engine(loaded)
                log(f"engine again: {args.requests} requests at once")
                report["engine_batched_repeat"] = phase(
                    lambda eng=engine: run_engine_batched(eng, prompts, args.output_tokens))
                engine.stop()
                log(f"  → {report['engine_batched_repeat']['output_tokens_per_s']:.1f} "
                    f"output tok/s")
        if not args.skip_transformers_single and singles:
            single_prompts = singles[:1] if reduced else singles
            interleave = "engine_single" not in report and not reduced \
                and not args.skip_engine_single
            log(f"transformers {name}: {len(single_prompts)} requests one at a time"
                + (", alternating with the engine" if interleave else ""))
            # transformers on every thread and on one: its best single stream is the baseline
            # (the engine picks its own thread count for one-token steps by measurement).
            one_thread = device == "cpu" and torch.get_num_threads() > 1
            hf_parts, hf_one_parts, engine_parts = [], [], []
            engine = make_engine(loaded) if interleave else None
            for prompt in single_prompts:
                if engine is not None:
                    engine_parts.append(run_engine_single(engine, [prompt], out_tokens))
                hf_parts.append(on_a_passing_thread(run_transformers_single, model, [prompt],
                                                    out_tokens, torch))
                if one_thread:
                    hf_one_parts.append(on_a_passing_thread(
                        run_transformers_single, model, [prompt], out_tokens, torch, threads=1))
            runs["single"] = merge_single(hf_parts)
            log(f"  → {runs['single']['decode_tokens_per_s'] or 0:.1f} decode tok/s")
            if hf_one_parts:
                runs["single_one_thread"] = merge_single(hf_one_parts)
                log(f"  → {runs['single_one_thread']['decode_tokens_per_s'] or 0:.1f} decode "
                    f"tok/s on one thread")
            if engine is not None:
                report["engine_single"] = finish_single(merge_single(engine_parts), engine)
                log(f"  → engine {report['engine_single']['decode_tokens_per_s']:.1f} "
                    f"decode tok/s")
        report["transformers"][name] = runs
        del model
    if "engine_single" not in report and not args.skip_engine_single and singles:
        log(f"engine: {len(singles)} requests one at a time")
        engine = make_engine(loaded)
        report["engine_single"] = finish_single(
            phase(lambda: run_engine_single(engine, singles, args.output_tokens)), engine)

    # Ratios against the faster full-size transformers runs.
    full = {k: v for k, v in report["transformers"].items() if "reduced" not in v}
    batched = [v["batched"]["output_tokens_per_s"] for v in full.values() if "batched" in v]
    if batched:
        report["transformers_batched_best_tokens_per_s"] = max(batched)
        engine_runs = [report[k]["output_tokens_per_s"]
                       for k in ("engine_batched", "engine_batched_repeat") if k in report]
        report["engine_batched_mean_tokens_per_s"] = statistics.mean(engine_runs)
        report["ratio_vs_transformers_batched"] = (
            report["engine_batched_mean_tokens_per_s"] / max(batched))
        report["target_ratio_vs_transformers_batched"] = TARGET_RATIO_BATCHED
    single = [v[k]["decode_tokens_per_s"] for v in full.values()
              for k in ("single", "single_one_thread")
              if v.get(k, {}).get("decode_tokens_per_s")]
    if single and "engine_single" in report:
        report["transformers_single_best_decode_tokens_per_s"] = max(single)
        report["ratio_single_stream_decode"] = (
            report["engine_single"]["decode_tokens_per_s"] / max(single))
    report["machine"]["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") \
        else None

    kind = "cuda" if device.startswith("cuda") else "cpu"
    output = args.output or RESULTS_DIR / f"engine-{kind}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {output.relative_to(REPO_ROOT) if output.is_relative_to(REPO_ROOT) else output}")
    for key in ("ratio_vs_transformers_batched", "ratio_single_stream_decode"):
        if key in report:
            log(f"{key}: {report[key]:.2f}")
    return 0


# ------------------------------------------------------------------------------------ CUDA


def device_slug(name: str) -> str:
    """A file-name-safe device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"


def write_result(report: dict, *, prefix: str, device: str, out: str | None = None) -> Path:
    """A benchmark's JSON, at ``out`` or bench/results/<prefix>-<device>.json."""
    path = Path(out) if out else RESULTS_DIR / f"{prefix}-{device_slug(device)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def free_cuda(torch) -> None:
    gc.collect()
    torch.cuda.empty_cache()


def copy_bandwidth(torch, nbytes: int, repeats: int = 20) -> dict:
    """Device-to-device copy bandwidth: bytes read plus bytes written per second, the traffic a
    memory-bound kernel sees. A buffer far larger than the L2 cache keeps it honest."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):  # best of three timed batches
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / repeats)
    del src, dst
    free_cuda(torch)
    return {"buffer_bytes": nbytes, "copy_s": best, "bytes_per_s": 2 * nbytes / best,
            "counted": "bytes read + bytes written per second"}


def random_model(torch, config, dtype, device: str):
    """A CausalLM of ``config``'s shape built on ``device`` with random weights (std 0.02,
    norms 1), as the engine's loader would build it there."""
    from workers.engine import model as model_module
    from workers.engine.attention import get_backend

    kwargs = {}
    if hasattr(model_module, "ops_for"):  # the fused kernels on CUDA, where the engine has them
        kwargs["ops"] = model_module.ops_for(device)
    with torch.device(device):
        model = model_module.CausalLM(config, backend=get_backend(device), dtype=dtype, **kwargs)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    return model.eval()


def decode_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter and buffer except the embedding
    table (one row of it is read) and the RoPE tables (one row each); a tied LM head counts."""
    seen, total = set(), 0
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    tied = model.config.tie_word_embeddings
    for name, tensor in tensors:
        if name in ("rope_cos", "rope_sin") or (name == "embed" and not tied):
            continue
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def time_decode_steps(torch, model, *, context: int, steps: int, cuda_graphs: bool,
                      batch: int = 1) -> dict:
    """Decode steps of ``batch`` sequences of ``model`` at a context of about ``context`` tokens
    each, through the engine's runner (input prep, forward, sampling, the result's transfer).
    Also the graph replay alone, timed on the GPU, when graphs are on."""
    from workers.engine.model_runner import ModelRunner
    from workers.engine.sequence import SamplingParams, Sequence

    block_size, warmup, profiled = 16, 10, min(steps, 20)
    total = context + warmup + steps + profiled + 1
    blocks = -(-total // block_size)
    dtype = next(model.parameters()).dtype
    runner = ModelRunner(model, num_blocks=blocks * batch, block_size=block_size, device="cuda",
                         dtype=dtype, max_batch_size=batch, max_model_len=total,
                         cuda_graphs=cuda_graphs)
    rng = random.Random(0)
    seqs = []
    for i in range(batch):
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(context)]
        seq = Sequence(f"bench-{i}", prompt, SamplingParams(temperature=0, ignore_eos=True),
                       max_tokens=total - context, arrival_time=0.0)
        seq.block_table = list(range(i * blocks, (i + 1) * blocks))
        seqs.append(seq)

    def step(num_new: int) -> None:
        result = runner.execute(seqs, [num_new] * batch)
        for seq, token in zip(seqs, result.token_ids):
            seq.num_computed_tokens += num_new
            seq.token_ids.append(token)

    step(context)  # prefill
    for _ in range(warmup):
        step(1)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step(1)  # each ends by reading the sampled token back: the steps do not overlap
    step_s = (time.perf_counter() - started) / steps
    out = {"batch": batch, "context_tokens": context, "steps": steps, "step_s": step_s,
           "cuda_graphs": runner.decode_graphs is not None,
           "profile": profile_steps(torch, step, steps=profiled)}
    if runner.decode_graphs is not None:
        graphs = runner.decode_graphs
        graph = graphs.graphs[graphs.sizes[-1]]  # the runner's largest batch is ``batch``
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()  # rewrites the last step's K/V slot with the same values
        end.record()
        end.synchronize()
        out["graph_replay_s"] = start.elapsed_time(end) / 1000 / steps
        out["graph_capture_s"] = graphs.capture_seconds
    del runner
    free_cuda(torch)
    return out


def profile_steps(torch, step, *, steps: int) -> dict:
    """Where a step's time goes: the GPU kernels it runs (from the profiler; graph replays show
    their kernels one by one), per step and by name. The step's unprofiled wall time less
    ``gpu_busy_s`` is host work and launch gaps."""
    torch.cuda.synchronize()
    try:
        return _profile_steps(torch, step, steps=steps)
    except Exception as exc:  # the profiler is a diagnosis: never lose the run's figures to it
        log(f"    (profiler failed: {exc!r})")
        return {"failed": f"{type(exc).__name__}: {exc}", "gpu_busy_s": float("nan"),
                "launches_per_step": float("nan"), "kernels": []}


def _profile_steps(torch, step, *, steps: int) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(1)
        torch.cuda.synchronize()
    kernels = []
    for avg in prof.key_averages():
        if avg.device_type != DeviceType.CUDA:
            continue
        us = getattr(avg, "self_device_time_total", None)
        if us is None:
            us = getattr(avg, "self_cuda_time_total", 0.0)
        kernels.append({"name": avg.key[:120], "per_step": avg.count / steps,
                        "s_per_step": us / 1e6 / steps})
    kernels.sort(key=lambda k: -k["s_per_step"])
    return {"steps": steps, "gpu_busy_s": sum(k["s_per_step"] for k in kernels),
            "launches_per_step": sum(k["per_step"] for k in kernels), "kernels": kernels[:25]}


def log_profile(timing: dict) -> None:
    profile = timing["profile"]
    log(f"    GPU busy {profile['gpu_busy_s'] * 1e3:.2f} ms of the {timing['step_s'] * 1e3:.2f} ms "
        f"step, {profile['launches_per_step']:.0f} kernels per step"
        + (f"; graph replay alone {timing['graph_replay_s'] * 1e3:.2f} ms"
           if "graph_replay_s" in timing else ""))
    for kernel in profile["kernels"][:8]:
        log(f"    {kernel['s_per_step'] * 1e6:8.1f} us  x{kernel['per_step']:<5.0f} "
            f"{kernel['name'][:90]}")


def linear_layouts(torch, bandwidth: float) -> dict:
    """Batch-1 matmuls of the Llama-3-8B shapes in bfloat16, as cuBLAS runs them for a weight
    stored [out, in] (``F.linear``, the model's layout) and for one stored [in, out]
    (``x @ W``): the fraction of the copy bandwidth each reaches. Four weights per shape take
    turns, so that none is served from the L2 cache."""
    import torch.nn.functional as F

    shapes = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672),
              "down_proj": (14336, 4096)}
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    out: dict = {}
    for name, (k, n) in shapes.items():
        xk = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) if k != 4096 else x
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        transposed = [w.t().contiguous() for w in weights]
        row = {"weight_bytes": n * k * 2}
        for layout, call in (("out_in", lambda w: F.linear(xk, w)),
                             ("in_out", lambda w: xk @ w)):
            ws = weights if layout == "out_in" else transposed
            for w in ws:
                call(w)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(200):
                call(ws[i % 4])
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000 / 200
            row[layout] = {"s": seconds, "fraction_of_copy": n * k * 2 / seconds / bandwidth}
        out[name] = row
        log(f"  {name:13s} [out,in] {row['out_in']['fraction_of_copy']:.0%} of copy, "
            f"[in,out] {row['in_out']['fraction_of_copy']:.0%}")
        del weights, transposed
    free_cuda(torch)
    return out


def llama8b_step(torch, args, bandwidth: float, quantization: str | None) -> dict:
    from workers.engine.config import ModelConfig

    config = ModelConfig(**LLAMA3_8B)
    model = random_model(torch, config, torch.bfloat16, "cuda")
    if quantization is not None:
        model.quantize_weights(quantization, "cuda")
        free_cuda(torch)
    weight_bytes = decode_bytes(model)
    floor = weight_bytes / bandwidth
    result = {"weights": quantization or "bfloat16", "weight_bytes_read_per_step": weight_bytes,
              "floor_s": floor}
    if hasattr(model, "tune_small_batch_linear"):  # as the engine's loader does on a GPU
        tuned = model.tune_small_batch_linear()
        if tuned is not None:
            result["small_batch_linear"] = tuned
            log_small_batch_linear(tuned)
    runs = [True] if args.skip_eager_reference else [True, False]
    for graphs in runs:
        log(f"  {result['weights']}: batch-1 decode steps, CUDA graphs {'on' if graphs else 'off'}")
        timing = time_decode_steps(torch, model, context=args.step_context,
                                   steps=args.timed_steps, cuda_graphs=graphs)
        key = "graphs" if graphs else "eager"
        result[key] = timing
        log(f"  → {timing['step_s'] * 1e3:.2f} ms per step, "
            f"{timing['step_s'] / floor:.2f}x the floor of {floor * 1e3:.2f} ms")
        log_profile(timing)
    result["ratio_step_to_floor"] = result["graphs"]["step_s"] / floor
    if "graph_replay_s" in result["graphs"]:
        result["ratio_graph_replay_to_floor"] = result["graphs"]["graph_replay_s"] / floor
    result["target_ratio"] = TARGET_RATIO_FLOOR
    del model
    free_cuda(torch)
    return result


def log_small_batch_linear(report: dict) -> None:
    log(f"  small-batch matmul kernel tuned in {report['tune_s']:.1f} s:")
    for shape, choice in report["shapes"].items():
        one = choice["timings"].get(1, {})
        log(f"    {shape:>22s}: kernel up to {choice['max_rows']} rows; at 1 row "
            f"{one.get('kernel_s', float('nan')) * 1e6:.1f} us vs "
            f"{one.get('fallback_s', float('nan')) * 1e6:.1f} us; config {choice['config']}")


def fp8_problem(torch) -> str | None:
    """Why FP8 weights cannot be measured here, or None."""
    try:
        from workers.engine import fp8
        from workers.engine.model import CausalLM
    except ImportError:
        return "not available"
    if not hasattr(CausalLM, "quantize_weights"):
        return "not available"
    try:
        fp8.check_fp8_support("fp8", "cuda", torch.bfloat16)
    except fp8.Fp8Error as exc:
        return str(exc)
    return None


def main_cuda(args: argparse.Namespace, device: str) -> int:
    import torch

    from workers.engine import Engine
    from workers.engine.loader import bundled_model_path

    name = torch.cuda.get_device_name(device)
    path = None if args.llama8b_only else bundled_model_path()
    report: dict = {
        "benchmark": "engine", "device_name": name, "model": path.name if path else None,
        "machine": machine_info(torch),
        "workload": {"requests": args.requests, "prompt_tokens": [args.min_prompt,
                                                                  args.max_prompt],
                     "output_tokens": args.output_tokens, "greedy": True,
                     "single_stream_requests": args.single_requests},
    }
    _free, total = torch.cuda.mem_get_info(device)
    report["machine"]["gpu_memory_bytes"] = total
    log(f"device: {name}, torch {torch.__version__}")

    log("device-to-device copy bandwidth")
    report["copy_bandwidth"] = copy_bandwidth(torch, args.copy_bytes)
    bandwidth = report["copy_bandwidth"]["bytes_per_s"]
    log(f"  → {bandwidth / 1e9:.0f} GB/s")

    if not args.skip_llama8b:
        log("Llama-3-8B-shaped model, random bfloat16 weights")
        log("Llama-3-8B matmul shapes at batch 1, by weight layout")
        try:
            report["llama3_8b_linear_layouts"] = linear_layouts(torch, bandwidth)
        except Exception as exc:  # a diagnosis: never lose the run to it
            report["llama3_8b_linear_layouts"] = f"failed: {type(exc).__name__}: {exc}"
        report["llama3_8b_step"] = {"bfloat16": llama8b_step(torch, args, bandwidth, None)}
        problem = None if not args.skip_fp8 else "skipped (--skip-fp8)"
        problem = problem or fp8_problem(torch)
        if problem is None:
            for scheme in ("fp8", "fp8-per-tensor"):
                log(f"Llama-3-8B-shaped model, {scheme} weights")
                try:
                    report["llama3_8b_step"][scheme] = llama8b_step(torch, args, bandwidth,
                                                                    scheme)
                except Exception as exc:  # keep the other figures of a long run
                    log(f"  {scheme} failed: {exc!r}")
                    report["llama3_8b_step"][scheme] = f"failed: {type(exc).__name__}: {exc}"
                    free_cuda(torch)
        else:
            report["llama3_8b_step"]["fp8"] = problem
        if problem is None and not args.llama8b_only:
            # What FP8 costs in quality: the bundled model's logits and perplexity on a fixed
            # text, FP8 weights against the same model in bfloat16 on this GPU.
            from workers.engine.accuracy import measure_fp8_accuracy

            report["fp8_accuracy_vs_bfloat16"] = {}
            for scheme in ("fp8", "fp8-per-tensor"):
                log(f"{scheme} accuracy against bfloat16 (bundled model)")
                try:
                    report["fp8_accuracy_vs_bfloat16"][scheme] = measure_fp8_accuracy(
                        scheme=scheme, device="cuda", dtype=torch.bfloat16)
                except Exception as exc:
                    report["fp8_accuracy_vs_bfloat16"][scheme] = f"failed: {type(exc).__name__}: {exc}"
                free_cuda(torch)

    if args.llama8b_only:
        return write_cuda_report(
            report, args.output or RESULTS_DIR / f"engine-{device_slug(name)}-step.json")
    max_len = args.max_prompt + args.output_tokens
    dtype = None if args.engine_dtype == "auto" else getattr(torch, args.engine_dtype)

    def make_engine(model, graphs=True):
        # The pool is sized the way a worker sizes it: from free memory (see Engine).
        return Engine(model, dtype=dtype, device=device, max_batch_size=args.requests,
                      max_batched_tokens=args.max_batched_tokens, max_model_len=max_len,
                      batch_window_ms=args.batch_window_ms, cuda_graphs=graphs).start()

    log("loading the engine (bundled model)")
    started = time.perf_counter()
    engine = make_engine(path)
    report["engine_load_s"] = time.perf_counter() - started
    stats = engine.stats()
    report["engine_config"] = {
        "dtype": stats["dtype"], "max_batch_size": args.requests,
        "max_batched_tokens": args.max_batched_tokens, "max_model_len": max_len,
        "kv_capacity_tokens": stats["kv_capacity_tokens"], "kv_sizing": engine.kv_sizing,
        "cuda_graph_batch_sizes": stats["cuda_graph_batch_sizes"],
        "cuda_graph_capture_s": stats["cuda_graph_capture_s"],
        "cuda_graph_memory_bytes": stats["cuda_graph_memory_bytes"],
        "device_memory_total": stats["device_memory_total"],
    }
    linear = engine.loaded.model.linear
    if hasattr(linear, "report"):
        report["engine_config"]["small_batch_linear"] = linear.report()
    log(f"  graphs for {len(stats['cuda_graph_batch_sizes'])} batch sizes captured in "
        f"{stats['cuda_graph_capture_s']:.2f} s; KV capacity {stats['kv_capacity_tokens']} tokens")
    prompts = make_prompts(engine.tokenizer, args.requests, args.min_prompt, args.max_prompt,
                           args.seed)
    singles = make_prompts(engine.tokenizer, args.single_requests, args.min_prompt,
                           args.max_prompt, args.seed + 1)

    if not args.skip_engine_single and singles:
        log(f"engine single stream: {len(singles)} requests one at a time")
        report["engine_single"] = run_engine_single(engine, singles, args.output_tokens)
    log(f"engine: {args.requests} requests at once")
    report["engine_batched"] = run_engine_batched(engine, prompts, args.output_tokens)
    log(f"  → {report['engine_batched']['output_tokens_per_s']:.0f} output tok/s; loop ms per "
        f"step: {report['engine_batched']['loop_ms_per_step']}")
    loaded = engine.loaded
    engine.stop()
    log(f"bundled model: decode steps of {args.requests} sequences through the runner")
    try:  # a diagnosis: where a step of the batched run goes, device against host
        report["bundled_step"] = time_decode_steps(
            torch, loaded.model, context=(args.min_prompt + args.max_prompt) // 2, steps=50,
            cuda_graphs=True, batch=args.requests)
        log(f"  → {report['bundled_step']['step_s'] * 1e3:.2f} ms per step")
        log_profile(report["bundled_step"])
    except Exception as exc:
        log(f"  failed: {exc!r}")
        report["bundled_step"] = f"failed: {type(exc).__name__}: {exc}"
    free_cuda(torch)
    del engine
    free_cuda(torch)
    if not args.skip_eager_reference:
        log("engine with CUDA graphs off (reference)")
        engine = make_engine(loaded, graphs=False)
        if singles and not args.skip_engine_single:
            report["engine_single_eager"] = run_engine_single(engine, singles[:2],
                                                              args.output_tokens)
        report["engine_batched_eager"] = run_engine_batched(engine, prompts, args.output_tokens)
        log(f"  → {report['engine_batched_eager']['output_tokens_per_s']:.0f} output tok/s")
        engine.stop()
        del engine
    del loaded
    free_cuda(torch)

    report["transformers"] = {}
    dtypes = [] if args.skip_transformers else \
        [d.strip() for d in args.transformers_dtypes.split(",") if d.strip()]
    for dtype_name in dtypes:
        log(f"loading transformers ({dtype_name}) on {device}")
        model = load_transformers(path, getattr(torch, dtype_name)).to(device)
        runs: dict = {}
        try:  # keep the engine's figures of a long run if the baseline breaks
            if not args.skip_transformers_batched:
                log(f"transformers {dtype_name}: {len(prompts)} requests in one padded batch")
                runs["batched"] = run_transformers_batched(model, prompts, args.output_tokens, 0,
                                                           torch, device=device)
                log(f"  → {runs['batched']['output_tokens_per_s']:.0f} output tok/s")
            if not args.skip_transformers_single and singles:
                log(f"transformers {dtype_name}: {len(singles)} requests one at a time")
                runs["single"] = run_transformers_single(model, singles, args.output_tokens,
                                                         torch, device=device)
        except Exception as exc:
            log(f"  transformers {dtype_name} failed: {exc!r}")
            runs["failed"] = f"{type(exc).__name__}: {exc}"
        report["transformers"][dtype_name] = runs
        del model
        free_cuda(torch)

    batched = [v["batched"]["output_tokens_per_s"] for v in report["transformers"].values()
               if "batched" in v]
    if batched:
        report["transformers_batched_best_tokens_per_s"] = max(batched)
        report["ratio_vs_transformers_batched"] = (
            report["engine_batched"]["output_tokens_per_s"] / max(batched))
        report["target_ratio_vs_transformers_batched"] = TARGET_RATIO_BATCHED_CUDA
    single = [v["single"]["decode_tokens_per_s"] for v in report["transformers"].values()
              if v.get("single", {}).get("decode_tokens_per_s")]
    if single and "engine_single" in report:
        report["ratio_single_stream_decode"] = (
            report["engine_single"]["decode_tokens_per_s"] / max(single))

    return write_cuda_report(
        report, args.output or RESULTS_DIR / f"engine-{device_slug(name)}.json")


def write_cuda_report(report: dict, output: Path) -> int:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {output.relative_to(REPO_ROOT) if output.is_relative_to(REPO_ROOT) else output}")
    step = report.get("llama3_8b_step", {})
    for weights, result in step.items():
        if isinstance(result, dict):
            log(f"8B step ({weights}): {result['ratio_step_to_floor']:.2f}x the floor "
                f"(target <= {TARGET_RATIO_FLOOR})")
        else:
            log(f"8B step ({weights}): {result}")
    for key in ("ratio_vs_transformers_batched", "ratio_single_stream_decode"):
        if key in report:
            log(f"{key}: {report[key]:.2f}")
    return 0


def finish_single(result: dict, engine) -> dict:
    """A single-stream result with the thread count the engine chose for one-token steps; the
    engine is stopped."""
    if engine.runner.threads is not None:
        result["threads_for_one_token_steps"] = engine.runner.threads.choice
    engine.stop()
    return result


def merge_single(parts: list[dict]) -> dict:
    """One single-stream figure from per-request runs."""
    rates = [p["decode_tokens_per_s"] for p in parts if p.get("decode_tokens_per_s")]
    tokens = sum(p["output_tokens"] for p in parts)
    wall = sum(p["wall_s"] for p in parts)
    return {"requests": sum(p["requests"] for p in parts), "output_tokens": tokens,
            "wall_s": wall, "output_tokens_per_s": tokens / wall if wall else None,
            "decode_tokens_per_s": statistics.median(rates) if rates else None,
            "decode_tokens_per_s_each": rates, "contention_at_end": contention()}


if __name__ == "__main__":
    sys.exit(main())
