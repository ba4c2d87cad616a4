"""The operator's view of billing. Usage records, ledger entries and Stripe events are read-only:
money moves through services (an adjustment is a new ledger entry, never an edit)."""

from django.contrib import admin

from .models import (ApiKeySpendLimit, BillingAccount, LedgerEntry, RefusedUsageEvent, SpendLimit, StripeEvent, TopUp,
                     UsageRecord)


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = ("request_id", "organization", "model", "deployment_name", "status", "prompt_tokens",
                    "completion_tokens", "cost", "created_at")
    list_filter = ("status", "model")
    search_fields = ("request_id", "organization__name", "deployment_name")
    date_hierarchy = "created_at"
    list_select_related = ("organization",)


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "organization", "kind", "amount", "reference", "description")
    list_filter = ("kind",)
    search_fields = ("reference", "organization__name", "description")
    list_select_related = ("organization",)


@admin.register(RefusedUsageEvent)
class RefusedUsageEventAdmin(ReadOnlyAdmin):
    """Replayed with ``manage.py replay_usage_events`` once the cause is fixed."""

    list_display = ("refused_at", "request_id", "error", "replayed_at")
    search_fields = ("request_id", "error")


@admin.register(StripeEvent)
class StripeEventAdmin(ReadOnlyAdmin):
    list_display = ("event_id", "type", "livemode", "received_at")
    list_filter = ("type",)
    search_fields = ("event_id",)


@admin.register(TopUp)
class TopUpAdmin(ReadOnlyAdmin):
    list_display = ("payment_intent_id", "organization", "amount", "currency", "status", "created_at")
    list_filter = ("status",)
    search_fields = ("payment_intent_id", "organization__name")


@admin.register(BillingAccount)
class BillingAccountAdmin(ReadOnlyAdmin):
    list_display = ("organization", "stripe_customer_id", "created_at")
    search_fields = ("organization__name", "stripe_customer_id")


@admin.register(SpendLimit)
class SpendLimitAdmin(admin.ModelAdmin):
    list_display = ("organization", "monthly_limit", "updated_at")
    raw_id_fields = ("organization",)


@admin.register(ApiKeySpendLimit)
class ApiKeySpendLimitAdmin(admin.ModelAdmin):
    list_display = ("api_key", "amount_limit", "token_limit", "updated_at")
    raw_id_fields = ("api_key",)
