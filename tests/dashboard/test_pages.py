"""Every page: login required, renders for a member, CSRF enforced on writes."""

from __future__ import annotations

import pytest
from django.test import Client

from tests.dashboard.conftest import PASSWORD, sign_up

PAGES = ["/", "/models/", "/deployments/", "/deploy/", "/playground/", "/api-keys/", "/usage/", "/billing/",
         "/settings/members/", "/organizations/new/"]


@pytest.mark.parametrize("path", PAGES + ["/models/smollm2-135m-instruct/", "/deployments/smollm2-135m-instruct/"])
def test_pages_need_a_login(client, catalog, path):
    response = client.get(path)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=")


@pytest.mark.parametrize("path", PAGES + ["/models/smollm2-135m-instruct/", "/deployments/smollm2-135m-instruct/"])
def test_pages_render_for_a_member(ada, catalog, path):
    response = ada.get(path)
    assert response.status_code == 200, path
    body = response.content.decode()
    assert "Acme" in body  # the organization switcher
    assert 'name="csrfmiddlewaretoken"' in body  # the logout form at least


@pytest.mark.parametrize("path", ["/login/", "/signup/", "/password-reset/"])
def test_public_pages_render(client, db, path):
    assert client.get(path).status_code == 200


def test_writes_need_the_csrf_token(db, catalog):
    user, _ = sign_up()
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    response = client.post("/api-keys/", {"name": "k", "scopes": ["inference"]})
    assert response.status_code == 403
    response = client.post("/deploy/", {"model": "smollm2-135m-instruct", "name": "x"})
    assert response.status_code == 403


def test_the_operator_pages_are_for_staff_only(ada, acme):
    for path in ("/operator/fleet/", "/operator/fleet/_workers/", "/operator/models/import/"):
        assert ada.get(path).status_code == 403, path
    assert b"Fleet" not in ada.get("/").content  # no operator section in the navigation


def test_a_user_without_an_organization_is_asked_to_create_one(client, db):
    from accounts.services import create_user

    user = create_user(email="loner@example.com", password=PASSWORD)
    client.force_login(user)
    response = client.get("/deployments/")
    assert response.status_code == 302 and response["Location"] == "/organizations/new/"
    response = client.post("/organizations/new/", {"name": "Solo Labs"})
    assert response.status_code == 302
    page = client.get("/").content.decode()
    assert "Solo Labs" in page and "$5.00" in page  # the sign-up credit of the new organization


def test_an_htmx_poll_after_the_session_ended_sends_the_page_to_the_login_form(client, catalog):
    response = client.get("/deployments/_rows/", headers={
        "HX-Request": "true", "HX-Current-URL": "http://testserver/deployments/"})
    assert response.status_code == 204
    assert response["HX-Redirect"] == "/login/?next=%2Fdeployments%2F"


def test_the_assets_are_served_whole_under_asgi_without_a_warning(db):
    """`up` serves the dashboard's CSS and JS from its ASGI process: a file streamed through a
    synchronous iterator there made Django warn in the web log, and hop threads per chunk."""
    import warnings

    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    from tests.support import REPO_ROOT

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        response = async_to_sync(AsyncClient().get)("/static/vendor/chart-4.6.1.umd.min.js")
        assert response.status_code == 200 and not response.streaming
        assert response.content == (REPO_ROOT / "static" / "vendor" / "chart-4.6.1.umd.min.js").read_bytes()
        assert response["Content-Type"].startswith("text/javascript") and response["Last-Modified"]
        again = async_to_sync(AsyncClient().get)("/static/vendor/chart-4.6.1.umd.min.js",
                                                 headers={"If-Modified-Since": response["Last-Modified"]})
        assert again.status_code == 304  # a browser's cached copy is still good
    assert not [w for w in caught if "synchronous iterators" in str(w.message)], [str(w.message) for w in caught]
