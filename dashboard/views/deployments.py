"""Deployments: the list with live status, the deploy form, a deployment's page with its charts."""

from __future__ import annotations

from functools import wraps

from django.contrib import messages
from django.http import Http404, JsonResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.utils import timezone
from django.utils.text import slugify
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from billing.serializers import money
from models_catalog.errors import InvalidDeployment
from models_catalog.models import Deployment
from models_catalog.selectors import can_manage_deployment, deployment_name_taken
from models_catalog.services import (
    LOADS_NOTHING, LOADS_NOW, LOADS_ON_REQUEST, LOADS_ON_START, change_deployment_settings,
    create_deployment, delete_deployment, start_deployment, stop_deployment,
)

from .. import selectors, snippets
from ..forms import DeploymentForm, DeploymentSettingsForm
from .common import is_htmx, organization_required

RECENT_REQUESTS = 10  # rows of the page's "Latest requests"

# What a saved settings change says, by when the model loads with it (change_deployment_settings).
SETTINGS_SAVED = {
    LOADS_NOTHING: "Settings saved.",
    LOADS_NOW: "Settings saved. Workers are loading the model with them; requests wait until it is ready.",
    LOADS_ON_REQUEST: "Settings saved. It is scaled to zero: the next request loads the model with them.",
    LOADS_ON_START: "Settings saved. The model loads with them when the deployment is started.",
}


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
    while deployment_name_taken(name=name):
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


def _manageable(request, deployment: Deployment) -> bool:
    """Whether the user may change the deployment here: the dashboard changes its organization's
    own deployments (not the shared ones), as the user's role allows."""
    return _owned(request, deployment) and can_manage_deployment(user=request.user, deployment=deployment)


def managed(view):
    """A POST that changes one of the organization's own deployments: a shared or another
    organization's one is not found; one the user's role does not allow gets the refusal page."""
    @wraps(view)
    @organization_required
    @require_POST
    def changing(request, name: str):
        deployment = _deployment(request, name)
        if not _owned(request, deployment):
            raise Http404("No such deployment.")
        if not can_manage_deployment(user=request.user, deployment=deployment):
            return render(request, "deployments/not_allowed.html", {"deployment": deployment}, status=403)
        return view(request, deployment)
    return changing


def _figures(request, deployment: Deployment, *, window: str) -> dict:
    """The metrics and the latest requests, read at one moment (``as_of``)."""
    now = timezone.now()
    return {
        "metrics": selectors.deployment_metrics(organization=request.organization, deployment=deployment,
                                                window=window, now=now),
        "recent": selectors.recent_requests(organization=request.organization, deployment=deployment,
                                            limit=RECENT_REQUESTS),
        "as_of": now,
    }


def _detail_page(request, deployment: Deployment, *, settings_form=None, status: int = 200):
    urls = snippets.endpoints(request)
    return render(request, "deployments/detail.html", {
        "deployment": deployment, "owned": _owned(request, deployment),
        "can_manage": _manageable(request, deployment),
        **_figures(request, deployment, window=request.GET.get("window", "1h")),
        "windows": list(selectors.WINDOWS),
        "settings_form": settings_form or DeploymentSettingsForm(
            initial=DeploymentSettingsForm.initial_for(deployment)),
        "examples": snippets.examples(model=deployment.name, **urls), **urls,
        "key_variable": snippets.KEY_VARIABLE,
    }, status=status)


@organization_required
def deployment_detail(request, name: str):
    return _detail_page(request, _deployment(request, name))


@organization_required
@require_GET
def deployment_metrics(request, name: str):
    """The charts' series and the figure cards, for the page's periodic refresh."""
    deployment = _deployment(request, name)
    figures = _figures(request, deployment, window=request.GET.get("window", "1h"))
    metrics, totals = figures["metrics"], figures["metrics"]["totals"]
    fragment = {"deployment": deployment, "owned": _owned(request, deployment), **figures}
    return JsonResponse({
        "window": metrics["window"], "bucket_s": metrics["bucket_s"], "series": metrics["series"],
        "totals": {**totals, "cost": money(totals["cost"])},
        "as_of": figures["as_of"].isoformat(),
        # The cards and the table as the page first rendered them: one formatting, the templates'.
        "html": {
            "figures": render_to_string("deployments/_figures.html", fragment),
            "recent": render_to_string("deployments/_recent.html", fragment),
        },
    })


@organization_required
@require_GET
def deployment_status(request, name: str):
    """The status badge and, out of band, the reason line under the title and the Start or Stop
    button: polled by htmx on the deployment's page."""
    deployment = _deployment(request, name)
    return render(request, "deployments/_status_poll.html",
                  {"deployment": deployment, "can_manage": _manageable(request, deployment)})


@managed
def deployment_settings(request, deployment: Deployment):
    form = DeploymentSettingsForm(request.POST)
    if form.is_valid():
        try:
            # As the API's PATCH: a failed deployment is tried again with the new settings.
            change = change_deployment_settings(deployment=deployment, **form.settings())
        except InvalidDeployment as exc:
            _field_error(form, exc)
        else:
            messages.success(request, SETTINGS_SAVED[change.loads])
            return redirect("deployment-detail", name=deployment.name)
    # The page again with the form's errors; the template points the address back at the
    # deployment's page, so that reloading or choosing a window does not post again.
    return _detail_page(request, deployment, settings_form=form, status=400)


@managed
def deployment_start(request, deployment: Deployment):
    """Start a stopped deployment, or try a failed one again (the API's POST .../start)."""
    name = deployment.name
    failed = deployment.status == Deployment.Status.FAILED
    reason = "tried again from the dashboard" if failed else "started from the dashboard"
    try:
        started = start_deployment(deployment=deployment, reason=reason)
    except InvalidDeployment as exc:  # its reserved replicas cannot be paid for now
        messages.error(request, exc.message)
        return redirect("deployment-detail", name=deployment.name)
    if started:
        what = f"Trying {name} again" if failed else f"{name} is starting"
        messages.success(request, f"{what}: workers are loading the model; requests wait until it is ready.")
    else:  # started meanwhile, from another tab or the API
        messages.info(request, f"{name} is {deployment.get_status_display().lower()} already: nothing to start.")
    return redirect("deployment-detail", name=deployment.name)


@managed
def deployment_stop(request, deployment: Deployment):
    """Stop serving it (the API's POST .../stop): running requests finish, waiting ones get a 503."""
    name = deployment.name
    if stop_deployment(deployment=deployment, reason="stopped from the dashboard"):
        messages.success(request, f"{name} is stopping: requests already running finish, new ones get a 503 "
                                  "until you start it again.")
    else:  # stopped meanwhile, from another tab or the API
        messages.info(request, f"{name} is stopped already.")
    return redirect("deployment-detail", name=name)


@managed
def deployment_delete(request, deployment: Deployment):
    name = deployment.name
    if request.POST.get("confirm") != deployment.name:
        messages.error(request, f"Type the deployment's name ({deployment.name}) to confirm the deletion.")
        return redirect("deployment-detail", name=deployment.name)
    delete_deployment(deployment=deployment)
    messages.success(request, f"{name} was deleted. Its usage history stays in your reports.")
    if is_htmx(request):
        return render(request, "deployments/_rows.html", selectors.deployments_page(organization=request.organization))
    return redirect("deployments")
