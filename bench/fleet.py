"""Benchmark the worker fleet: cold start, a dead worker and a burst, on the bundled model.

Starts the real stack as child processes (uvicorn, Celery beat running the placement loop, Celery
fleet workers) against a scratch database and Redis, then measures:

- cold start: a streamed request to a deployment scaled to zero, from the request to its first
  token (and to its last), split into the placement loop's reaction (request to "placed on a
  worker") and the model load the worker reports; against the baseline of the same request to
  the deployment once it is warm, in the same run (``ratio_vs_warm``);
- a dead worker: SIGKILL the worker serving a deployment (min_replicas 1); time until it is marked
  gone, until the deployment is placed on another worker, until that replica is ready, and until
  a request sent right after the kill gets its first token;
- a burst: --burst streamed requests at once to a deployment with one ready replica that may add a
  second (max_replicas 2): the time until all are answered, when the second replica is ready, and
  how many requests each replica served; against the baseline of the same burst to a deployment
  that may not add one (max_replicas 1), in the same run (``speedup_vs_one_replica``). On a CPU
  machine both workers share its cores, so the speedup understates a fleet of GPUs; the share the
  added replica serves is the figure that shows the queue handing work to it.

Heartbeats every --heartbeat seconds, gone after --missed of them, a placement pass every --tick
seconds (the defaults are the test settings; production defaults are 5 s, 3 and 2 s).

Writes bench/results/fleet-<device>.json. Not part of the test suite; it takes minutes.

    DATABASE_URL=postgresql://user@host:5432/scratch REDIS_URL=redis://host:6379/5 python bench/fleet.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
sys.path.insert(0, str(REPO_ROOT))
BUNDLED = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "Write one sentence about the sea."}]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fleet cold start and dead-worker reaction on the bundled model.")
    parser.add_argument("--cold-starts", type=int, default=3, help="cold starts measured (3)")
    parser.add_argument("--kills", type=int, default=2, help="workers killed (2)")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat interval, seconds (1)")
    parser.add_argument("--missed", type=int, default=3, help="missed heartbeats before a worker is gone (3)")
    parser.add_argument("--tick", type=float, default=1.0, help="placement pass interval, seconds (1)")
    parser.add_argument("--max-batch-size", type=int, default=4, help="the deployments' max batch size (4)")
    parser.add_argument("--burst", type=int, default=24, help="requests in the burst (24)")
    parser.add_argument("--burst-tokens", type=int, default=48, help="tokens each burst request generates (48)")
    parser.add_argument("--parts", default="cold,dead,burst", help="what to measure (cold,dead,burst)")
    parser.add_argument("--output", default=None, help="result file (default bench/results/fleet-<device>.json)")
    return parser.parse_args(argv)


def setup_django():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")
    if not os.environ.get("DATABASE_URL") or not os.environ.get("REDIS_URL"):
        sys.exit("set DATABASE_URL (a scratch PostgreSQL database: it is migrated and gets rows) and REDIS_URL")
    import django

    django.setup()


def wait_for(predicate, *, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:g}s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


class Stack:
    def __init__(self, env: dict, logs: Path):
        self.env, self.logs = env, logs
        self.procs: list[subprocess.Popen] = []
        self.workers: dict[str, subprocess.Popen] = {}
        from tests.support import free_port

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"

    def spawn(self, args: list[str], label: str, **env) -> subprocess.Popen:
        with open(self.logs / f"{label}.log", "ab") as log:
            return subprocess.Popen(args, cwd=REPO_ROOT, env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT)

    def start(self) -> None:
        py = sys.executable
        self.procs.append(self.spawn([py, "-m", "uvicorn", "inference_platform.asgi:application", "--port",
                                      str(self.port), "--no-access-log", "--lifespan", "off"], "web"))
        self.procs.append(self.spawn([py, "-m", "celery", "-A", "inference_platform", "beat", "--loglevel", "WARNING",
                                      "--schedule", str(self.logs / "celerybeat-schedule")], "beat"))

    def start_worker(self, label: str) -> str:
        hostname = f"bench-{label}-{uuid.uuid4().hex[:6]}@localhost"
        self.workers[hostname] = self.spawn(
            [sys.executable, "-m", "celery", "-A", "inference_platform", "worker", "--pool", "threads", "--concurrency",
             "16", "--prefetch-multiplier", "1", "--queues", "default,billing", "--hostname", hostname, "--loglevel",
             "WARNING", "--without-gossip", "--without-mingle"], label, WORKER_SLOTS="1")
        return hostname

    def kill(self, hostname: str) -> None:
        proc = self.workers.pop(hostname)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for proc in [*self.workers.values(), *self.procs]:
            if proc.poll() is None:
                proc.terminate()
        for proc in [*self.workers.values(), *self.procs]:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def alive(hostname: str) -> bool:
    from workers.models import Worker

    return Worker.objects.filter(hostname=hostname, status="alive").exists()


def status(name: str) -> str:
    from models_catalog.models import Deployment

    return Deployment.objects.filter(name=name).values_list("status", flat=True).first() or ""


def replicas(name: str) -> list[tuple[str, str]]:
    from workers.models import Replica

    return list(Replica.objects.filter(deployment__name=name).values_list("worker__hostname", "status"))


def stream_timings(client, model: str, *, messages=PROMPT, max_tokens: int = 16) -> tuple[float, float]:
    """(seconds to the first token, seconds to the end) of one streamed request."""
    started = time.monotonic()
    first = None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True)
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - started
    return first, time.monotonic() - started


def median(values):
    return round(statistics.median(values), 3) if values else None


def finished_per_worker(name: str) -> dict[str, int]:
    """Requests each live worker's engine for the deployment has finished (asked over remote control)."""
    from inference_platform.celery import app

    replies = app.control.broadcast("engine_stats", reply=True, timeout=3)
    return {worker: reply.get("engines", {}).get(name, {}).get("requests_finished", 0)
            for answer in replies for worker, reply in answer.items()}


