from django.contrib import admin
from django.urls import include, path, re_path

from gateway.views import unknown_endpoint

from . import health

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("", include("gateway.urls")),
    path("", include("billing.urls")),
    path("", include("models_catalog.urls")),
    path("", include("workers.urls")),
    re_path(r"^v1(/|$)", unknown_endpoint),  # after every API route: the rest of /v1 is a JSON 404
    path("admin/", admin.site.urls),
    path("", include("dashboard.urls")),
]
