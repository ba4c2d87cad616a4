"""Operator pages (staff only): the fleet of workers and the catalog import."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods

from billing.selectors import refused_usage_events
from models_catalog.errors import ModelImportError
from models_catalog.weights import models_root
from workers.model_import import import_model

from .. import selectors
from ..forms import ImportModelForm
from .common import staff_required


@staff_required
def fleet(request):
    deployments = list(selectors.all_deployments())
    return render(request, "operator/fleet.html", {
        "deployments": deployments, "refused_usage_events": len(refused_usage_events()),
    })


@staff_required
@require_GET
def fleet_workers(request):
    """The workers table alone (htmx loads it after the page, then refreshes it)."""
    workers, broker_error = selectors.fleet_workers(timeout=1.0)
    return render(request, "operator/_workers.html", {"workers": workers, "broker_error": broker_error})


@staff_required
@require_http_methods(["GET", "POST"])
def model_import(request):
    form = ImportModelForm(request.POST or None, initial={"path": request.GET.get("path", "")})
    if request.method == "POST" and form.is_valid():
        try:
            model = import_model(**form.import_arguments())
        except ModelImportError as exc:
            form.add_error("path", exc.message)
        else:
            messages.success(request, f"{model.display_name} ({model.slug}) is in the catalog.")
            return redirect("model-detail", slug=model.slug)
    root = models_root()
    return render(request, "operator/import.html", {
        "form": form, "models_root": settings.MODELS_ROOT, "candidates": selectors.importable_weights(root=root),
    })