def run_burst(client, name: str, *, requests: int, max_tokens: int) -> dict:
    """Send ``requests`` streamed requests at once; when each first token came, when all ended, and
    when the deployment had two ready replicas (None: it never did)."""
    started = time.monotonic()
    firsts: list[float] = []
    errors: list[str] = []
    second_ready: list[float] = []
    done = threading.Event()

    def one(i: int) -> None:
        messages = [{"role": "user", "content": f"Write a long story about lighthouse number {i}."}]
        try:
            firsts.append(stream_timings(client, name, messages=messages, max_tokens=max_tokens)[0])
        except Exception as exc:  # counted and reported: a burst must not lose requests
            errors.append(f"{type(exc).__name__}: {exc}")

    def watch() -> None:
        while not done.wait(0.2):
            if sum(1 for _, state in replicas(name) if state == "ready") >= 2:
                second_ready.append(time.monotonic() - started)
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    clients = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    wall = time.monotonic() - started
    done.set()
    watcher.join()
    return {"wall_s": round(wall, 3), "first_token_s_median": median(firsts),
            "first_token_s_max": round(max(firsts), 3) if firsts else None, "errors": errors,
            "second_replica_ready_s": round(second_ready[0], 3) if second_ready else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_django()
    import logging

    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import openai
    from django.core.management import call_command

    from accounts import services as accounts
    from inference_platform import read_cache
    from models_catalog.models import CatalogModel, Deployment
    from tests.conftest import child_env
    from workers.agent import detect_device
    from workers.models import Worker

    call_command("migrate", interactive=False, verbosity=0)
    call_command("seed_catalog", verbosity=0)
    Deployment.objects.filter(name=BUNDLED).update(status="scaled_to_zero", min_replicas=0)
    read_cache.invalidate()  # the gateway caches deployments; a queryset update sends no signal
    Deployment.objects.filter(name__startswith="bench-").delete()
    Worker.objects.all().delete()
    tag = uuid.uuid4().hex[:8]
    user = accounts.create_user(email=f"bench-{tag}@example.com", password=None)
    org = accounts.create_organization(name=f"bench-{tag}", owner=user)
    _, key = accounts.create_api_key(organization=org, name="bench", scopes=["inference", "manage"], created_by=user)
    model = CatalogModel.objects.get(slug=BUNDLED)

    logs = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    # Two workers share this machine: each gets its share of the cores (threads beyond the cores
    # spin against each other; a burst took 6x longer with two workers of all the cores each).
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 2) // 2))
    env = child_env(DATA_DIR=str(logs), OMP_NUM_THREADS=threads, FLEET_HEARTBEAT_SECONDS=str(args.heartbeat),
                    FLEET_MISSED_HEARTBEATS=str(args.missed), FLEET_TICK_SECONDS=str(args.tick),
                    CELERY_VISIBILITY_TIMEOUT="60", CELERY_UNACKED_RESTORE_INTERVAL="1",
                    CELERY_UNACKED_RESTORE_THROTTLE="1", FLEET_COLD_START_TIMEOUT="300", GATEWAY_QUEUE_TIMEOUT="30",
                    RATE_LIMIT_KEY_RPM="100000", RATE_LIMIT_ORG_RPM="100000", LOG_LEVEL="WARNING")
    stack = Stack(env, logs)
    stack.start()
    results: dict = {}
    parts = set(args.parts.split(","))
    try:
        first_workers = [stack.start_worker("a"), stack.start_worker("b")]
        for hostname in first_workers:
            wait_for(lambda h=hostname: alive(h), timeout=120, what=f"{hostname} to register", interval=0.2)
        client = openai.OpenAI(base_url=f"{stack.base}/v1", api_key=key, max_retries=0, timeout=600)

        if "cold" in parts:
            results["cold_start"] = measure_cold_starts(client, org, model, tag, args)
        if "burst" in parts:
            results["burst"] = measure_burst(client, org, model, tag, args)
        if "dead" in parts:
            results["dead_worker"] = measure_dead_workers(client, org, model, tag, args, stack)
    finally:
        stack.stop()

    kind, name, memory = detect_device()
    report = {
        "benchmark": "fleet",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "device": {"kind": kind, "name": name, "memory_bytes": memory, "cpus": os.cpu_count(),
                   "load_average": os.getloadavg(), "machine": platform.machine()},
        "model": BUNDLED,
        "settings": {"heartbeat_s": args.heartbeat, "missed_heartbeats": args.missed, "tick_s": args.tick,
                     "max_batch_size": args.max_batch_size, "burst": args.burst, "burst_tokens": args.burst_tokens,
                     "worker_threads": int(threads)},
        **results,
    }
    out = Path(args.output) if args.output else RESULTS_DIR / f"fleet-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


