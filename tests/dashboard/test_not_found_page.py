"""A dashboard page whose object is gone (or another organization's) answers the dashboard's own
404 page, saying what was not found, in debug mode too (``up``'s default), not Django's debug
page listing the site's URL patterns. The API keeps its JSON 404."""

from __future__ import annotations

import re

import pytest


def _reason(html: str) -> str:
    return re.search(r'id="not-found-reason">(.*?)</p>', html, flags=re.DOTALL).group(1)


@pytest.mark.parametrize("debug", [True, False])
@pytest.mark.parametrize("path, says", [
    ("/responses/resp_nope/", "No such response (it may have expired or been deleted)."),
    ("/deployments/nope/", "No such deployment."),
    ("/files/file-nope/", "No such file (it may have expired or been deleted)."),
    ("/models/no-such-model/", "No such model in the catalog."),
])
def test_a_missing_object_is_the_dashboards_404_page_with_its_reason(ada, settings, debug, path, says):
    settings.DEBUG = debug
    response = ada.get(path)
    assert response.status_code == 404
    html = response.content.decode()
    assert "URLconf" not in html and _reason(html).startswith(says)


def test_another_organizations_deployment_is_not_found_either(ada, globex):
    from django.core.management import call_command

    from models_catalog.models import CatalogModel
    from models_catalog.services import create_deployment

    call_command("seed_catalog", verbosity=0)
    _, other = globex
    create_deployment(organization=other, model=CatalogModel.objects.get(slug="smollm2-135m-instruct"),
                      name="theirs", kind="serverless")
    response = ada.get("/deployments/theirs/")
    assert response.status_code == 404 and _reason(response.content.decode()).startswith("No such deployment.")


def test_the_api_keeps_its_json_404(ada, settings):
    settings.DEBUG = True
    response = ada.get("/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_url"
