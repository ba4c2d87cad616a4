from django.contrib import admin

from .models import FleetEvent, Replica, Worker


class ReplicaInline(admin.TabularInline):
    model = Replica
    extra = 0
    fields = ["deployment_name", "status", "trigger", "load_seconds", "in_flight", "last_active_at"]
    readonly_fields = fields
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    """Read-only: workers write their own rows through heartbeats."""

    list_display = ["hostname", "status", "device", "slots", "last_heartbeat", "started_at"]
    list_filter = ["status", "device_kind"]
    search_fields = ["hostname", "device_name"]
    readonly_fields = [f.name for f in Worker._meta.fields]
    inlines = [ReplicaInline]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(FleetEvent)
class FleetEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "kind", "deployment_name", "worker", "status", "cold_start", "seconds", "message"]
    list_filter = ["kind", "cold_start"]
    search_fields = ["deployment_name", "worker", "message"]
    readonly_fields = [f.name for f in FleetEvent._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
