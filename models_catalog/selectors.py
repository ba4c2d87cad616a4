"""Reads of the catalog: the one place a request's ``model`` becomes a deployment."""

from __future__ import annotations

from django.db.models import Q, QuerySet

from accounts.models import MANAGER_ROLES, Membership, Organization

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


def status_reason(*, deployment_id: int) -> str:
    """Why the deployment is in its status, as the placement loop last said ("" if it said nothing)."""
    return Deployment.objects.filter(pk=deployment_id).values_list("status_reason", flat=True).first() or ""


def deployment_name_taken(*, name: str) -> bool:
    """Whether a deployment has ``name`` already: names are one namespace, every organization's."""
    return Deployment.objects.filter(name=name).exists()


def deployments_of(*, organization: Organization) -> QuerySet[Deployment]:
    """The deployments ``organization`` owns (not the public ones)."""
    return Deployment.objects.filter(organization=organization).select_related("model").order_by("name")


def can_manage_deployment(*, user, deployment: Deployment) -> bool:
    """Whether ``user`` may change the settings of, scale, stop, start or delete ``deployment``.

    The platform's own deployments: operators (active staff) only. An organization's: its owners
    and admins, and the member who created it. Operators have no say over an organization's
    deployments beyond their role in it. An API key acts as the member who created it: pass its
    creator (the caller decides what a key without a creator, made by the operator's command
    line, may do)."""
    if user is None or not getattr(user, "is_authenticated", False) or not getattr(user, "is_active", False):
        return False
    if deployment.organization_id is None:
        return bool(user.is_staff)
    role = Membership.objects.filter(user=user, organization_id=deployment.organization_id) \
        .values_list("role", flat=True).first()
    if role in MANAGER_ROLES:
        return True
    return role == Membership.Role.MEMBER and deployment.created_by_id == user.pk


def catalog_models(*, include_inactive: bool = False, search: str = "", architecture: str = "") -> QuerySet[CatalogModel]:
    models = CatalogModel.objects.all()
    if not include_inactive:
        models = models.filter(is_active=True)
    if search:
        models = models.filter(Q(slug__icontains=search) | Q(display_name__icontains=search) | Q(description__icontains=search))
    if architecture:
        models = models.filter(architecture=architecture)
    return models.order_by("display_name", "slug")
