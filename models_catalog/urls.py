from django.urls import path

from . import api

urlpatterns = [
    path("v1/catalog", api.CatalogListView.as_view(), name="catalog-list"),
    path("v1/catalog/<str:slug>", api.CatalogDetailView.as_view(), name="catalog-detail"),
    path("v1/deployments", api.DeploymentListView.as_view(), name="deployment-list"),
    path("v1/deployments/<str:name>", api.DeploymentDetailView.as_view(), name="deployment-detail"),
    path("v1/deployments/<str:name>/scale", api.DeploymentScaleView.as_view(), name="deployment-scale"),
    path("v1/deployments/<str:name>/stop", api.DeploymentStopView.as_view(), name="deployment-stop"),
    path("v1/deployments/<str:name>/start", api.DeploymentStartView.as_view(), name="deployment-start"),
]
