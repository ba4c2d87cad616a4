"""The catalog and deployments REST API.

Callers: an API key with the ``manage`` scope, or the dashboard's logged-in user (the session's
current organization). An organization sees the public deployments and its own; it changes only
its own. Another organization's deployment does not exist for it (404 for every verb). Within
the organization, owners and admins change every deployment, a member only those they created
(403 ``insufficient_role``); a key acts with the role of the member who created it, a key the
operator's command line made for no user as the organization, any other key without a creator
with no role. Operators (staff users) also see and change the platform's own deployments, and may
publish one to every organization. Errors follow OpenAI's shape ``{"error": {"message", "type",
"param", "code"}}``; invalid settings are a 400 naming the field in ``param``.

    GET    /v1/catalog                      the models one can deploy
    GET    /v1/catalog/{id}
    GET    /v1/deployments                  the deployments the caller can call
    POST   /v1/deployments                  create (name, model, settings)
    GET    /v1/deployments/{name}           settings and status (pending, loading, ready, ...)
    PATCH  /v1/deployments/{name}           change settings
    DELETE /v1/deployments/{name}           requests in flight finish; waiting ones get a 404
    POST   /v1/deployments/{name}/scale     {"min_replicas", "max_replicas"}
    POST   /v1/deployments/{name}/stop      stop serving (waiting requests get a 503)
    POST   /v1/deployments/{name}/start     serve again (also retries a failed deployment)
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Q
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions as drf_exceptions
from rest_framework.authentication import SessionAuthentication
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.api_errors import drf_error_response, error_response
from accounts.authentication import ApiKeyAuthentication, key_actor
from accounts.middleware import SESSION_ORGANIZATION_KEY
from accounts.models import ApiKey, Organization
from accounts.permissions import require_scope
from accounts.selectors import current_organization_for_user

from . import serializers, services
from .errors import CatalogError, InvalidCatalogModel, InvalidDeployment
from .models import CatalogModel, Deployment
from .selectors import can_manage_deployment, catalog_models

_ERROR = OpenApiResponse(description='{"error": {"message", "type", "param", "code"}}')
_ERRORS = {400: _ERROR, 401: _ERROR, 403: _ERROR, 404: _ERROR}


class ApiProblem(Exception):
    """A refusal rendered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def exception_handler(exc, context):
    """ApiProblem, the catalog's errors and DRF's own, in OpenAI's shape; anything else: a 500."""
    if isinstance(exc, ApiProblem):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, (InvalidDeployment, InvalidCatalogModel)):
        return error_response(400, exc.message, param=exc.field, code="invalid_value")
    if isinstance(exc, CatalogError):
        return error_response(400, exc.message, code="invalid_value")
    if isinstance(exc, drf_exceptions.APIException):
        return drf_error_response(exc, context)
    return None


@dataclass
class Caller:
    organization: Organization | None
    operator: bool
    user: object
    # Whose role decides what the caller may change: the session's user or the key's creator;
    # None for a key the operator's command line made for no user (``key_actor``, as billing's
    # spend limit treats it).
    actor: object = None


def caller_of(request) -> Caller:
    """The caller's organization (the key's, or the session's current one) and whether they are an
    operator (a staff user, through the session or a key they created)."""
    user = request.user
    operator = bool(getattr(user, "is_staff", False) and getattr(user, "is_active", False))
    if isinstance(request.auth, ApiKey):
        return Caller(organization=request.auth.organization, operator=operator, user=user,
                      actor=key_actor(request.auth))
    organization = current_organization_for_user(user=user, organization_id=request.session.get(SESSION_ORGANIZATION_KEY))
    if organization is None and not operator:
        raise ApiProblem(403, "Your account does not belong to an organization yet.", code="no_organization")
    return Caller(organization=organization, operator=operator, user=user, actor=user)


def _not_found(name: str) -> ApiProblem:
    return ApiProblem(404, f"The deployment '{name}' does not exist or you do not have access to it.",
                      param="name", code="deployment_not_found")


def readable_deployment(caller: Caller, name: str) -> Deployment:
    """A deployment the caller may see: public, its organization's, or (operators) the platform's."""
    visible = Q(is_public=True)
    if caller.organization is not None:
        visible |= Q(organization=caller.organization)
    if caller.operator:
        visible |= Q(organization__isnull=True)
    deployment = Deployment.objects.filter(visible, name=name).select_related("model", "organization").first()
    if deployment is None:
        raise _not_found(name)
    return deployment


def writable_deployment(caller: Caller, name: str) -> Deployment:
    """A deployment the caller may change: its organization's, or (operators) the platform's, as
    its role allows (``can_manage_deployment``)."""
    deployment = readable_deployment(caller, name)
    if deployment.organization_id is None and not caller.operator:
        raise ApiProblem(403, f"'{name}' is shared by the platform; only an operator can change it.",
                         param="name", code="permission_denied")
    if deployment.organization_id is not None and (
            caller.organization is None or deployment.organization_id != caller.organization.pk):
        raise _not_found(name)
    if caller.actor is not None and not can_manage_deployment(user=caller.actor, deployment=deployment):
        raise ApiProblem(403, f"Only the organization's owners and admins, and the member who created it, "
                              f"can change '{name}'.", param="name", code="insufficient_role")
    return deployment


def _body(request) -> dict:
    data = request.data
    if not isinstance(data, dict):
        raise ApiProblem(400, "The request body must be a JSON object.", code="invalid_json")
    return dict(data)


