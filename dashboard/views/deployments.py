"""Deployments: the list with live status, the deploy form, a deployment's page with its charts."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404, JsonResponse
from django.shortcuts import redirect, render
from django.utils.text import slugify
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from models_catalog.errors import InvalidDeployment
from models_catalog.models import Deployment
from models_catalog.services import create_deployment, delete_deployment, update_deployment

from .. import selectors, snippets
from ..forms import DeploymentForm, DeploymentSettingsForm
from .common import is_htmx, organization_required


def _field_error(form, exc: InvalidDeployment) -> None:
    form.add_error(exc.field if exc.field in form.fields else None, exc.message)


@organization_required
def deployment_list(request):
    data = selectors.deployments_page(organization=request.organization)
    return render(request, "deployments/list.html", data)


@organization_required
@require_GET
def deployment_rows(request):
    """The list's rows alone: htmx polls this so statuses change without a reload."""
    data = selectors.deployments_page(organization=request.organization)
    return render(request, "deployments/_rows.html", data)


def _suggested_name(organization, model) -> str:
    base = slugify(f"{model.slug}-{organization.slug}")[:90].strip("-") or "deployment"
    name, n = base, 1
    while Deployment.objects.filter(name=name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


@organization_required
@require_http_methods(["GET", "POST"])
def deployment_new(request):
    if request.method == "POST":
        form = DeploymentForm(request.POST)
        if form.is_valid():
            try:
                deployment = create_deployment(
                    organization=request.organization, model=form.cleaned_data["model"], name=form.cleaned_data["name"],
                    created_by=request.user, **form.settings(),
                )
            except InvalidDeployment as exc:
                _field_error(form, exc)
            else:
                messages.success(request, f"{deployment.name} is deployed. It becomes ready as soon as a worker "
                                          "has loaded the model.")
                return redirect("deployment-detail", name=deployment.name)
    else:
        initial = dict(DeploymentSettingsForm.INITIAL)
        chosen = selectors.catalog_model(slug=request.GET.get("model", ""))
        if chosen is not None:
            initial.update(model=chosen.slug, name=_suggested_name(request.organization, chosen))
        form = DeploymentForm(initial=initial)
    models = {m.slug: m for m in form.fields["model"].queryset}
    suggestions = {slug: _suggested_name(request.organization, m) for slug, m in models.items()}
    return render(request, "deployments/new.html", {"form": form, "catalog": models.values(),
                                                   "name_suggestions": suggestions})


def _deployment(request, name: str) -> Deployment:
    deployment = selectors.deployment_for(organization=request.organization, name=name)
    if deployment is None:
        raise Http404("No such deployment.")
    return deployment


def _owned(request, deployment: Deployment) -> bool:
    return deployment.organization_id == request.organization.pk


@organization_required
def deployment_detail(request, name: str):
    deployment = _deployment(request, name)
    window = request.GET.get("window", "1h")
    metrics = selectors.deployment_metrics(organization=request.organization, deployment=deployment, window=window)
    urls = snippets.endpoints(request)
    return render(request, "deployments/detail.html", {
        "deployment": deployment, "owned": _owned(request, deployment), "metrics": metrics,
        "windows": list(selectors.WINDOWS), "recent": selectors.recent_requests(
            organization=request.organization, deployment=deployment, limit=10),
        "settings_form": DeploymentSettingsForm(initial=DeploymentSettingsForm.initial_for(deployment)),
        "examples": snippets.examples(model=deployment.name, **urls), **urls,
        "key_variable": snippets.KEY_VARIABLE,
    })


@organization_required
@require_GET
def deployment_metrics(request, name: str):
    deployment = _deployment(request, name)
    metrics = selectors.deployment_metrics(organization=request.organization, deployment=deployment,
                                           window=request.GET.get("window", "1h"))
    totals = metrics["totals"]
    return JsonResponse({
        "window": metrics["window"], "bucket_s": metrics["bucket_s"], "series": metrics["series"],
        "totals": {**totals, "cost": str(totals["cost"])},
    })


@organization_required
@require_GET
def deployment_status(request, name: str):
    """The status badge alone, polled by htmx on the deployment's page."""
    return render(request, "deployments/_status.html", {"deployment": _deployment(request, name), "poll": True})


@organization_required
@require_POST
def deployment_settings(request, name: str):
    deployment = _deployment(request, name)
    if not _owned(request, deployment):
        raise Http404("No such deployment.")
    form = DeploymentSettingsForm(request.POST)
    if form.is_valid():
        try:
            update_deployment(deployment=deployment, **form.settings())
        except InvalidDeployment as exc:
            _field_error(form, exc)
        else:
            messages.success(request, "Settings saved. Workers apply them the next time they load the model.")
            return redirect("deployment-detail", name=deployment.name)
    metrics = selectors.deployment_metrics(organization=request.organization, deployment=deployment)
    urls = snippets.endpoints(request)
    return render(request, "deployments/detail.html", {
        "deployment": deployment, "owned": True, "metrics": metrics, "windows": list(selectors.WINDOWS),
        "recent": selectors.recent_requests(organization=request.organization, deployment=deployment, limit=10),
        "settings_form": form, "settings_open": True,
        "examples": snippets.examples(model=deployment.name, **urls), **urls, "key_variable": snippets.KEY_VARIABLE,
    }, status=400)


@organization_required
@require_POST
def deployment_delete(request, name: str):
    deployment = _deployment(request, name)
    if not _owned(request, deployment):
        raise Http404("No such deployment.")
    if request.POST.get("confirm") != deployment.name:
        messages.error(request, f"Type the deployment's name ({deployment.name}) to confirm the deletion.")
        return redirect("deployment-detail", name=deployment.name)
    delete_deployment(deployment=deployment)
    messages.success(request, f"{name} was deleted. Its usage history stays in your reports.")
    if is_htmx(request):
        return render(request, "deployments/_rows.html", selectors.deployments_page(organization=request.organization))
    return redirect("deployments")
