"""Serving benchmark: the full stack (gateway → Redis → Celery worker → engine → SSE) against the
engine called directly, on the same prompts, in the same run.

For each concurrency level (default 1, 8, 32, 64 streaming clients; each client sends
``--rounds`` requests back to back) it measures TTFT, TPOT and inter-token latency p50/p99,
requests/s and output tokens/s. The full stack is what `inference-platform up` starts (SQLite
and a private Redis in a temporary folder, one worker); the direct run uses an Engine in this
process with the same deployment settings (dtype, max batch size, batch window).

Targets (issue): at 32 clients the full stack keeps >= 80% of the engine's direct output
tokens/s and adds <= 15 ms to p50 TTFT (batch window excluded). ``added_ttft_p50_ms`` is the
stack's p50 TTFT minus the engine's own p50 TTFT at the same concurrency; both include the
engine's batch window, so it cancels out. Where the platform's share goes: each stack level also
reports the p50 of the time to the response headers (sent once the engine accepted the request)
and of each stage of the gateway's ``Server-Timing`` header (auth, admit, dispatch, queue, load),
``arrival_spread_ms``: how far apart the first and the last request of the level reached the
engine (a spread longer than the batch window splits a burst over several prefills),
``ttft_outside_engine_ms_p50``/``p99``: per request, the client's TTFT minus the engine's own
(arrival at the engine to first token, from billing's usage record) — what the platform adds to
each request whatever the engine's speed, where ``added_ttft_p50_ms`` also holds the difference
between how the engine batches a burst that arrives at once and one that trickles in — and
``cpu_ms_per_output_token``: the CPU time each part of the stack (web, worker, billing, redis, beat, the
benchmark's own client) used per output token, to set against the engine's own figure in the
direct run: on a machine whose cores the engine keeps busy, that difference is what the
platform costs. Last, ``admission``: the CPU per request of each part, from one-token requests
(``--admission-requests``). Writes
bench/results/serving-cpu.json and a PNG plot (matplotlib, from the `bench` extra:
pip install -e '.[bench]'). Not part of the tests.

    python bench/serving.py
    python bench/serving.py --concurrency 1,8 --rounds 1 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
RESULTS = REPO_ROOT / "bench" / "results"
DEPLOYMENT = "smollm2-135m-instruct"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client counts (1,8,32,64)")
    parser.add_argument("--rounds", type=int, default=2, help="requests each client sends in turn (2)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (64)")
    parser.add_argument("--prompt-words", type=int, default=60, help="words per prompt (60)")
    parser.add_argument("--admission-requests", type=int, default=200,
                        help="one-token requests (32 at a time) whose CPU per request is measured (200; 0: skip)")
    parser.add_argument("--web-workers", type=int, default=1, help="web server processes of the stack (1)")
    parser.add_argument("--port", type=int, default=8765, help="web port of the stack under test (8765)")
    parser.add_argument("--out", default=str(RESULTS / "serving-cpu.json"))
    return parser.parse_args(argv)


def prompts(count: int, words: int) -> list[str]:
    rng = random.Random(0)
    vocabulary = "river stone light market engine garden winter paper signal orange forest letter".split()
    return [f"Story {i}: " + " ".join(rng.choice(vocabulary) for _ in range(words)) + ". Continue the story."
            for i in range(count)]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(samples: list[dict], wall: float) -> dict:
    ttft = [s["ttft"] * 1000 for s in samples]
    tpot = [(s["end"] - s["first"]) / (s["tokens"] - 1) * 1000 for s in samples if s["tokens"] > 1]
    itl = [gap * 1000 for s in samples for gap in s["gaps"]]
    tokens = sum(s["tokens"] for s in samples)
    return {
        "requests": len(samples), "output_tokens": tokens, "wall_s": round(wall, 3),
        "requests_per_s": round(len(samples) / wall, 3), "output_tokens_per_s": round(tokens / wall, 2),
        **{f"ttft_ms_p{q}": round(percentile(ttft, q), 2) for q in (50, 99)},
        **{f"tpot_ms_p{q}": round(percentile(tpot, q), 2) for q in (50, 99) if tpot},
        **{f"itl_ms_p{q}": round(percentile(itl, q), 2) for q in (50, 99) if itl},
    }


# ----------------------------------------------------------------------------- the full stack

class Stack:
    """`inference-platform up` on a temporary data folder, stopped with Ctrl-C's signal."""

    def __init__(self, port: int, web_workers: int = 1):
        self.port = port
        self.dir = tempfile.mkdtemp(prefix="ip-bench-")
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env.update(DATA_DIR=self.dir, RATE_LIMIT_KEY_RPM="1000000", RATE_LIMIT_ORG_RPM="1000000")
        self.log = open(Path(self.dir) / "up.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "inference_platform.cli", "up", "--port", str(port),
                                      "--web-workers", str(web_workers)],
                                     cwd=REPO_ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        log = Path(self.dir) / "up.log"
        while time.monotonic() < deadline:
            if "Ready." in log.read_text():
                return (Path(self.dir) / "api-key.txt").read_text().strip()
            if self.proc.poll() is not None:
                raise SystemExit(f"the stack exited:\n{log.read_text()}")
            time.sleep(0.5)
        raise SystemExit("the stack did not become ready")

    def _django(self, code: str, stdin: str = "") -> str:
        """Run ``code`` against the stack's database in a fresh process; its last line of output."""
        env = {**os.environ, "DATA_DIR": self.dir, "DJANGO_SETTINGS_MODULE": "inference_platform.settings"}
        env.pop("DATABASE_URL", None)
        env.pop("REDIS_URL", None)
        out = subprocess.run([sys.executable, "-c", "import django; django.setup()\n" + textwrap.dedent(code)],
                             cwd=REPO_ROOT, env=env, input=stdin, capture_output=True, text=True, check=True)
        return out.stdout.strip().splitlines()[-1]

    def deployment_settings(self) -> dict:
        return json.loads(self._django(f"""
            import json
            from models_catalog.models import Deployment
            d = Deployment.objects.get(name='{DEPLOYMENT}')
            print(json.dumps({{'dtype': d.dtype, 'max_batch_size': d.max_batch_size,
                              'batch_window_ms': d.batch_window_ms}}))
        """))

    def engine_ttft_ms(self, request_ids: list[str], timeout: float = 120) -> dict[str, float]:
        """Each request's time to first token inside the engine (from its arrival there), from
        billing's usage records, which are written once a request ended (so: waited for)."""
        return json.loads(self._django(f"""
            import json, sys, time
            from billing.models import UsageRecord
            ids, deadline = json.load(sys.stdin), time.monotonic() + {timeout}
            while True:
                rows = dict(UsageRecord.objects.filter(request_id__in=ids).values_list("request_id", "ttft_ms"))
                if len(rows) == len(ids) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            print(json.dumps(rows))
        """, stdin=json.dumps(request_ids)))

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each part of the stack has used so far, by role (a process
        that is none of them, such as the web server's worker processes, has its parent's)."""
        clock = os.sysconf("SC_CLK_TCK")
        used: dict[str, float] = {}
        roles = {}
        for pid, parent in _descendants(self.proc.pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue  # it ended meanwhile
            role = roles[pid] = _role(command) or roles.get(parent, "supervisor")
            used[role] = used.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / clock
        return used


def _descendants(root: int) -> list[tuple[int, int | None]]:
    """(pid, parent pid) of ``root`` and every process under it, parents first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [(root, None)]
    while todo:
        pid, parent = todo.pop(0)
        found.append((pid, parent))
        todo += [(child, pid) for child in children.get(pid, [])]
    return found


