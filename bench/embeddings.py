"""Embeddings through the engine against Hugging Face transformers on the same machine.

The same texts (lengths spread over ``--min-tokens``..``--max-tokens``) are embedded twice: by the
engine (every text submitted at once with ``SamplingParams(embed=True)``: its scheduler batches
them, a paged KV cache, no padding; its prefix cache off, so that each repeat computes every
text again) and by transformers (the same weights and dtype, padded
batches of ``--hf-batch``, the last real token's final hidden state, normalized), each run timed
``--repeats`` times, the best kept. Reported: texts/s and tokens/s of each, their ratio, and how
close the two embeddings of each text are (cosine).

    python bench/embeddings.py
    python bench/embeddings.py --texts 512 --device cuda

Writes bench/results/embeddings-<device>.json. Not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))
WORDS = ("the sea river model token engine batch cache paged graph kernel weight light stone city song "
         "garden winter market signal number letter window bridge forest story").split()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=128, help="how many texts (128)")
    parser.add_argument("--min-tokens", type=int, default=16, help="shortest text, in words (16)")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest text, in words (256)")
    parser.add_argument("--hf-batch", type=int, default=16, help="transformers' batch size (16)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each; the best counts (2)")
    parser.add_argument("--device", default=None, help="cpu or cuda (the engine's default)")
    parser.add_argument("--out", default=None, help="where the JSON goes (bench/results/embeddings-<device>.json)")
    return parser.parse_args(argv)


def texts(count: int, shortest: int, longest: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(shortest, longest))) for _ in range(count)]


def engine_embeddings(engine, token_ids: list[list[int]], SamplingParams):
    handles = [engine.submit(ids, SamplingParams(embed=True)) for ids in token_ids]
    return [h.result(timeout=1800).embedding for h in handles]


def hf_embeddings(model, token_ids: list[list[int]], batch: int, torch):
    """Right-padded batches, longest first (less padding); each text's last real token."""
    order = sorted(range(len(token_ids)), key=lambda i: -len(token_ids[i]))
    out = [None] * len(token_ids)
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(order), batch):
            rows = order[start:start + batch]
            width = max(len(token_ids[i]) for i in rows)
            ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, :len(token_ids[i])] = torch.tensor(token_ids[i])
                mask[r, :len(token_ids[i])] = 1
            hidden = model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            last = hidden[torch.arange(len(rows)), mask.sum(1).to(device) - 1]
            vectors = torch.nn.functional.normalize(last.float(), dim=-1).cpu().numpy()
            for r, i in enumerate(rows):
                out[i] = vectors[r]
    return out


def best_of(repeats: int, run) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - started)
    return best, result


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch
    import transformers

    from engine import machine_info, write_result  # bench/engine.py
    from workers.engine import Engine, SamplingParams, bundled_model_path

    path = bundled_model_path()
    # No prefix cache: a repeat would find every text cached, and transformers recomputes them.
    engine_args = {"enable_prefix_caching": False, **({"device": args.device} if args.device else {})}
    with Engine(path, **engine_args) as engine:
        dtype = engine.dtype
        token_ids = [engine.tokenizer.encode(t, add_special_tokens=True) for t in texts(
            args.texts, args.min_tokens, args.max_tokens)]
        tokens = sum(len(ids) for ids in token_ids)
        print(f"{len(token_ids)} texts, {tokens} tokens, {dtype} on {engine.device_name}", flush=True)
        engine_embeddings(engine, token_ids[:4], SamplingParams)  # warm up
        engine_s, ours = best_of(args.repeats, lambda: engine_embeddings(engine, token_ids, SamplingParams))
        print(f"  engine: {engine_s:.2f} s", flush=True)
        device_name = engine.device_name
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    if args.device:
        hf = hf.to(args.device)
    hf_embeddings(hf, token_ids[:4], args.hf_batch, torch)
    hf_s, theirs = best_of(args.repeats, lambda: hf_embeddings(hf, token_ids, args.hf_batch, torch))
    print(f"  transformers: {hf_s:.2f} s", flush=True)
    cosines = [float(np.dot(a, b)) for a, b in zip(ours, theirs)]
    report = {
        "benchmark": "embeddings", "machine": machine_info(torch), "device": device_name, "dtype": str(dtype),
        "texts": len(token_ids), "tokens": tokens, "hf_batch": args.hf_batch, "repeats": args.repeats,
        "prefix_cache": False,
        "engine": {"seconds": round(engine_s, 3), "texts_per_s": round(len(token_ids) / engine_s, 1),
                   "tokens_per_s": round(tokens / engine_s, 1)},
        "transformers": {"seconds": round(hf_s, 3), "texts_per_s": round(len(token_ids) / hf_s, 1),
                         "tokens_per_s": round(tokens / hf_s, 1)},
        "engine_over_transformers": round(hf_s / engine_s, 3),
        "cosine_min": round(min(cosines), 6), "cosine_mean": round(sum(cosines) / len(cosines), 6),
    }
    print(json.dumps({k: report[k] for k in ("engine", "transformers", "engine_over_transformers", "cosine_min")}))
    write_result(report, prefix="embeddings", device=device_name, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
