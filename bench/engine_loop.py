"""The engine loop's host time per step at a large batch: what a GPU step waits on.

On a GPU the model's step takes a few milliseconds at 256 requests, and the loop's Python around it
(choosing the batch, taking each request's token, detokenizing it, stop strings, handing the output
out) adds as much again. This runs that loop with the bundled model's tokenizer and vocabulary but a
one-layer random model of hidden size 64, so that the model costs little, and reports each phase's
milliseconds per step as the loop thread's CPU time (so that other work on the machine does not
count): ``schedule``, ``execute`` (the tiny model and sampling over the whole vocabulary: not the
point here) and ``postprocess`` (taking and handing out the tokens).

Two ways, in turns (``--rounds`` each, interleaved): ``engine``, as it runs, and ``windowed``, the
same with the windowed detokenizer (two decodes of a window per token) that byte-level vocabularies
used before: the baseline for the hand-out. Reported: the median of each way's rounds, and their
postprocess ratio. Writes bench/results/engine-loop-<cpu>.json. Not part of the tests.

    python bench/engine_loop.py
    python bench/engine_loop.py --requests 64 --output-tokens 32 --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))
WAYS = ("engine", "windowed")
PHASES = ("schedule", "execute", "postprocess")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256, help="requests at once (256)")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens each request generates (64)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each way (3)")
    parser.add_argument("--stop", action="store_true", help="give every request stop strings (the slower gate)")
    parser.add_argument("--output", default=None, help="where the JSON goes (bench/results/engine-loop-<cpu>.json)")
    return parser.parse_args(argv)


def tiny_engine(requests: int, output_tokens: int):
    """An engine over a one-layer random model with the bundled model's tokenizer and vocabulary,
    timing its loop by the loop thread's CPU time."""
    import torch

    from workers.engine import engine as engine_module
    from workers.engine.attention import get_backend
    from workers.engine.loader import LoadedModel, bundled_model_path, load_model
    from workers.engine.model import CausalLM, ops_for

    full = load_model(bundled_model_path())
    config = dataclasses.replace(full.config, num_layers=1, hidden_size=64, intermediate_size=128,
                                 num_heads=2, num_kv_heads=1, head_dim=32)
    model = CausalLM(config, backend=get_backend("cpu"), dtype=torch.float32, ops=ops_for("cpu"))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)
    engine_module.time = types.SimpleNamespace(perf_counter=time.thread_time, monotonic=time.monotonic,
                                               sleep=time.sleep)
    loaded = LoadedModel(model.eval(), full.tokenizer, config, full.path)
    blocks = requests * (output_tokens + 160) // 16 + 64
    return engine_module.Engine(loaded, max_batch_size=requests, max_batched_tokens=8192, num_kv_blocks=blocks)


def run_round(engine, way: str, prompts, params) -> dict:
    from workers.engine.tokenizer import IncrementalDetokenizer

    fast = engine._detokenizer
    if way == "windowed":
        engine._detokenizer = lambda: IncrementalDetokenizer(engine.tokenizer)
    try:
        before = engine.stats()
        finished = []
        for prompt in prompts:
            engine.submit(prompt, params, listener=lambda out: out.finished and finished.append(out))
        deadline = time.monotonic() + 1800
        while len(finished) < len(prompts):
            if time.monotonic() > deadline:
                raise TimeoutError("the round did not end within 30 minutes")
            time.sleep(0.02)
        after = engine.stats()
    finally:
        engine._detokenizer = fast
    steps = after["steps"] - before["steps"]
    return {phase: 1000 * (after[f"{phase}_seconds"] - before[f"{phase}_seconds"]) / steps for phase in PHASES}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from engine import machine_info, write_result  # bench/engine.py
    from workers.engine.sequence import SamplingParams

    engine = tiny_engine(args.requests, args.output_tokens)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(32, 128))] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True,
                            stop=["zzqq", "\n\n\n"] if args.stop else None)
    rounds = {way: [] for way in WAYS}
    try:
        for index in range(args.rounds):
            for way in WAYS:
                result = run_round(engine, way, prompts, params)
                rounds[way].append(result)
                print(f"round {index + 1}/{args.rounds} {way:9s} ms/step " +
                      " ".join(f"{phase} {result[phase]:.3f}" for phase in PHASES), flush=True)
    finally:
        engine.stop()
    median = {way: {phase: statistics.median(r[phase] for r in rounds[way]) for phase in PHASES} for way in WAYS}
    report = {
        "benchmark": "engine_loop",
        "machine": machine_info(torch),
        "workload": {"requests": args.requests, "output_tokens": args.output_tokens, "stop_strings": args.stop,
                     "model": "one random layer, hidden 64, the bundled model's vocabulary and tokenizer"},
        "ms_per_step": median,
        "rounds": rounds,
        "postprocess_ratio_engine_over_windowed": median["engine"]["postprocess"] / median["windowed"]["postprocess"],
    }
    print(f"postprocess: {median['engine']['postprocess']:.3f} ms/step against {median['windowed']['postprocess']:.3f} "
          f"with the windowed detokenizer ({report['postprocess_ratio_engine_over_windowed']:.2f}x)")
    write_result(report, prefix="engine-loop", device=report["machine"]["cpu"] or "cpu", out=args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
