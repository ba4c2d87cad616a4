"""The usage page, the playground's reply cost, and their organization isolation."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from accounts.services import create_api_key
from billing.pricing import Prices, request_cost
from tests.dashboard.conftest import record


def test_the_usage_page_shows_the_organizations_requests_only(ada, acme, globex, catalog):
    _, org = acme
    _, public = catalog
    key, _ = create_api_key(organization=org, name="svc", scopes=["inference"])
    mine = record(org, public, api_key=key, prompt_tokens=1200, completion_tokens=345, endpoint="/v1/embeddings")
    playground = record(org, public, prompt_tokens=10, completion_tokens=5)
    theirs = record(globex[1], public, prompt_tokens=777, completion_tokens=888)
    page = ada.get("/usage/").content.decode()
    assert mine.request_id in page and playground.request_id in page and theirs.request_id not in page
    assert 'data-completion-tokens="345"' in page and f'data-cost="{mine.cost}"' in page
    by_key = page.split('id="usage-by-key"')[1].split("</table>")[0]
    assert "svc" in by_key and "Playground" in by_key
    by_endpoint = page.split('id="usage-by-endpoint"')[1].split("</table>")[0]
    assert "/v1/embeddings" in by_endpoint and "not recorded" in by_endpoint  # the playground's record has none
    total = mine.cost + playground.cost
    assert ada.get("/usage/").context["totals"]["cost"] == total
    assert 'href="/v1/usage/export.csv?start=' in page


def test_the_date_range_filters_and_bad_ranges_fall_back(ada, acme, catalog):
    _, org = acme
    _, public = catalog
    old = record(org, public, finished_at=datetime.now(timezone.utc) - timedelta(days=40))
    assert old.request_id not in ada.get("/usage/").content.decode()  # default: the last 30 days
    today = datetime.now(timezone.utc).date()
    start = (today - timedelta(days=45)).isoformat()
    page = ada.get(f"/usage/?start={start}&end={today.isoformat()}")
    assert old.request_id in page.content.decode() and page.context["days"] == 46
    page = ada.get(f"/usage/?start={today.isoformat()}&end={start}")
    assert page.status_code == 200 and "before the start date" in page.content.decode()
    assert page.context["days"] == 30


@pytest.mark.parametrize("query, field", [
    ("end=0001-01-01", "end"),  # 30 days before it does not exist
    ("start=9999-12-31&end=9999-12-31", "start"),  # nor the day after
    ("start=2001-01-01", "start"),  # runs to today: thousands of days
    ("start=2026-01-01&end=2031-01-01", "end"),
])
def test_out_of_range_periods_are_form_errors_not_errors(ada, acme, query, field):
    page = ada.get(f"/usage/?{query}")
    assert page.status_code == 200 and page.context["form"].errors.get(field)
    assert page.context["days"] == 30  # the default period instead


def test_the_csv_export_link_serves_the_organizations_rows(ada, acme, globex, catalog):
    _, org = acme
    _, public = catalog
    mine = record(org, public)
    theirs = record(globex[1], public)
    link = ada.get("/usage/").context["export_url"]
    body = b"".join(ada.get(link).streaming_content).decode()
    assert mine.request_id in body and theirs.request_id not in body


def test_reply_cost_is_billed_when_recorded_and_estimated_before(ada, acme, globex, catalog):
    _, org = acme
    model, public = catalog
    query = {"request_id": "chatcmpl-not-yet", "deployment": public.name, "prompt_tokens": "40",
             "cached_prompt_tokens": "0", "completion_tokens": "200"}
    estimate = ada.get("/playground/cost/", query).json()
    expected = request_cost(prices=Prices.of(model), prompt_tokens=40, cached_prompt_tokens=0, completion_tokens=200)
    assert estimate == {"source": "estimated", "prompt_tokens": 40, "cached_prompt_tokens": 0,
                        "completion_tokens": 200, "cost": str(expected), "status": "completed"}
    billed = record(org, public, prompt_tokens=40, completion_tokens=200, request_id="chatcmpl-recorded")
    answer = ada.get("/playground/cost/", {**query, "request_id": "chatcmpl-recorded"}).json()
    assert answer["source"] == "billed" and Decimal(answer["cost"]) == billed.cost
    # Another organization's record is never read: the figure falls back to an estimate.
    record(globex[1], public, request_id="chatcmpl-theirs", completion_tokens=9999)
    answer = ada.get("/playground/cost/", {**query, "request_id": "chatcmpl-theirs"}).json()
    assert answer["source"] == "estimated" and answer["completion_tokens"] == 200


def test_reply_cost_refuses_bad_counts_and_unknown_deployments(ada, acme, catalog):
    bad = ada.get("/playground/cost/", {"deployment": "smollm2-135m-instruct", "prompt_tokens": "-1"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_value"
    bad = ada.get("/playground/cost/", {"deployment": "smollm2-135m-instruct", "prompt_tokens": "1",
                                        "cached_prompt_tokens": "2"})
    assert bad.status_code == 400
    bad = ada.get("/playground/cost/", {"deployment": "smollm2-135m-instruct", "prompt_tokens": "²"})
    assert bad.status_code == 400  # a digit to str.isdigit, not a number to int()
    unknown = ada.get("/playground/cost/", {"deployment": "nope", "prompt_tokens": "1", "completion_tokens": "1"})
    assert unknown.status_code == 404


def test_reserved_capacity_shows_as_replica_hours_and_not_as_requests(ada, acme, catalog):
    from billing.services import record_usage

    _, org = acme
    _, public = catalog
    key, _ = create_api_key(organization=org, name="svc", scopes=["inference"])
    request = record(org, public, api_key=key, endpoint="/v1/chat/completions")
    record_usage(event={
        "request_id": "capacity-test-minute", "organization_id": org.pk, "api_key_id": None, "deployment_id": public.pk,
        "model": public.model.slug, "deployment": public.name, "prompt_tokens": 0, "cached_prompt_tokens": 0,
        "completion_tokens": 0, "status": "completed", "finished_at": datetime.now(timezone.utc).isoformat(),
        "prices": {"input_per_mtok": "0", "cached_input_per_mtok": "0", "output_per_mtok": "0", "per_request": "0",
                   "per_replica_hour": "2"},
        "endpoint": "reserved capacity", "replica_seconds": 5400,
    })
    response = ada.get("/usage/")
    page = response.content.decode()
    assert response.context["totals"]["requests"] == 1 and response.context["totals"]["cost"] == request.cost + 3
    by_endpoint = page.split('id="usage-by-endpoint"')[1].split("</table>")[0]
    assert "reserved capacity" in by_endpoint and "1.50 replica-hours" in by_endpoint
    assert "capacity-test-minute" not in page  # the latest requests list requests only
    assert "1.50 replica-hours reserved" in page
    # No key reserved it: its own row in the by-key table, not the playground's.
    by_key = page.split('id="usage-by-key"')[1].split("</table>")[0]
    assert "Reserved capacity" in by_key and "Playground" not in by_key


@pytest.mark.parametrize("seconds, shown", [(0, "0.0 replica-minutes"), (8, "0.1 replica-minutes"),
                                            (60, "1.0 replica-minute"), (3599, "60.0 replica-minutes"),
                                            (3600, "1.00 replica-hour"), (5400, "1.50 replica-hours")])
def test_reserved_time_reads_in_minutes_under_an_hour(seconds, shown):
    from dashboard.templatetags.dashboard import replica_hours

    assert replica_hours(seconds) == shown
