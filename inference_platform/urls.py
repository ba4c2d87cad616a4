from django.contrib import admin
from django.urls import include, path

from . import health

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("", include("gateway.urls")),
    path("", include("billing.urls")),
    path("", include("models_catalog.urls")),
    path("", include("workers.urls")),
    path("admin/", admin.site.urls),
    path("", include("dashboard.urls")),
]