def measure_cold_starts(client, org, model, tag: str, args) -> dict:
    from models_catalog.services import create_deployment
    from workers.models import FleetEvent, Worker

    cold = create_deployment(organization=org, model=model, name=f"bench-cold-{tag}", scale_to_zero_seconds=2,
                             max_batch_size=args.max_batch_size)
    wait_for(lambda: status(cold.name) == "ready", timeout=300, what="the first load", interval=0.2)
    stream_timings(client, cold.name)  # the first request warms caches
    warm = [stream_timings(client, cold.name) for _ in range(3)]
    colds = []
    for i in range(args.cold_starts):
        wait_for(lambda: status(cold.name) == "scaled_to_zero" and not any(
            cold.name in (w.engine_stats or {}) for w in Worker.objects.filter(status="alive")),
            timeout=120, what="scale to zero", interval=0.2)
        asked = datetime.now(timezone.utc)
        first, total = stream_timings(client, cold.name)
        placed = FleetEvent.objects.filter(deployment=cold, kind="placed", created_at__gte=asked).order_by("id").first()
        ready = FleetEvent.objects.filter(deployment=cold, kind="ready", created_at__gte=asked).order_by("id").first()
        colds.append({
            "first_token_s": round(first, 3), "total_s": round(total, 3),
            "placed_after_s": round((placed.created_at - asked).total_seconds(), 3) if placed else None,
            "load_s": round(ready.seconds, 3) if ready and ready.seconds else None,
            "cold_start_event": bool(ready and ready.cold_start),
        })
        print(f"cold start {i + 1}: first token {first:.2f}s (placed after "
              f"{colds[-1]['placed_after_s']}s, load {colds[-1]['load_s']}s)", flush=True)
    cold.delete()
    warm_first = median([w[0] for w in warm])
    return {
        "runs": colds,
        "first_token_s_median": median([c["first_token_s"] for c in colds]),
        "placed_after_s_median": median([c["placed_after_s"] for c in colds if c["placed_after_s"] is not None]),
        "load_s_median": median([c["load_s"] for c in colds if c["load_s"] is not None]),
        "warm_first_token_s_median": warm_first,
        "ratio_vs_warm": round(median([c["first_token_s"] for c in colds]) / warm_first, 1) if warm_first else None,
    }


