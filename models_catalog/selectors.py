"""Reads of the catalog: the one place a request's ``model`` becomes a deployment."""

from __future__ import annotations

from django.db.models import Q, QuerySet

from accounts.models import Organization

from .errors import DeploymentNotFound
from .models import CatalogModel, Deployment


def _visible(organization: Organization | None) -> Q:
    if organization is None:
        return Q(is_public=True)
    return Q(is_public=True) | Q(organization=organization)


def deployments_visible_to(*, organization: Organization | None) -> QuerySet[Deployment]:
    """Public deployments plus ``organization``'s own, with their catalog models."""
    return Deployment.objects.filter(_visible(organization)).select_related("model", "organization").order_by("name")


def resolve_deployment(*, organization: Organization | None, name: str) -> Deployment:
    """The deployment ``organization`` calls as ``name``; DeploymentNotFound when there is none it may
    call, whether or not another organization has one of that name."""
    if not isinstance(name, str) or not name:
        raise DeploymentNotFound(str(name or ""))
    deployment = deployments_visible_to(organization=organization).filter(name=name).first()
    if deployment is None:
        raise DeploymentNotFound(name)
    return deployment


def deployments_of(*, organization: Organization) -> QuerySet[Deployment]:
    """The deployments ``organization`` owns (not the public ones)."""
    return Deployment.objects.filter(organization=organization).select_related("model").order_by("name")


def catalog_models(*, include_inactive: bool = False, search: str = "", architecture: str = "") -> QuerySet[CatalogModel]:
    models = CatalogModel.objects.all()
    if not include_inactive:
        models = models.filter(is_active=True)
    if search:
        models = models.filter(Q(slug__icontains=search) | Q(display_name__icontains=search) | Q(description__icontains=search))
    if architecture:
        models = models.filter(architecture=architecture)
    return models.order_by("display_name", "slug")
