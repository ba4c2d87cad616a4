from django.contrib import admin

from .models import CatalogModel, Deployment


class DeploymentInline(admin.TabularInline):
    model = Deployment
    extra = 0
    fields = ["name", "organization", "kind", "is_public", "status"]
    readonly_fields = fields
    show_change_link = True
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(CatalogModel)
class CatalogModelAdmin(admin.ModelAdmin):
    list_display = ["slug", "display_name", "architecture", "parameter_count", "quantization", "context_length",
                    "price_input_per_mtok", "price_output_per_mtok", "price_per_request", "is_active"]
    list_filter = ["is_active", "architecture", "quantization"]
    search_fields = ["slug", "display_name", "description"]
    # The slug is the model's name in every usage record and in billing events still queued: renaming
    # it would split its history (and refuse those events). Import the weights again under a new one.
    readonly_fields = ["slug", "architecture", "parameter_count", "quantization", "context_length", "weights_path",
                       "created_at"]
    fieldsets = (
        (None, {"fields": ("slug", "display_name", "description", "license", "is_active")}),
        ("Weights (read from the file; add models with `inference-platform import-model PATH`)",
         {"fields": ("weights_path", "architecture", "parameter_count", "quantization", "context_length")}),
        ("Prices (USD)", {"fields": ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok",
                                     "price_per_request", "price_per_replica_hour")}),
        ("Dates", {"fields": ("created_at",)}),
    )
    inlines = [DeploymentInline]

    def has_add_permission(self, request):
        return False  # rows come from import_model, which reads the weights' metadata


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ["name", "model", "organization", "kind", "is_public", "status", "batch_window_ms",
                    "max_batch_size", "min_replicas", "max_replicas", "updated_at"]
    list_filter = ["kind", "status", "is_public", "dtype"]
    search_fields = ["name", "model__slug", "organization__name"]
    autocomplete_fields = ["organization"]
    readonly_fields = ["created_by", "created_at", "updated_at"]