def measure_burst(client, org, model, tag: str, args) -> dict:
    """The same burst to a deployment held to one replica (the baseline), then to one that may add
    a second."""
    from models_catalog.services import create_deployment

    runs = {}
    for label, most in (("one_replica", 1), ("may_add_one", 2)):
        deployment = create_deployment(organization=org, model=model, name=f"bench-burst{most}-{tag}", min_replicas=1,
                                       max_replicas=most, max_batch_size=args.max_batch_size, scale_to_zero_seconds=0)
        wait_for(lambda: status(deployment.name) == "ready", timeout=300, what=f"{deployment.name} to load",
                 interval=0.2)
        stream_timings(client, deployment.name)  # warm
        run = run_burst(client, deployment.name, requests=args.burst, max_tokens=args.burst_tokens)

        seen: list[dict] = [{}]

        def counted(name=deployment.name) -> dict | None:  # +1: the warm-up request
            seen[0] = finished_per_worker(name)
            return seen[0] if sum(seen[0].values()) == args.burst + 1 else None

        counts = wait_for(counted, timeout=30, interval=0.2,
                          what=lambda: f"the engines' figures to count {args.burst + 1} requests (they count {seen[0]}; "
                                       f"errors: {run['errors'][:3]})")
        run["served_per_replica"] = sorted((n for n in counts.values() if n), reverse=True)
        runs[label] = run
        ready = run["second_replica_ready_s"]
        print(f"burst of {args.burst}, {label}: {run['wall_s']:.1f}s, served per replica {run['served_per_replica']}, "
              f"second replica {'ready after %.1fs' % ready if ready is not None else 'never'}", flush=True)
        deployment.delete()
        wait_for(lambda name=deployment.name: not any(finished_per_worker(name).values()), timeout=120,
                 what=f"{deployment.name} to be unloaded", interval=0.5)
    one, two = runs["one_replica"]["wall_s"], runs["may_add_one"]["wall_s"]
    added = runs["may_add_one"]["served_per_replica"][1:]
    return {**runs, "speedup_vs_one_replica": round(one / two, 2) if two else None,
            "added_replica_share": round(sum(added) / (args.burst + 1), 3)}


def measure_dead_workers(client, org, model, tag: str, args, stack) -> dict:
    from models_catalog.services import create_deployment
    from workers.models import Worker

    kills = []
    dead = create_deployment(organization=org, model=model, name=f"bench-dead-{tag}", min_replicas=1,
                             max_batch_size=args.max_batch_size, scale_to_zero_seconds=0)
    for i in range(args.kills):
        [(victim, _)] = wait_for(lambda: [r for r in replicas(dead.name) if r[1] == "ready"], timeout=300,
                                 what="a ready replica", interval=0.2)
        stack.kill(victim)
        killed = time.monotonic()
        request_started = time.monotonic()
        timing = {}
        thread = threading.Thread(target=lambda: timing.update(first=stream_timings(client, dead.name)[0]))
        thread.start()
        wait_for(lambda: Worker.objects.filter(hostname=victim, status="gone").exists(), timeout=120,
                 what="the dead worker to be marked gone")
        gone = time.monotonic() - killed
        wait_for(lambda: any(h != victim for h, _ in replicas(dead.name)), timeout=60, what="a new placement")
        placed = time.monotonic() - killed
        wait_for(lambda: any(h != victim and s == "ready" for h, s in replicas(dead.name)), timeout=300,
                 what="the replacement to be ready", interval=0.1)
        ready = time.monotonic() - killed
        thread.join(timeout=300)
        kills.append({"marked_gone_s": round(gone, 3), "placed_elsewhere_s": round(placed, 3),
                      "ready_elsewhere_s": round(ready, 3),
                      "request_first_token_s": round(timing["first"] + (request_started - killed), 3)
                      if timing.get("first") else None})
        print(f"kill {i + 1}: gone after {gone:.2f}s, placed after {placed:.2f}s, ready after {ready:.2f}s",
              flush=True)
        replacement = stack.start_worker(f"spare{i}")  # keep a spare for the next kill
        wait_for(lambda: alive(replacement), timeout=120, what="the spare worker", interval=0.2)
    dead.delete()
    return {
        "runs": kills,
        "marked_gone_s_median": median([k["marked_gone_s"] for k in kills]),
        "placed_elsewhere_s_median": median([k["placed_elsewhere_s"] for k in kills]),
        "ready_elsewhere_s_median": median([k["ready_elsewhere_s"] for k in kills]),
        "detection_bound_s": args.heartbeat * args.missed,
    }

def _commit() -> str | None:
    """The code measured: the commit, marked dirty when the working tree has changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
