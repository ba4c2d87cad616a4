"""The model catalog (weights, metadata, prices) and deployments (endpoints serving a model).

A deployment's ``name`` is what clients pass as ``model`` and names its Celery queue. Deployments
without an organization are the operator's; public ones can be called by every organization.
"""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.db.models import F, Q

# Lowercase letters, digits, '.', '_' and '-', starting with a letter or digit (e.g. "llama-3.1-8b").
DEPLOYMENT_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,99}$"
BUNDLED_PREFIX = "bundled:"

# Prices: USD with 6 decimal places ($0.000001 per million tokens at the finest).
PRICE_FIELD = {"max_digits": 16, "decimal_places": 6}


class CatalogModel(models.Model):
    """A model the operator offers: where its weights are, what it is, and what it costs."""

    slug = models.SlugField(max_length=100, unique=True)
    display_name = models.CharField(max_length=200)
    architecture = models.CharField(max_length=64, help_text='e.g. "llama", "qwen2"')
    parameter_count = models.BigIntegerField(default=0, validators=[MinValueValidator(0)])
    context_length = models.PositiveIntegerField(default=0, help_text="tokens")
    quantization = models.CharField(max_length=32, blank=True, help_text='e.g. "Q4_1", "BF16"')
    weights_path = models.TextField(
        help_text=f'a path relative to MODELS_ROOT, or "{BUNDLED_PREFIX}<name>" for a model shipped with the platform'
    )
    license = models.CharField(max_length=100, blank=True)
    description = models.TextField(blank=True)
    price_input_per_mtok = models.DecimalField(**PRICE_FIELD, default=0, help_text="USD per million input tokens")
    price_cached_input_per_mtok = models.DecimalField(
        **PRICE_FIELD, default=0, help_text="USD per million input tokens served from the prefix cache"
    )
    price_output_per_mtok = models.DecimalField(**PRICE_FIELD, default=0, help_text="USD per million output tokens")
    price_per_request = models.DecimalField(**PRICE_FIELD, default=0, help_text="USD per request")
    price_per_replica_hour = models.DecimalField(
        **PRICE_FIELD, default=Decimal(0),
        help_text="USD per hour of one replica an organization keeps up (see ``billed_by_the_hour``); 0: free",
    )
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["display_name", "slug"]
        constraints = [
            models.CheckConstraint(condition=Q(parameter_count__gte=0), name="catalog_model_parameter_count_gte_0"),
            models.CheckConstraint(
                condition=Q(price_input_per_mtok__gte=0) & Q(price_cached_input_per_mtok__gte=0)
                & Q(price_output_per_mtok__gte=0) & Q(price_per_request__gte=0),
                name="catalog_model_prices_not_negative",
            ),
            models.CheckConstraint(condition=Q(price_per_replica_hour__gte=0),
                                   name="catalog_model_replica_hour_price_not_negative"),
            models.CheckConstraint(condition=~Q(weights_path=""), name="catalog_model_weights_path_not_empty"),
        ]

    def __str__(self) -> str:
        return self.display_name or self.slug

    @property
    def is_bundled(self) -> bool:
        return self.weights_path.startswith(BUNDLED_PREFIX)


def billed_by_the_hour(*, kind: str, organization_id: int | None, price_per_replica_hour) -> bool:
    """Whether a deployment is an hourly-billed dedicated endpoint: an organization's dedicated
    deployment of a model with a replica-hour price. Each of its ready replicas is billed by the
    hour and its requests are not billed per token (that would charge twice for one GPU). The
    replicas other deployments reserve (``min_replicas``) are billed by the hour on top of their
    tokens; the operator's own deployments are billed by the token only."""
    return kind == Deployment.Kind.DEDICATED and organization_id is not None and price_per_replica_hour > 0