def _role(command: str) -> str | None:
    for role, marker in (("redis", "redis-server"), ("web", "uvicorn"), ("billing", "billing@"), ("worker", " worker "),
                         ("beat", " beat ")):
        if marker in command:
            return role
    return None


def cpu_ms_per(before: dict[str, float], after: dict[str, float], count: int) -> dict[str, float]:
    """CPU milliseconds per output token (or per request), per role, between two readings."""
    return {role: round((after[role] - before.get(role, 0.0)) * 1000 / max(count, 1), 3)
            for role in sorted(after)}


async def stream_once(client, base: str, key: str, prompt: str, max_tokens: int) -> dict:
    from gateway.timing import parse

    started = time.perf_counter()
    stamps = []
    body = {"model": DEPLOYMENT, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens, request_id = 0, None
    async with client.stream("POST", f"{base}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as response:
        response.raise_for_status()
        headers_at = time.perf_counter()
        stages = parse(response.headers.get("server-timing"))
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                request_id = request_id or chunk.get("id")
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    stamps = stamps or [time.perf_counter()]  # no text at all (an end-of-text first token): the end counts
    return {"id": request_id, "ttft": stamps[0] - started, "first": stamps[0], "end": stamps[-1], "tokens": tokens,
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "headers": headers_at - started,
            "headers_at": headers_at, "stages": stages}


def platform_share(samples: list[dict], engine_ttft_ms: dict[str, float]) -> dict:
    """p50 of the time to the response headers and of each Server-Timing stage; the arrival spread;
    the part of each request's TTFT spent outside the engine."""
    def p50(values):
        return round(percentile(values, 50), 2)

    names = list(dict.fromkeys(name for s in samples for name in s["stages"]))
    # The headers leave once the engine accepted the request: the spread of the first round's (a
    # burst: every client starts at once) is how far apart the burst reached the engine.
    arrivals = [s["headers_at"] for s in samples if s["round"] == 0]
    outside = [s["ttft"] * 1000 - engine_ttft_ms[s["id"]] for s in samples if engine_ttft_ms.get(s["id"]) is not None]
    return {
        "headers_ms_p50": p50([s["headers"] * 1000 for s in samples]),
        "server_timing_ms_p50": {name: p50([s["stages"].get(name, 0.0) for s in samples]) for name in names},
        "arrival_spread_ms": round((max(arrivals) - min(arrivals)) * 1000, 2),
        "ttft_outside_engine_ms_p50": p50(outside) if outside else None,
        "ttft_outside_engine_ms_p99": round(percentile(outside, 99), 2) if outside else None,
    }


async def run_stack_level(base: str, key: str, texts: list[str], clients: int, rounds: int, max_tokens: int):
    import httpx

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one_client(i):
            return [{**await stream_once(client, base, key, texts[(i * rounds + r) % len(texts)], max_tokens),
                     "round": r} for r in range(rounds)]

        started = time.perf_counter()
        results = await asyncio.gather(*(one_client(i) for i in range(clients)))
        return [s for per in results for s in per], time.perf_counter() - started


def measure_admission(stack: Stack, base: str, key: str, texts: list[str], requests: int) -> dict:
    """CPU per request of each part of the stack, from one-token streamed requests, 32 at a time:
    what admitting, dispatching and answering a request costs, tokens aside."""
    async def burst():
        import httpx

        gate = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=36)) as client:
            async def one(i):
                async with gate:
                    await stream_once(client, base, key, texts[i % len(texts)], 1)

            await asyncio.gather(*(one(i) for i in range(requests)))

    before, started = stack.cpu_seconds(), time.perf_counter()
    asyncio.run(burst())
    wall, after = time.perf_counter() - started, stack.cpu_seconds()
    return {"requests": requests, "concurrency": 32, "wall_s": round(wall, 2),
            "cpu_ms_per_request": cpu_ms_per(before, after, requests)}


