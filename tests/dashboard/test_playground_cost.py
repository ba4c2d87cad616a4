"""A playground reply's cost is looked up in the organization the page's socket billed, even after
the user switched organization in another tab; never in one the user does not belong to."""

from __future__ import annotations

from decimal import Decimal

import pytest

from accounts.services import create_organization
from models_catalog.services import create_deployment
from tests.dashboard.conftest import record

COUNTS = {"prompt_tokens": "40", "cached_prompt_tokens": "0", "completion_tokens": "200"}


@pytest.fixture
def switched(ada, acme, catalog):
    """Ada's playground page was opened in Acme; then she switched to a second organization."""
    user, org = acme
    model, _ = catalog
    private = create_deployment(organization=org, model=model, name="acme-private")
    lab = create_organization(name="Lab", owner=user)
    assert ada.post("/organizations/switch/", {"organization": lab.pk}).status_code == 302
    return org, private


def test_the_reply_is_priced_in_the_organization_it_was_billed_to(ada, switched):
    org, private = switched
    billed = record(org, private, prompt_tokens=40, completion_tokens=200, request_id="chatcmpl-acme")
    query = {**COUNTS, "deployment": private.name, "organization": org.pk}
    answer = ada.get("/playground/cost/", {**query, "request_id": "chatcmpl-acme"}).json()
    assert answer["source"] == "billed" and Decimal(answer["cost"]) == billed.cost
    # Before billing records it, the estimate uses that organization's private deployment.
    answer = ada.get("/playground/cost/", {**query, "request_id": "chatcmpl-not-yet"}).json()
    assert answer["source"] == "estimated"


@pytest.mark.parametrize("organization", ["globex", "0", "x", "1" * 30])
def test_an_organization_the_user_is_not_in_is_an_unknown_reply(ada, acme, globex, catalog, organization):
    _, public = catalog
    theirs = record(globex[1], public, request_id="chatcmpl-globex", completion_tokens=9999)
    organization = globex[1].pk if organization == "globex" else organization
    response = ada.get("/playground/cost/", {**COUNTS, "deployment": public.name, "organization": organization,
                                            "request_id": theirs.request_id})
    assert response.status_code == 404 and str(theirs.cost) not in response.content.decode()


def test_the_page_names_the_organization_its_socket_bills(ada, acme, catalog):
    _, org = acme
    page = ada.get("/playground/").content.decode()
    assert f'data-organization="{org.pk}"' in page
    # The socket's URL names it too: the server bills that one, not whatever the session's current
    # organization is when the playground (re)connects (tests/gateway/test_playground_organization.py).
    assert f'data-ws-url="ws://testserver/v1/ws?organization={org.pk}"' in page
