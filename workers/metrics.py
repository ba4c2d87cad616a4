"""``GET /metrics``: the fleet's figures in Prometheus' text format (prometheus-client), with those
of the other collectors ``METRICS_COLLECTORS`` names (billing's).

Per deployment: status, replicas, queue depth, in-flight requests, requests per minute, tokens per
second, latency percentiles, average batch size, cold starts. Per worker: up, seconds since its
heartbeat, slots and replicas, device memory, and its engines' counters and KV cache.

Scrape it with ``Authorization: Bearer $METRICS_TOKEN`` (set METRICS_TOKEN); a logged-in operator
can also open it. Without METRICS_TOKEN only operators can.
"""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpResponse, JsonResponse
from django.utils import timezone
from django.utils.module_loading import import_string
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from models_catalog.models import Deployment

from . import selectors
from .models import Worker

ENGINE_GAUGES = {
    "running": "Requests the engine is generating for",
    "waiting": "Requests admitted by the worker, waiting in the engine",
    "kv_blocks_used": "KV cache blocks in use",
    "kv_blocks_total": "KV cache blocks",
    "batch_size_last": "Sequences in the last engine step",
    "kv_capacity_tokens": "Tokens the engine's KV cache holds",
    "device_memory_free": "Free memory on the engine's GPU, in bytes",
    "cuda_graph_capture_s": "Seconds the engine took to capture its CUDA graphs",
}
# A gauge's name must not end in _total, Prometheus's mark of a counter.
GAUGE_NAMES = {"kv_blocks_total": "kv_blocks_capacity"}
ENGINE_COUNTERS = {
    "steps": "Engine steps",
    "generated_tokens": "Tokens generated",
    "requests_finished": "Requests finished",
    "requests_failed": "Requests failed",
    "preemptions": "Sequences preempted for lack of KV blocks",
    "schedule_seconds": "Seconds the engine loop spent choosing batches",
    "execute_seconds": "Seconds the engine loop spent in model steps (waiting for the device too)",
    "postprocess_seconds": "Seconds the engine loop spent handing out new tokens",
}


class FleetCollector:
    """Reads the database (and the queues in Redis) at scrape time."""

    def collect(self):
        now = timezone.now()
        figures = selectors.all_deployment_figures(now=now)
        labels = ["deployment", "organization", "model"]

        def family(name, doc, cls=GaugeMetricFamily, extra=()):
            return cls(name, doc, labels=[*labels, *extra])

        status = family("inference_deployment_status", "1 for the deployment's current status", extra=["status"])
        replicas = family("inference_deployment_replicas", "Replicas by state", extra=["state"])
        queue = family("inference_deployment_queue_depth", "Requests waiting for a worker or in an engine's queue")
        in_flight = family("inference_deployment_in_flight", "Requests being served")
        rpm = family("inference_deployment_requests_per_minute", "Requests finished over the last minute")
        tps = family("inference_deployment_output_tokens_per_second", "Output tokens per second over the last minute")
        latency = family("inference_deployment_latency_ms", "Request latency over the last minute", extra=["quantile"])
        batch = family("inference_deployment_average_batch_size", "Sequences per engine step over the last minute")
        colds = family("inference_deployment_cold_starts", "Loads a waiting request asked for", cls=CounterMetricFamily)
        for deployment, f in figures:
            values = [deployment.name, deployment.organization.slug if deployment.organization_id else "system",
                      deployment.model.slug]
            for choice in Deployment.Status.values:
                status.add_metric([*values, choice], 1.0 if deployment.status == choice else 0.0)
            replicas.add_metric([*values, "ready"], f.replicas_ready)
            replicas.add_metric([*values, "loading"], f.replicas_loading)
            if f.queue_depth is not None:  # unknown while Redis is unreachable: no sample, not a false 0
                queue.add_metric(values, f.queue_depth)
            in_flight.add_metric(values, f.in_flight)
            rpm.add_metric(values, f.requests_per_minute)
            tps.add_metric(values, f.tokens_per_second)
            for quantile, value in (("0.5", f.latency_p50_ms), ("0.99", f.latency_p99_ms)):
                if value is not None:
                    latency.add_metric([*values, quantile], value)
            if f.average_batch_size is not None:
                batch.add_metric(values, f.average_batch_size)
            colds.add_metric(values, f.cold_starts_total)
        yield from (status, replicas, queue, in_flight, rpm, tps, latency, batch, colds)

        wl = ["worker", "device"]
        up = GaugeMetricFamily("inference_worker_up", "1 while the worker sends heartbeats", labels=wl)
        age = GaugeMetricFamily("inference_worker_heartbeat_age_seconds", "Seconds since the last heartbeat", labels=wl)
        slots = GaugeMetricFamily("inference_worker_slots", "Deployments the worker may host", labels=wl)
        hosting = GaugeMetricFamily("inference_worker_replicas", "Deployments the worker hosts", labels=wl)
        memory = GaugeMetricFamily("inference_worker_device_memory_bytes", "GPU memory (RAM for a CPU worker)", labels=wl)
        el = ["worker", "deployment"]
        gauges = {k: GaugeMetricFamily(f"inference_engine_{GAUGE_NAMES.get(k, k)}", doc, labels=el)
                  for k, doc in ENGINE_GAUGES.items()}
        counters = {k: CounterMetricFamily(f"inference_engine_{k}", doc, labels=el) for k, doc in ENGINE_COUNTERS.items()}
        for worker in selectors.workers(include_gone=True):
            values = [worker.hostname, worker.device]
            alive = worker.status == Worker.Status.ALIVE
            up.add_metric(values, 1.0 if alive else 0.0)
            age.add_metric(values, max(0.0, (now - worker.last_heartbeat).total_seconds()))
            slots.add_metric(values, worker.slots)
            hosting.add_metric(values, len(worker.replicas.all()))
            memory.add_metric(values, worker.device_memory_bytes)
            if not alive:
                continue
            for name, hosted in (worker.engine_stats or {}).items():
                engine = hosted.get("engine") or {}
                for key, metric in gauges.items():
                    if isinstance(engine.get(key), (int, float)):
                        metric.add_metric([worker.hostname, name], engine[key])
                for key, metric in counters.items():
                    if isinstance(engine.get(key), (int, float)):
                        metric.add_metric([worker.hostname, name], engine[key])
        yield from (up, age, slots, hosting, memory, *gauges.values(), *counters.values())


def _allowed(request) -> bool:
    token = settings.METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    if token and header.startswith("Bearer ") and hmac.compare_digest(header[7:].strip().encode(), token.encode()):
        return True
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_authenticated and user.is_staff)


def metrics(request):
    if not _allowed(request):
        return JsonResponse({"error": {
            "message": "The metrics need 'Authorization: Bearer <METRICS_TOKEN>' or an operator's login.",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}, status=401)
    registry = CollectorRegistry(auto_describe=False)
    for path in settings.METRICS_COLLECTORS:
        registry.register(import_string(path)())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
