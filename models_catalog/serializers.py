"""JSON of the catalog and deployments API. Input is validated by the services (which name the
offending field); these serializers render output and document the request bodies."""

from __future__ import annotations

from rest_framework import serializers

from .models import CatalogModel, Deployment
from .services import INT_SETTINGS

UPDATABLE_FIELDS = (*INT_SETTINGS, "kind", "dtype", "quantization", "is_public")
SCALE_FIELDS = ("min_replicas", "max_replicas")


class CatalogModelSerializer(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()
    id = serializers.CharField(source="slug")
    prices = serializers.SerializerMethodField()
    created_at = serializers.SerializerMethodField()

    class Meta:
        model = CatalogModel
        fields = ["object", "id", "display_name", "architecture", "parameter_count", "context_length",
                  "quantization", "license", "description", "prices", "created_at"]

    def get_object(self, obj) -> str:
        return "catalog.model"

    def get_prices(self, obj) -> dict:
        """USD, as decimal strings: per million input / cached input / output tokens, per request, and
        per hour of a replica an organization reserves (a dedicated deployment's, whose requests are
        then not billed per token; or a deployment's min_replicas)."""
        return {
            "currency": "usd",
            "input_per_mtok": str(obj.price_input_per_mtok),
            "cached_input_per_mtok": str(obj.price_cached_input_per_mtok),
            "output_per_mtok": str(obj.price_output_per_mtok),
            "per_request": str(obj.price_per_request),
            "per_replica_hour": str(obj.price_per_replica_hour),
        }

    def get_created_at(self, obj) -> int:
        return int(obj.created_at.timestamp())


class DeploymentSerializer(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()
    id = serializers.CharField(source="name")
    model = serializers.CharField(source="model.slug")
    public = serializers.BooleanField(source="is_public")
    owned_by = serializers.SerializerMethodField()
    created_at = serializers.SerializerMethodField()
    updated_at = serializers.SerializerMethodField()

    class Meta:
        model = Deployment
        fields = ["object", "id", "name", "model", "kind", "public", "owned_by", "status", "status_reason",
                  "batch_window_ms", "max_batch_size", "queue_limit", "min_replicas", "max_replicas",
                  "scale_to_zero_seconds", "dtype", "quantization", "created_at", "updated_at"]

    def get_object(self, obj) -> str:
        return "deployment"

    def get_owned_by(self, obj) -> str:
        return obj.organization.slug if obj.organization_id else "system"

    def get_created_at(self, obj) -> int:
        return int(obj.created_at.timestamp())

    def get_updated_at(self, obj) -> int:
        return int(obj.updated_at.timestamp())


class DeploymentCreateSerializer(serializers.Serializer):
    """Documents POST /v1/deployments; the service validates (400 naming the field)."""

    name = serializers.CharField(help_text="what clients pass as `model`: lowercase letters, digits, '.', '_', '-'")
    model = serializers.CharField(help_text="a catalog model's id (GET /v1/catalog)")
    kind = serializers.ChoiceField(choices=Deployment.Kind.choices, required=False)
    is_public = serializers.BooleanField(required=False, help_text="operator only: shared with every organization")
    batch_window_ms = serializers.IntegerField(required=False, min_value=0)
    max_batch_size = serializers.IntegerField(required=False, min_value=1)
    queue_limit = serializers.IntegerField(required=False, min_value=1)
    min_replicas = serializers.IntegerField(required=False, min_value=0)
    max_replicas = serializers.IntegerField(required=False, min_value=1)
    scale_to_zero_seconds = serializers.IntegerField(required=False, min_value=0, help_text="0: never")
    dtype = serializers.ChoiceField(choices=Deployment.Dtype.choices, required=False)
    quantization = serializers.ChoiceField(choices=Deployment.Quantization.choices, required=False)


class DeploymentUpdateSerializer(DeploymentCreateSerializer):
    name = None
    model = None


class ScaleSerializer(serializers.Serializer):
    min_replicas = serializers.IntegerField(required=False, min_value=0)
    max_replicas = serializers.IntegerField(required=False, min_value=1)


class DeletedSerializer(serializers.Serializer):
    object = serializers.CharField()
    id = serializers.CharField()
    deleted = serializers.BooleanField()


def deployment(obj: Deployment) -> dict:
    return DeploymentSerializer(obj).data


def catalog_model(obj: CatalogModel) -> dict:
    return CatalogModelSerializer(obj).data
