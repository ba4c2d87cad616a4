"""The fleet's REST API: a deployment's live metrics, and the workers (operators only).

    GET /v1/deployments/{name}/metrics   status, replicas, queue depth, requests/min, tokens/s,
                                         p50/p99 latency, average batch size, cold starts
    GET /v1/fleet/workers                every worker: device, heartbeat, what it hosts (staff)

Same callers, visibility rules and error shape as the deployments API (``models_catalog.api``).
The figures are the last minute's, from the workers' heartbeats (see ``workers.selectors``).
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from models_catalog.api import ApiProblem, ManageAPIView, caller_of, readable_deployment

from . import selectors


class DeploymentMetricsView(ManageAPIView):
    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request, name: str):
        caller = caller_of(request)
        deployment = readable_deployment(caller, name)
        figures = selectors.deployment_figures(deployment=deployment).as_dict()
        if not caller.operator and deployment.organization_id != caller.organization.pk:
            figures.pop("workers", None)  # a public deployment's hosts are the operator's business
        return Response({
            "object": "deployment.metrics",
            "id": deployment.name,
            "status": deployment.status,
            "status_reason": deployment.status_reason,
            "window_seconds": 60,
            **figures,
        })


def _worker_json(worker) -> dict:
    return {
        "object": "fleet.worker",
        "id": worker.hostname,
        "status": worker.status,
        "status_reason": worker.status_reason,
        "device": {"kind": worker.device_kind, "name": worker.device_name, "memory_bytes": worker.device_memory_bytes},
        "slots": worker.slots,
        "started_at": int(worker.started_at.timestamp()),
        "last_heartbeat": int(worker.last_heartbeat.timestamp()),
        "queues": worker.queues,
        "queue_depths": worker.queue_depths,
        "serving": [
            {"deployment": r.deployment_name, "status": r.status, "trigger": r.trigger,
             "load_seconds": r.load_seconds, "in_flight": r.in_flight,
             "last_active_at": int(r.last_active_at.timestamp()) if r.last_active_at else None}
            for r in worker.replicas.all()
        ],
        "engines": {
            name: {k: v for k, v in hosted.items() if k not in ("latencies_ms", "ttft_ms")}
            for name, hosted in (worker.engine_stats or {}).items()
        },
    }


class FleetWorkersView(ManageAPIView):
    @extend_schema(responses={200: OpenApiTypes.OBJECT})
    def get(self, request):
        if not caller_of(request).operator:
            raise ApiProblem(403, "Only an operator can see the fleet's workers.", code="permission_denied")
        include_gone = request.query_params.get("include_gone", "true").lower() not in ("0", "false", "no")
        return Response({"object": "list",
                         "data": [_worker_json(w) for w in selectors.workers(include_gone=include_gone)]})