# ----------------------------------------------------------------------------- the engine alone

def run_engine_level(engine, texts: list[str], clients: int, rounds: int, max_tokens: int):
    from workers.engine import SamplingParams

    samples, lock = [], threading.Lock()

    def one_client(i):
        for r in range(rounds):
            started = time.perf_counter()
            stamps, tokens = [], 0
            handle = engine.submit(texts[(i * rounds + r) % len(texts)], SamplingParams(temperature=0, max_tokens=max_tokens))
            for out in handle:
                if out.text:
                    stamps.append(time.perf_counter())
                tokens = out.completion_tokens
            with lock:
                samples.append({"ttft": stamps[0] - started, "first": stamps[0], "end": stamps[-1],
                                "tokens": tokens, "gaps": [b - a for a, b in zip(stamps, stamps[1:])]})

    threads = [threading.Thread(target=one_client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples, time.perf_counter() - started


def measure_engine_admission(engine, texts: list[str], requests: int) -> float:
    """The engine's own CPU per one-token request, 32 at a time (the stack's ``worker`` figure
    holds it plus what the worker adds)."""
    from concurrent.futures import ThreadPoolExecutor

    from workers.engine import SamplingParams

    def one(i):
        for _ in engine.submit(texts[i % len(texts)], SamplingParams(temperature=0, max_tokens=1)):
            pass

    before = time.process_time()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(one, range(requests)))
    return round((time.process_time() - before) * 1000 / requests, 3)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return
    levels = [row["concurrency"] for row in result["levels"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for side, label in (("stack", "full stack"), ("engine", "engine direct")):
        left.plot(levels, [row[side]["output_tokens_per_s"] for row in result["levels"]], marker="o", label=label)
        right.plot(levels, [row[side]["ttft_ms_p50"] for row in result["levels"]], marker="o", label=label)
    left.set(xlabel="concurrent streaming clients", ylabel="output tokens/s", title="Throughput", xscale="log")
    right.set(xlabel="concurrent streaming clients", ylabel="p50 TTFT (ms)", title="Time to first token", xscale="log")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Serving {DEPLOYMENT} on {result['machine']['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    texts = prompts(max(levels) * args.rounds, args.prompt_words)
    print(f"starting the full stack on port {args.port} ...", flush=True)
    stack = Stack(args.port, args.web_workers)
    rows = []
    try:
        key = stack.wait_ready()
        deployment = stack.deployment_settings()
        base = f"http://127.0.0.1:{args.port}"
        asyncio.run(run_stack_level(base, key, texts, 1, 1, 4))  # warm-up
        for clients in levels:
            before, client_before = stack.cpu_seconds(), time.process_time()
            samples, wall = asyncio.run(run_stack_level(base, key, texts, clients, args.rounds, args.max_tokens))
            summary = summarize(samples, wall)
            cpu = cpu_ms_per(before, stack.cpu_seconds(), summary["output_tokens"])
            cpu["bench_client"] = round((time.process_time() - client_before) * 1000 / summary["output_tokens"], 3)
            engine_ttft = stack.engine_ttft_ms([s["id"] for s in samples])
            rows.append({"concurrency": clients, "stack": summary,
                         "platform": {**platform_share(samples, engine_ttft), "cpu_ms_per_output_token": cpu}})
            print(f"  stack  {clients:>3} clients: {rows[-1]['stack']['output_tokens_per_s']:8.1f} tok/s, "
                  f"p50 TTFT {rows[-1]['stack']['ttft_ms_p50']} ms; {rows[-1]['platform']}", flush=True)
        admission = None
        if args.admission_requests:
            admission = measure_admission(stack, base, key, texts, args.admission_requests)
            print(f"  admission: {admission}", flush=True)
    finally:
        stack.stop()

    import torch

    from engine import machine_info  # bench/engine.py
    from workers.engine import Engine, bundled_model_path

    dtype = None if deployment["dtype"] in ("", "auto") else deployment["dtype"]
    engine = Engine(bundled_model_path(), dtype=dtype, max_batch_size=deployment["max_batch_size"],
                    batch_window_ms=deployment["batch_window_ms"]).start()
    try:
        run_engine_level(engine, texts, 1, 1, 4)  # warm-up
        for row in rows:
            cpu_before = time.process_time()
            samples, wall = run_engine_level(engine, texts, row["concurrency"], args.rounds, args.max_tokens)
            row["engine"] = summarize(samples, wall)
            row["engine"]["cpu_ms_per_output_token"] = round(
                (time.process_time() - cpu_before) * 1000 / row["engine"]["output_tokens"], 3)
            row["throughput_ratio"] = round(row["stack"]["output_tokens_per_s"] / row["engine"]["output_tokens_per_s"], 3)
            row["added_ttft_p50_ms"] = round(row["stack"]["ttft_ms_p50"] - row["engine"]["ttft_ms_p50"], 2)
            print(f"  engine {row['concurrency']:>3} clients: {row['engine']['output_tokens_per_s']:8.1f} tok/s, "
                  f"p50 TTFT {row['engine']['ttft_ms_p50']} ms -> stack keeps {row['throughput_ratio']:.0%}, "
                  f"adds {row['added_ttft_p50_ms']} ms TTFT", flush=True)
        if admission:
            admission["engine_direct_cpu_ms_per_request"] = measure_engine_admission(
                engine, texts, args.admission_requests)
            print(f"  engine direct, one-token requests: {admission['engine_direct_cpu_ms_per_request']} ms CPU each",
                  flush=True)
        engine_dtype = str(engine.dtype).removeprefix("torch.")
    finally:
        engine.stop()

    at32 = next((r for r in rows if r["concurrency"] == 32), None)
    result = {
        "benchmark": "serving",
        "machine": machine_info(torch),
        "deployment": {**deployment, "engine_dtype": engine_dtype},
        "web_workers": args.web_workers,
        "workload": {"rounds": args.rounds, "max_tokens": args.max_tokens, "prompt_words": args.prompt_words},
        "levels": rows,
        "admission": admission,
        "targets": {"throughput_ratio_at_32": 0.8, "added_ttft_p50_ms_at_32": 15},
        "at_32": at32 and {"throughput_ratio": at32["throughput_ratio"], "added_ttft_p50_ms": at32["added_ttft_p50_ms"],
                           "ttft_outside_engine_ms_p50": at32["platform"]["ttft_outside_engine_ms_p50"]},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    plot(result, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