def _settings(body: dict) -> dict:
    """The deployment settings of a body; any other field is a 400 naming it."""
    for field in body:
        if field not in services.SETTINGS:
            fixed = field in ("name", "model", "organization", "status", "status_reason")
            raise InvalidDeployment(field, f"{field} cannot be {'changed' if fixed else 'set'}: it is not a setting."
                                    if fixed else f"Unknown setting {field!r}.")
    return body


class ManageAPIView(APIView):
    authentication_classes = [ApiKeyAuthentication, SessionAuthentication]
    permission_classes = [require_scope("manage")]

    def get_exception_handler(self):
        return exception_handler


class CatalogListView(ManageAPIView):
    @extend_schema(responses={200: serializers.CatalogModelSerializer(many=True), **_ERRORS})
    def get(self, request):
        models = catalog_models(search=request.query_params.get("search", "")[:100],
                                architecture=request.query_params.get("architecture", "")[:64])
        return Response({"object": "list", "data": [serializers.catalog_model(m) for m in models]})


class CatalogDetailView(ManageAPIView):
    @extend_schema(responses={200: serializers.CatalogModelSerializer, **_ERRORS})
    def get(self, request, slug: str):
        model = catalog_models().filter(slug=slug).first()
        if model is None:
            raise ApiProblem(404, f"The catalog has no model '{slug}'.", param="id", code="model_not_found")
        return Response(serializers.catalog_model(model))


def _catalog_model(value) -> CatalogModel:
    if not isinstance(value, str) or not value:
        raise InvalidDeployment("model", "Choose a model from the catalog (GET /v1/catalog): its id.")
    model = catalog_models().filter(slug=value).first()
    if model is None:
        raise InvalidDeployment("model", f"The catalog has no model '{value[:100]}': see GET /v1/catalog.")
    return model


class DeploymentListView(ManageAPIView):
    @extend_schema(responses={200: serializers.DeploymentSerializer(many=True), **_ERRORS})
    def get(self, request):
        caller = caller_of(request)
        visible = Q(is_public=True)
        if caller.organization is not None:
            visible |= Q(organization=caller.organization)
        if caller.operator:
            visible |= Q(organization__isnull=True)
        deployments = Deployment.objects.filter(visible).select_related("model", "organization").order_by("name")
        return Response({"object": "list", "data": [serializers.deployment(d) for d in deployments]})

    @extend_schema(request=serializers.DeploymentCreateSerializer,
                   responses={201: serializers.DeploymentSerializer, **_ERRORS})
    def post(self, request):
        caller = caller_of(request)
        body = _body(request)
        if "name" not in body:
            raise InvalidDeployment("name", "A deployment needs a name: what clients will pass as `model`.")
        name, model = body.pop("name"), _catalog_model(body.pop("model", None))
        _settings(body)
        if body.get("is_public") and not caller.operator:
            raise InvalidDeployment("is_public", "Only an operator can publish a deployment to every organization.")
        owner = None if caller.operator and (body.get("is_public") or caller.organization is None) else caller.organization
        user = caller.user if getattr(caller.user, "pk", None) else None
        deployment = services.create_deployment(organization=owner, model=model, name=name, created_by=user, **body)
        return Response(serializers.deployment(deployment), status=201)


class DeploymentDetailView(ManageAPIView):
    @extend_schema(responses={200: serializers.DeploymentSerializer, **_ERRORS})
    def get(self, request, name: str):
        return Response(serializers.deployment(readable_deployment(caller_of(request), name)))

    @extend_schema(request=serializers.DeploymentUpdateSerializer,
                   responses={200: serializers.DeploymentSerializer, **_ERRORS})
    def patch(self, request, name: str):
        deployment = writable_deployment(caller_of(request), name)
        changes = _body(request)
        if not changes:
            raise ApiProblem(400, "Give at least one setting to change.", code="invalid_value")
        deployment = services.change_deployment_settings(deployment=deployment, **_settings(changes)).deployment
        return Response(serializers.deployment(deployment))

    @extend_schema(responses={200: serializers.DeletedSerializer, **_ERRORS})
    def delete(self, request, name: str):
        deployment = writable_deployment(caller_of(request), name)
        services.delete_deployment(deployment=deployment)
        return Response({"object": "deployment.deleted", "id": name, "deleted": True})


class DeploymentScaleView(ManageAPIView):
    @extend_schema(request=serializers.ScaleSerializer, responses={200: serializers.DeploymentSerializer, **_ERRORS})
    def post(self, request, name: str):
        deployment = writable_deployment(caller_of(request), name)
        changes = _body(request)
        for field in changes:
            if field not in serializers.SCALE_FIELDS:
                raise InvalidDeployment(field, "Scale takes min_replicas and max_replicas only.")
        if not changes:
            raise ApiProblem(400, "Give min_replicas and/or max_replicas.", code="invalid_value")
        deployment = services.update_deployment(deployment=deployment, **changes)
        services.retry_if_failed(deployment=deployment, why="it was scaled")
        return Response(serializers.deployment(deployment))


class DeploymentStopView(ManageAPIView):
    @extend_schema(request=None, responses={200: serializers.DeploymentSerializer, **_ERRORS})
    def post(self, request, name: str):
        deployment = writable_deployment(caller_of(request), name)
        services.stop_deployment(deployment=deployment, reason="stopped through the API")
        return Response(serializers.deployment(deployment))


class DeploymentStartView(ManageAPIView):
    @extend_schema(request=None, responses={200: serializers.DeploymentSerializer, **_ERRORS})
    def post(self, request, name: str):
        deployment = writable_deployment(caller_of(request), name)
        services.start_deployment(deployment=deployment, reason="started through the API")
        return Response(serializers.deployment(deployment))
