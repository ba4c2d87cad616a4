"""Command line: ``python -m workers.engine generate ...`` and ``python -m workers.engine bench``.

    python -m workers.engine generate "Once upon a time" --max-tokens 64
    python -m workers.engine generate --chat "Write a haiku about rain." --temperature 0.7
    python -m workers.engine generate --chat "A cat, as JSON." --json
    python -m workers.engine generate --chat "Weather in Oslo?" --tools tools.json --tool-choice required
    python -m workers.engine bench --requests 16
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.engine",
                                     description="Run the inference engine from the shell.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for one prompt, streaming it")
    gen.add_argument("prompt", nargs="?", help="raw prompt text (or use --chat)")
    gen.add_argument("--chat", metavar="MESSAGE",
                     help="a user message, wrapped in the model's chat template")
    gen.add_argument("--system", help="a system message to go with --chat")
    gen.add_argument("--model", help="a .gguf file or Hugging Face folder (default: the "
                                     "bundled SmolLM2-135M-Instruct)")
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                     default="auto", help="compute dtype (auto: measured per machine)")
    gen.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--quantization", choices=["fp8", "fp8-per-tensor"],
                     help="store the decoder's linear weights in FP8 (default: in the dtype)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--logprobs", type=int, metavar="N",
                     help="print each token's logprob and the N most likely alternatives")
    gen.add_argument("--json", action="store_true", help="constrain the output to a JSON object")
    gen.add_argument("--json-schema", metavar="FILE",
                     help="constrain the output to a value of the JSON Schema in FILE")
    gen.add_argument("--tools", metavar="FILE",
                     help="functions the model may call: a JSON list of OpenAI tools in FILE")
    gen.add_argument("--tool-choice", default="auto", metavar="CHOICE",
                     help="auto (default), required, none, or a function's name")

    commands.add_parser("bench", add_help=False,
                        help="the engine benchmark (bench/engine.py); --help for its flags")

    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return _generate(args, parser)


def _generate(args, parser) -> int:
    from . import Engine, InvalidRequestError, SamplingParams
    from .loader import bundled_model_path

    if (args.prompt is None) == (args.chat is None):
        parser.error("give a prompt or --chat MESSAGE (one of them)")
    response_format = {"type": "json_object"} if args.json else None
    if args.json_schema:
        import json

        try:
            schema = json.loads(Path(args.json_schema).read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"--json-schema: {exc}")
        response_format = {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}
    tools = _read_tools(args.tools, parser) if args.tools else None
    choice = args.tool_choice if args.tool_choice in ("auto", "required", "none") else {"name": args.tool_choice}
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop or None,
            ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            logprobs=args.logprobs is not None, top_logprobs=args.logprobs or 0,
            response_format=response_format, tools=tools, tool_choice=choice)
    except InvalidRequestError as exc:
        parser.error(str(exc))

    started = time.monotonic()
    engine = Engine(args.model or bundled_model_path(),
                    dtype=None if args.dtype == "auto" else args.dtype, device=args.device,
                    max_batch_size=1, quantization=args.quantization)
    print(f"[loaded in {time.monotonic() - started:.1f} s: {engine.config.architecture}, "
          f"{engine.dtype}{', ' + args.quantization if args.quantization else ''}, {engine.device}]", file=sys.stderr)
    progress = not sys.stdout.isatty() and sys.stderr.isatty()
    with engine:
        try:
            if args.chat is not None:
                messages = ([{"role": "system", "content": args.system}] if args.system else [])
                handle = engine.submit_chat(messages + [{"role": "user", "content": args.chat}],
                                            params)
            else:
                handle = engine.submit(args.prompt, params)
        except InvalidRequestError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        tokenizer = engine.tokenizer
        last = None
        for out in handle:
            last = out
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if args.logprobs is not None:
                for lp in out.logprobs or []:
                    alternatives = ", ".join(f"{tokenizer.decode([t])!r}: {v:.3f}"
                                             for t, v in lp.top_logprobs)
                    print(f"\n  [{tokenizer.decode([lp.token_id])!r} {lp.logprob:.3f}"
                          f"{' | ' + alternatives if alternatives else ''}]", file=sys.stderr)
            if progress:
                elapsed = time.monotonic() - out.timings.arrival_time
                print(f"\r[{out.completion_tokens}/{params.max_tokens} tokens, "
                      f"{out.completion_tokens / max(elapsed, 1e-9):.1f} tok/s]",
                      end="", file=sys.stderr, flush=True)
    print(file=sys.stdout)
    timings = last.timings
    ttft = timings.time_to_first_token
    tpot = timings.time_per_output_token
    decode_rate = f"{1 / tpot:.1f} tok/s" if tpot else "n/a"
    print(f"[{last.finish_reason}{': ' + last.error if last.error else ''}; "
          f"{last.prompt_tokens} prompt tokens ({last.cached_prompt_tokens} cached), "
          f"{last.completion_tokens} completion tokens; "
          f"TTFT {ttft * 1000:.0f} ms; decode {decode_rate}; "
          f"total {timings.e2e_latency:.2f} s]" if ttft is not None else
          f"[{last.finish_reason}; no tokens]", file=sys.stderr)
    return 0 if last.finish_reason != "error" else 1


def _read_tools(path: str, parser) -> list[dict]:
    """OpenAI's tools ({"type": "function", "function": {...}}) or bare functions, from a file."""
    import json

    try:
        tools = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"--tools: {exc}")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        parser.error("--tools: the file must hold a JSON list of tools")
    return [t["function"] if isinstance(t.get("function"), dict) else t for t in tools]


def _bench(rest: list[str]) -> int:
    script = Path(__file__).resolve().parents[2] / "bench" / "engine.py"
    if not script.is_file():
        print("the benchmark lives in bench/engine.py of the source checkout; run it from "
              "there: python bench/engine.py --help", file=sys.stderr)
        return 2
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
