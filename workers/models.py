"""The worker fleet: the Celery worker processes hosting engines, what each serves, and what happened.

A ``Worker`` is one Celery worker process (one per GPU, or a CPU worker), identified by its Celery
node name. It registers when it starts and then sends a heartbeat every few seconds; a worker
whose heartbeats stop is marked gone by the placement loop. A ``Replica`` is one deployment hosted
by one worker (loading, then ready); the placement loop creates and removes them, the worker
reports their progress. ``FleetEvent`` is the append-only history: placements, loads (cold starts
among them), failures, releases, workers gone and deployment status changes.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q


class Worker(models.Model):
    class Status(models.TextChoices):
        ALIVE = "alive", "Alive"
        GONE = "gone", "Gone"

    hostname = models.CharField(max_length=255, unique=True, help_text="the Celery node name, e.g. gpu0@host")
    instance = models.CharField(max_length=32, help_text="this run of the process (changes at every start)")
    pid = models.PositiveIntegerField(default=0)
    device_kind = models.CharField(max_length=16, default="cpu", help_text='"cuda" or "cpu"')
    device_name = models.CharField(max_length=200, default="cpu")
    device_memory_bytes = models.BigIntegerField(default=0, help_text="GPU memory, or the machine's RAM for a CPU worker")
    slots = models.PositiveIntegerField(default=1, help_text="how many deployments it may host at once")
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.ALIVE)
    status_reason = models.TextField(blank=True)
    started_at = models.DateTimeField()
    last_heartbeat = models.DateTimeField()
    queues = models.JSONField(default=list, blank=True, help_text="the Celery queues it consumes")
    queue_depths = models.JSONField(default=dict, blank=True, help_text="messages waiting per deployment queue")
    engine_stats = models.JSONField(
        default=dict, blank=True,
        help_text="per deployment: engine statistics, in-flight requests and the last minute's request figures",
    )

    class Meta:
        ordering = ["hostname"]
        constraints = [
            models.CheckConstraint(condition=Q(status__in=["alive", "gone"]), name="worker_status_valid"),
            models.CheckConstraint(condition=Q(device_memory_bytes__gte=0), name="worker_device_memory_gte_0"),
            models.CheckConstraint(condition=~Q(hostname=""), name="worker_hostname_not_empty"),
        ]
        indexes = [models.Index(fields=["status", "last_heartbeat"])]

    def __str__(self) -> str:
        return self.hostname

    @property
    def device(self) -> str:
        if self.device_kind == "cpu":
            return "cpu"
        return f"{self.device_name} ({self.device_memory_bytes / 2**30:.0f} GiB)"


class Replica(models.Model):
    """One deployment hosted by one worker. ``deployment`` becomes empty when the deployment is
    deleted while the worker still drains its requests; ``deployment_name`` keeps the name."""

    class Status(models.TextChoices):
        LOADING = "loading", "Loading"
        READY = "ready", "Ready"

    class Trigger(models.TextChoices):
        INITIAL = "initial", "first placement of a new deployment"
        MIN_REPLICAS = "min_replicas", "below its minimum replicas"
        DEMAND = "demand", "a request to a scaled-to-zero deployment (cold start)"
        SCALE_UP = "scale_up", "queue depth above the threshold"
        REPLACE = "replace", "its worker was lost, or its settings changed"
        PRELOAD = "preload", "named when the worker started"

    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="replicas")
    deployment = models.ForeignKey(
        "models_catalog.Deployment", null=True, blank=True, on_delete=models.SET_NULL, related_name="replicas"
    )
    deployment_name = models.CharField(max_length=100)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.LOADING)
    trigger = models.CharField(max_length=16, choices=Trigger.choices, default=Trigger.INITIAL)
    spec_hash = models.CharField(max_length=64, blank=True, help_text="the engine settings it was loaded with")
    assigned_at = models.DateTimeField()
    ready_at = models.DateTimeField(null=True, blank=True)
    load_seconds = models.FloatField(null=True, blank=True)
    last_active_at = models.DateTimeField(null=True, blank=True, help_text="last request started or finished")
    in_flight = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["deployment_name", "worker__hostname"]
        constraints = [
            models.UniqueConstraint(fields=["worker", "deployment_name"], name="replica_one_per_worker_and_name"),
            models.CheckConstraint(condition=Q(status__in=["loading", "ready"]), name="replica_status_valid"),
            models.CheckConstraint(condition=Q(status="loading") | Q(ready_at__isnull=False),
                                   name="replica_ready_has_ready_at"),
        ]

    def __str__(self) -> str:
        return f"{self.deployment_name} on {self.worker_id}"


class FleetEvent(models.Model):
    class Kind(models.TextChoices):
        PLACED = "placed", "placed on a worker"
        READY = "ready", "loaded and consuming"
        FAILED = "failed", "failed to load"
        RELEASED = "released", "released by its worker"
        WORKER_GONE = "worker_gone", "worker gone"
        STATUS = "status", "deployment status changed"
        INTERRUPTED = "interrupted", "a request lost with its worker"
        REDELIVERED = "redelivered", "a request handed to another worker"

    kind = models.CharField(max_length=16, choices=Kind.choices)
    deployment = models.ForeignKey(
        "models_catalog.Deployment", null=True, blank=True, on_delete=models.SET_NULL, related_name="fleet_events"
    )
    deployment_name = models.CharField(max_length=100, blank=True)
    worker = models.CharField(max_length=255, blank=True, help_text="the worker's hostname")
    status = models.CharField(max_length=16, blank=True, help_text="the deployment's new status (kind=status)")
    cold_start = models.BooleanField(default=False, help_text="a load that a waiting request asked for")
    seconds = models.FloatField(null=True, blank=True, help_text="how long the load took")
    message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["deployment", "kind", "created_at"])]
        constraints = [
            models.CheckConstraint(
                condition=Q(kind__in=["placed", "ready", "failed", "released", "worker_gone", "status", "interrupted",
                                      "redelivered"]),
                name="fleet_event_kind_valid",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.deployment_name} {self.worker}".strip()


# The receivers that wake the placement loop when a deployment changes (apps.py is shared).
from . import signals  # noqa: E402,F401
