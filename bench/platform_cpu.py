"""CPU per request of the platform's own work, the engine aside: the gateway's admission of a
request (its key, its deployment, the quota, the queue depth and rate limits in one script, the
publish on the deployment's queue), billing's recording of its usage event, the quota check
against an organization with a long history, and the rate-limit script against a busy minute.

Each step runs here, in one thread, against the embedded defaults (SQLite and a private Redis in a
temporary folder, migrated and seeded as `inference-platform up` does, but no worker), and is timed in this thread's CPU time: the
figures hold on a machine whose cores an engine keeps busy, where the serving benchmark's cannot
tell the platform's cost from the noise. Baselines from the same run: the reads and the whole
admission also run with the read cache off (every read from the database, as before it), and
recording with the database connection closed after each event (as Celery did around every
task); the quota check (running totals) also against summing the ledger's rows, as it did
before the totals existed, with ``--history-rows`` usage records and ledger entries on file. The
ratios say what each saves. The rate-limit script's time is Redis's (wall time, one round trip
included), with ``--window-requests`` finished requests in the last minute against none.

    python bench/platform_cpu.py
    python bench/platform_cpu.py --requests 100
    python bench/platform_cpu.py --database-url postgres://postgres@127.0.0.1/platform_bench

Writes bench/results/platform-cpu.json (platform-cpu-postgresql.json on PostgreSQL, the database
production runs on). Not part of the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))
RESULTS = REPO_ROOT / "bench" / "results"
UNSERVED = "bench-unserved"  # the deployment requests are admitted to


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="times each step runs (300)")
    parser.add_argument("--history-rows", type=int, default=100_000,
                        help="usage records and ledger entries on file for the quota check (100000; 0: skip)")
    parser.add_argument("--window-requests", type=int, default=10_000,
                        help="finished requests in the rate-limit windows for the busy case (10000; 0: skip)")
    parser.add_argument("--database-url", default="",
                        help="an empty PostgreSQL database to measure on (migrated and seeded here) instead of "
                             "the embedded SQLite file, e.g. postgres://postgres@127.0.0.1/platform_bench")
    parser.add_argument("--out", default=None,
                        help="where the JSON goes (bench/results/platform-cpu.json, or platform-cpu-postgresql.json "
                             "with --database-url)")
    return parser.parse_args(argv)


def ms_per_call(step, count: int, clock=time.thread_time) -> float:
    """Milliseconds of ``clock`` (this thread's CPU time unless told) per call of ``step``, after
    one call to warm it."""
    step()
    started = clock()
    for _ in range(count):
        step()
    return round((clock() - started) * 1000 / count, 3)


def cpu_ms(step, count: int) -> float:
    return ms_per_call(step, count)


def wall_ms(step, count: int) -> float:
    return ms_per_call(step, count, time.perf_counter)


def measure_history(count: int, rows: int) -> dict:
    """The quota check with ``rows`` usage records and ledger entries on file (inserted directly:
    the totals are what they are), against summing the ledger as the check used to (all it summed
    without spend limits; with them it summed the month's and the key's usage records too)."""
    from datetime import datetime, timezone
    from decimal import Decimal

    from accounts.models import ApiKey
    from django.db.models import Sum

    from billing.models import LedgerEntry, UsageRecord
    from gateway import calls

    api_key = ApiKey.objects.select_related("organization").first()
    organization, now, chunk = api_key.organization, datetime.now(timezone.utc), 5000
    print(f"writing {rows} usage records and ledger entries ...", flush=True)
    for start in range(0, rows, chunk):
        ids = [f"history-{i}" for i in range(start, min(rows, start + chunk))]
        LedgerEntry.objects.bulk_create(LedgerEntry(organization=organization, kind="usage", amount=Decimal("-0.000001"),
                                                    reference=i) for i in ids)
        UsageRecord.objects.bulk_create(UsageRecord(
            request_id=i, organization=organization, api_key=api_key, model="history", prompt_tokens=10,
            completion_tokens=5, status="completed", cost=Decimal("0.000001"), created_at=now,
            price_input_per_mtok=0, price_cached_input_per_mtok=0, price_output_per_mtok=0, price_per_request=0,
        ) for i in ids)
    caller = calls.Caller(api_key=api_key, organization=organization)
    steps = {"running_totals": (lambda: calls._check_quota(caller), count),
             "summing_the_ledger": (lambda: LedgerEntry.objects.filter(organization=organization).aggregate(
                 Sum("amount")), max(3, count // 20))}
    cpu = {name: cpu_ms(step, times) for name, (step, times) in steps.items()}
    # On PostgreSQL the sum runs in the server's process, which this thread's CPU time does not see.
    wall = {name: wall_ms(step, times) for name, (step, times) in steps.items()}
    return {"history_rows": rows, "quota_cpu_ms_per_request": cpu, "quota_wall_ms_per_request": wall,
            "running_totals_speedup": round(cpu["summing_the_ledger"] / cpu["running_totals"], 1),
            "running_totals_speedup_wall": round(wall["summing_the_ledger"] / wall["running_totals"], 1)}


def measure_busy_window(count: int, requests: int) -> dict:
    """The admission script's wall time with no request in the last minute, then with ``requests``
    whose tokens were recorded (a key and an organization at ``requests`` a minute)."""
    import asyncio

    from gateway import ratelimit

    ids = {"key_id": f"bench-{uuid.uuid4().hex}", "org_id": f"bench-{uuid.uuid4().hex}"}

    def wall_ms():
        ratelimit.admit(**ids, request_id=uuid.uuid4().hex)
        started = time.perf_counter()
        for _ in range(count):
            ratelimit.admit(**ids, request_id=uuid.uuid4().hex)
        return round((time.perf_counter() - started) * 1000 / count, 3)

    empty = wall_ms()

    async def fill():
        for i in range(requests):
            await ratelimit.record_tokens(**ids, request_id=f"bench-{i}", tokens=100)

    print(f"recording {requests} requests' tokens in the rate-limit windows ...", flush=True)
    asyncio.run(fill())
    busy = wall_ms()
    return {"requests_in_window": requests, "admission_script_wall_ms": {"empty_window": empty, "busy_window": busy},
            "busy_over_empty": round(busy / empty, 2)}


def measure(count: int) -> dict:
    from django.db import connection

    from accounts.models import ApiKey
    from billing.services import record_usage
    from gateway import calls
    from gateway.protocol import parse_completion
    from gateway.timing import Stages
    from inference_platform import read_cache
    from models_catalog.models import Deployment
    from workers import dispatch

    api_key = ApiKey.objects.select_related("organization").first()
    header = f"Bearer {(Path(os.environ['DATA_DIR']) / 'api-key.txt').read_text().strip()}"
    bundled = Deployment.objects.get(name="smollm2-135m-instruct")
    Deployment.objects.get_or_create(name=UNSERVED, defaults={"model": bundled.model, "is_public": True,
                                                               "kind": "serverless", "status": "ready",
                                                               "queue_limit": 10**9})
    body = {"model": UNSERVED, "prompt": "Tell me a story about a river and a stone. " * 4, "max_tokens": 16,
            "stream": True}
    caller = calls.authenticate_sync(header)
    spec = calls._deployment_spec(caller, UNSERVED).spec

    def identify():
        return calls.authenticate_sync(header), parse_completion(body)

    def admission():  # the whole trip, as a request makes it
        calls._open(identify, calls.new_request_id("completion"), "bench.reply", Stages())

    def usage_event():
        return {"request_id": f"bench-{uuid.uuid4().hex}", "organization_id": api_key.organization_id,
                "api_key_id": api_key.pk, "deployment_id": bundled.pk, "model": bundled.model.slug,
                "deployment": bundled.name, "prompt_tokens": 40, "cached_prompt_tokens": 0,
                "completion_tokens": 16, "status": "completed", "queue_ms": 2, "ttft_ms": 30, "latency_ms": 200,
                "finished_at": "2026-01-01T00:00:00+00:00"}

    def record_then_close():
        record_usage(event=usage_event())
        connection.close()

    steps = {
        "auth": lambda: calls.authenticate_sync(header),
        "deployment": lambda: calls._deployment_spec(caller, UNSERVED),
        "quota": lambda: calls._check_quota(caller),
        "queue_and_rate_limits": lambda: calls._admit(caller, spec, 10**9, uuid.uuid4().hex),
        "publish": lambda: dispatch.enqueue({"deployment": spec, "request_id": uuid.uuid4().hex, "prompt": body["prompt"]}),
        "admission": admission,
    }
    cached = {name: cpu_ms(step, count) for name, step in steps.items()}
    with mock.patch.object(read_cache, "generation", lambda: None):  # every read from the database
        uncached = {name: cpu_ms(steps[name], count) for name in ("auth", "deployment", "admission")}
    recording = {"kept_connection": cpu_ms(lambda: record_usage(event=usage_event()), count),
                 "new_connection_each": cpu_ms(record_then_close, count)}
    return {
        "gateway_cpu_ms_per_request": cached,
        "gateway_cpu_ms_per_request_cache_off": uncached,
        "read_cache_speedup": {name: round(uncached[name] / cached[name], 2) for name in uncached},
        "billing_cpu_ms_per_usage_event": recording,
        "kept_connection_speedup": round(recording["new_connection_each"] / recording["kept_connection"], 2),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch  # for the machine's description only

    from engine import machine_info  # bench/engine.py

    data_dir = tempfile.mkdtemp(prefix="ip-platform-cpu-")
    os.environ.update(DATA_DIR=data_dir, DJANGO_SETTINGS_MODULE="inference_platform.settings",
                      RATE_LIMIT_KEY_RPM="1000000000", RATE_LIMIT_ORG_RPM="1000000000")
    for name in ("DATABASE_URL", "REDIS_URL"):  # the embedded defaults, in the temporary folder
        os.environ.pop(name, None)
    if args.database_url:
        os.environ["DATABASE_URL"] = args.database_url
    from django.core.management import call_command

    from inference_platform import cli
    from inference_platform.processes import stop_all

    settings, procs = cli.setup_django(), []
    try:
        cli.ensure_redis(settings, procs)  # no worker runs: what is published stays queued
        call_command("migrate", interactive=False, verbosity=0)
        cli.seed(settings)
        cli.ensure_api_key(settings)
        print(f"timing each step {args.requests} times ...", flush=True)
        figures = measure(args.requests)
        if args.history_rows:
            figures["quota_with_history"] = measure_history(args.requests, args.history_rows)
        if args.window_requests:
            figures["rate_limits_with_busy_window"] = measure_busy_window(args.requests, args.window_requests)
    finally:
        stop_all(procs)
    result = {
        "benchmark": "platform_cpu",
        "machine": machine_info(torch),
        "database": "postgresql" if args.database_url else "sqlite",
        "requests": args.requests,
        **figures,
    }
    print(json.dumps(result, indent=2))
    out = Path(args.out or RESULTS / ("platform-cpu-postgresql.json" if args.database_url else "platform-cpu.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