class Deployment(models.Model):
    """An endpoint serving a catalog model with its batching and scaling settings."""

    class Kind(models.TextChoices):
        SERVERLESS = "serverless", "Serverless"
        DEDICATED = "dedicated", "Dedicated"

    class Dtype(models.TextChoices):
        AUTO = "auto", "auto"
        FLOAT32 = "float32", "float32"
        BFLOAT16 = "bfloat16", "bfloat16"
        FLOAT16 = "float16", "float16"

    class Quantization(models.TextChoices):
        NONE = "none", "none (weights in the compute dtype)"
        FP8 = "fp8", "FP8, per-channel scales (Hopper and newer GPUs)"
        FP8_PER_TENSOR = "fp8-per-tensor", "FP8, one scale per tensor (Hopper and newer GPUs)"

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        LOADING = "loading", "Loading"
        READY = "ready", "Ready"
        SCALED_TO_ZERO = "scaled_to_zero", "Scaled to zero"
        FAILED = "failed", "Failed"
        STOPPED = "stopped", "Stopped"

    organization = models.ForeignKey(
        "accounts.Organization", null=True, blank=True, on_delete=models.CASCADE, related_name="deployments",
        help_text="empty: the operator's (shared serverless) deployment",
    )
    model = models.ForeignKey(CatalogModel, on_delete=models.PROTECT, related_name="deployments")
    name = models.CharField(
        max_length=100, unique=True,
        validators=[RegexValidator(DEPLOYMENT_NAME_PATTERN, "lowercase letters, digits, '.', '_' and '-'")],
        help_text="what clients pass as `model`",
    )
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.SERVERLESS)
    is_public = models.BooleanField(default=False, help_text="callable by every organization")
    batch_window_ms = models.PositiveIntegerField(default=20, help_text="how long an idle engine waits for more requests")
    max_batch_size = models.PositiveIntegerField(default=32)
    queue_limit = models.PositiveIntegerField(default=256, help_text="requests waiting at most; more get 429")
    min_replicas = models.PositiveIntegerField(default=0)
    max_replicas = models.PositiveIntegerField(default=1)
    scale_to_zero_seconds = models.PositiveIntegerField(
        default=300, help_text="idle seconds before a serverless deployment scales to zero; 0 = never"
    )
    dtype = models.CharField(max_length=16, choices=Dtype.choices, default=Dtype.AUTO)
    quantization = models.CharField(
        max_length=16, choices=Quantization.choices, default=Quantization.NONE,
        help_text="weights stored in FP8 (half the memory of bfloat16, faster decode), computed in the dtype",
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    status_reason = models.TextField(blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(condition=Q(batch_window_ms__gte=0), name="deployment_batch_window_gte_0"),
            models.CheckConstraint(condition=Q(max_batch_size__gte=1), name="deployment_max_batch_size_gte_1"),
            models.CheckConstraint(condition=Q(queue_limit__gte=1), name="deployment_queue_limit_gte_1"),
            models.CheckConstraint(condition=Q(min_replicas__gte=0), name="deployment_min_replicas_gte_0"),
            models.CheckConstraint(condition=Q(max_replicas__gte=1), name="deployment_max_replicas_gte_1"),
            models.CheckConstraint(
                condition=Q(max_replicas__gte=F("min_replicas")), name="deployment_max_replicas_gte_min"
            ),
            models.CheckConstraint(condition=Q(scale_to_zero_seconds__gte=0), name="deployment_scale_to_zero_gte_0"),
            models.CheckConstraint(
                condition=~Q(kind="dedicated") | Q(min_replicas__gte=1), name="deployment_dedicated_min_replicas_gte_1"
            ),
            models.CheckConstraint(
                condition=Q(kind__in=["serverless", "dedicated"]), name="deployment_kind_valid"
            ),
            models.CheckConstraint(
                condition=Q(dtype__in=["auto", "float32", "bfloat16", "float16"]), name="deployment_dtype_valid"
            ),
            models.CheckConstraint(
                condition=Q(quantization__in=["none", "fp8", "fp8-per-tensor"]), name="deployment_quantization_valid"
            ),
            models.CheckConstraint(
                condition=Q(status__in=["pending", "loading", "ready", "scaled_to_zero", "failed", "stopped"]),
                name="deployment_status_valid",
            ),
            models.CheckConstraint(condition=~Q(name=""), name="deployment_name_not_empty"),
        ]
        indexes = [models.Index(fields=["organization", "name"]), models.Index(fields=["is_public"])]

    def __str__(self) -> str:
        return self.name

    @property
    def reserved_replicas(self) -> int:
        """The replicas it can keep up however idle it is: its min_replicas, or, if it never scales
        to zero, every replica it may grow to."""
        return self.max_replicas if self.scale_to_zero_seconds == 0 else self.min_replicas

    @property
    def is_billed_by_the_hour(self) -> bool:
        return billed_by_the_hour(kind=self.kind, organization_id=self.organization_id,
                                  price_per_replica_hour=self.model.price_per_replica_hour)

    @property
    def bills_replica_hours(self) -> bool:
        """Whether some of its replicas are billed by the hour when up."""
        return self.replicas_billed_hourly(self.max_replicas) > 0

    def replicas_billed_hourly(self, ready: int) -> int:
        """How many of its ``ready`` replicas are billed by the hour: an hourly-billed dedicated
        endpoint's up to its max_replicas (a busy one above a lowered maximum is released once
        idle), else those it reserves; none of the operator's deployments, nor of a model without
        a replica-hour price."""
        if self.organization_id is None or self.model.price_per_replica_hour <= 0:
            return 0
        return min(ready, self.max_replicas if self.is_billed_by_the_hour else self.reserved_replicas)

    @property
    def queue_name(self) -> str:
        from inference_platform.celery import deployment_queue

        return deployment_queue(self.name)
