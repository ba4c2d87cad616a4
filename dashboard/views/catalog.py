"""The model catalog and a model's page with its copy-paste examples."""

from __future__ import annotations

from django.http import Http404
from django.shortcuts import render

from .. import selectors, snippets
from .common import is_htmx, organization_required


@organization_required
def catalog(request):
    filters = {name: request.GET.get(name, "").strip() for name in ("search", "architecture", "quantization", "size")}
    models = list(selectors.catalog(**filters))
    context = {"models": models, "filters": filters, "options": selectors.catalog_filter_options(),
               "filtered": any(filters.values())}
    if is_htmx(request):
        return render(request, "catalog/_grid.html", context)
    return render(request, "catalog/list.html", context)


@organization_required
def model_detail(request, slug: str):
    model = selectors.catalog_model(slug=slug)
    if model is None:
        raise Http404("No such model in the catalog.")
    deployments = selectors.deployments_of_model(organization=request.organization, model=model)
    chosen = deployments[0].name if deployments else "YOUR-DEPLOYMENT-NAME"
    urls = snippets.endpoints(request)
    return render(request, "catalog/detail.html", {
        "model": model, "deployments": deployments, "example_model": chosen, **urls,
        "examples": snippets.examples(model=chosen, **urls), "key_variable": snippets.KEY_VARIABLE,
    })
