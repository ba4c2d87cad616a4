"""What guided output costs the engine (JSON output, tool calls): the same requests guided and free.

Each batch size runs the bundled model on prompts that ask for JSON, first guided (json_object,
a json_schema, then with the schema as a tool's parameters: tool_choice "auto", which this model
answers in text, and "required"), then free: each free request is given exactly as many tokens as
its guided twin produced (``ignore_eos``) and the same prompt (the tools described), so both runs
step through the same batches and only the guiding differs. The figures are the ratio of output tokens/s, guided over free, measured in the same run
(the better of ``--repeats`` runs each, alternating), and the share of the guided runs' time the
engine itself spent guiding (its ``guide_seconds``: steadier than the ratio on a busy machine). It
also reports how many guided replies ended, parsed and, for the schema, validated.

    python bench/guided.py
    python bench/guided.py --batch-sizes 1,16 --max-tokens 64 --formats tools_auto,tools_required

Writes bench/results/guided-<device>.json. Not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

SUBJECTS = ("cat", "city", "book", "car", "river", "planet", "recipe", "song", "tree", "bird", "shop", "film")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "kind": {"type": "string"}, "size": {"type": "integer"},
                   "rating": {"enum": ["low", "medium", "high"]},
                   "facts": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "kind", "size", "rating", "facts"],
    "additionalProperties": False,
}
TOOLS = [{"name": "save_thing", "description": "Save a thing's facts", "parameters": SCHEMA}]
FORMATS = {  # what each guided request adds to its SamplingParams
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}},
    "tools_auto": {"tools": TOOLS, "tool_choice": "auto"},
    "tools_required": {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,32", help="concurrent requests per run (1,8,32)")
    parser.add_argument("--max-tokens", type=int, default=160, help="max_tokens of each guided request (160)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each kind per batch size; the best counts (2)")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"which to run ({','.join(FORMATS)})")
    parser.add_argument("--device", default=None, help="cpu or cuda (the engine's default)")
    parser.add_argument("--out", default=None, help="where the JSON goes (bench/results/guided-<device>.json)")
    return parser.parse_args(argv)


def messages(i: int) -> list[dict]:
    subject = SUBJECTS[i % len(SUBJECTS)]
    return [{"role": "user", "content": f"Give a short JSON object about a {subject} (number {i}): its name, "
                                        "kind, size, a rating and up to three facts."}]


def run(engine, params_list, tools=None) -> tuple[float, list]:
    """Submit every request at once; (seconds until the last finished, the outputs). ``tools``:
    described in the prompts of requests that do not carry them (the free twins of tool calls)."""
    from workers.engine.tool_calls import chat_messages

    started = time.perf_counter()
    handles = [engine.submit_chat(chat_messages(messages(i), None if p.tools else tools), p)
               for i, p in enumerate(params_list)]
    outputs = [h.result(timeout=1800) for h in handles]
    return time.perf_counter() - started, outputs


def measure(engine, batch: int, guide: dict, args, SamplingParams) -> dict:
    guided = [SamplingParams(max_tokens=args.max_tokens, temperature=0, **guide)] * batch
    _, outputs = run(engine, guided)  # also the lengths the free twins get
    free = [SamplingParams(max_tokens=o.completion_tokens, temperature=0, ignore_eos=True) for o in outputs]
    best = {"guided": float("inf"), "free": float("inf")}
    guide_share = []
    for _ in range(args.repeats):
        for kind, params in (("free", free), ("guided", guided)):
            before = engine.stats()
            seconds, got = run(engine, params, guide.get("tools"))
            after = engine.stats()
            assert [o.completion_tokens for o in got] == [o.completion_tokens for o in outputs], kind
            best[kind] = min(best[kind], seconds)
            if kind == "guided":
                guide_share.append((after["guide_seconds"] - before["guide_seconds"]) / seconds)
    tokens = sum(o.completion_tokens for o in outputs)
    row = {
        "batch": batch, "output_tokens": tokens,
        "guided_tokens_per_s": round(tokens / best["guided"], 1),
        "free_tokens_per_s": round(tokens / best["free"], 1),
        "guided_over_free": round(best["free"] / best["guided"], 3),
        # The engine's own account: the share of the guided run's time spent picking allowed
        # tokens and moving the grammars on (what guiding costs, free of run-to-run noise).
        "guide_share_of_time": round(min(guide_share), 4),
        "ended_by_stop": sum(o.finish_reason == "stop" for o in outputs),
        **_checked(outputs, guide),
    }
    return row


def _checked(outputs, guide: dict) -> dict:
    """How many replies parsed (as JSON, or as calls) and followed the schema."""
    import jsonschema

    from workers.engine.tool_calls import parse_tool_calls

    def valid(value) -> bool:
        try:
            jsonschema.validate(value, SCHEMA)
            return True
        except jsonschema.ValidationError:
            return False

    if "tools" in guide:
        replies = [parse_tool_calls(o.text) for o in outputs]
        calls = [json.loads(c["arguments"]) for o, (_, cs) in zip(outputs, replies) if o.finish_reason == "stop"
                 for c in cs]
        return {"answered_in_text": sum(1 for text, cs in replies if text and not cs),
                "calls": len(calls), "calls_valid_for_schema": sum(map(valid, calls))}
    values = []
    for o in outputs:
        try:
            values.append(json.loads(o.text))
        except ValueError:
            pass
    row = {"parsed_as_json": len(values)}
    if guide["response_format"]["type"] == "json_schema":
        row["valid_for_schema"] = sum(map(valid, values))
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    unknown = set(args.formats.split(",")) - set(FORMATS)
    if unknown:
        raise SystemExit(f"--formats: unknown {', '.join(sorted(unknown))} (known: {', '.join(FORMATS)})")
    import torch

    from engine import machine_info, write_result  # bench/engine.py
    from workers.engine import Engine, SamplingParams, bundled_model_path

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    report = {"benchmark": "guided", "machine": machine_info(torch), "max_tokens": args.max_tokens,
              "repeats": args.repeats, "formats": {}}
    engine_args = {"max_batch_size": max(sizes)}
    if args.device:
        engine_args["device"] = args.device
    with Engine(bundled_model_path(), **engine_args) as engine:
        report["device"] = engine.device_name
        for name in args.formats.split(","):
            guide = FORMATS[name]
            rows = report["formats"][name] = []
            for batch in sizes:
                print(f"{name}, {batch} at once ...", flush=True)
                rows.append(measure(engine, batch, guide, args, SamplingParams))
                print(f"  {rows[-1]}", flush=True)
    write_result(report, prefix="guided", device=report["device"], out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
