"""Liveness and readiness probes.

``/healthz`` says the process serves requests. ``/readyz`` checks what a request needs: the
database, Redis, and at least one Celery worker answering a ping; 503 names the part that is down.
It also says which inference workers send the fleet's heartbeats, without failing on none: the web
server is ready either way (a fleet being replaced is no reason to pull it from its balancer), and
its requests then get a 503 that says so.
"""

from __future__ import annotations

from django.conf import settings
from django.db import connection
from django.http import JsonResponse
from django.views.decorators.http import require_safe

from .readiness import check_database, check_inference_workers, check_redis, check_workers


@require_safe  # GET and HEAD: load balancers probe with either
def healthz(request):
    return JsonResponse({"status": "ok"})


@require_safe  # GET and HEAD: load balancers probe with either
def readyz(request):
    checks = {
        "database": check_database(connection),
        "redis": check_redis(settings.REDIS_URL),
    }
    if checks["redis"]["ok"]:
        checks["worker"] = check_workers(settings.CELERY_BROKER_URL, timeout=settings.READYZ_WORKER_TIMEOUT)
    else:
        checks["worker"] = {"ok": False, "error": "not checked: Redis is down"}
    down = [name for name, result in checks.items() if not result["ok"]]
    body = {"status": "ok" if not down else "unavailable", "down": down, "checks": checks,
            "inference": check_inference_workers()}
    return JsonResponse(body, status=200 if not down else 503)
