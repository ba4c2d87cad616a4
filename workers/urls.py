from django.urls import path

from . import api, metrics

urlpatterns = [
    path("v1/deployments/<str:name>/metrics", api.DeploymentMetricsView.as_view(), name="deployment-metrics"),
    path("v1/fleet/workers", api.FleetWorkersView.as_view(), name="fleet-workers"),
    path("metrics", metrics.metrics, name="prometheus-metrics"),
]
