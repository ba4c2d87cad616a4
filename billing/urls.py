from django.urls import path

from . import api, views

urlpatterns = [
    path("v1/usage", api.UsageReportView.as_view(), name="billing-usage"),
    path("v1/usage/export.csv", api.UsageExportView.as_view(), name="billing-usage-export"),
    path("v1/billing/balance", api.BalanceView.as_view(), name="billing-balance"),
    path("v1/billing/ledger", api.LedgerView.as_view(), name="billing-ledger"),
    path("v1/billing/topups", api.TopUpView.as_view(), name="billing-topups"),
    path("v1/billing/limits", api.SpendLimitView.as_view(), name="billing-limits"),
    path("billing/stripe/webhook", views.stripe_webhook, name="billing-stripe-webhook"),
    path("billing/", views.billing_page, name="billing"),
    path("billing/limit/", views.spend_limit_update, name="billing-spend-limit"),
    path("billing/alert/", views.balance_alert_update, name="billing-balance-alert"),
    path("billing/spend-alert/", views.spend_alert_update, name="billing-spend-alert"),
]
