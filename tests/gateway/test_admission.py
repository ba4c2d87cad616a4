"""The checks before dispatch: their order, the one-query quota figures, and the admission threads."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from types import SimpleNamespace

import pytest

CHAT = "/v1/chat/completions"


def post(client, body, key=None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, str) else json.dumps(body)
    return client.post(CHAT, data=data, content_type="application/json", **headers)


def chat(model="smollm2-135m-instruct"):
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}]}


def record(org, model_slug, *, api_key=None, tokens=(1000, 500), finished_at=None):
    from billing.services import record_usage

    return record_usage(event={
        "request_id": f"req-{uuid.uuid4().hex}", "organization_id": org.pk,
        "api_key_id": api_key.pk if api_key is not None else None, "deployment_id": None,
        "model": model_slug, "deployment": "", "prompt_tokens": tokens[0], "cached_prompt_tokens": 0,
        "completion_tokens": tokens[1], "status": "completed", "queue_ms": 1, "ttft_ms": 2, "latency_ms": 3,
        "finished_at": (finished_at or datetime.now(timezone.utc)).isoformat(),
    })


# --- the order in which a client sees refusals ----------------------------------------------------


@pytest.mark.django_db
def test_a_bad_key_is_reported_before_a_bad_body(client, seeded):
    response = post(client, "{not json", key="sk-not-a-real-key")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.django_db
def test_a_bad_body_is_reported_before_an_unknown_model(client, seeded, org_key):
    _, _, plaintext = org_key()
    response = post(client, {"model": "no-such-model", "messages": [], "temperature": 9}, key=plaintext)
    assert response.status_code == 400 and response.json()["error"]["param"] in ("messages", "temperature")


@pytest.mark.django_db
def test_an_unknown_model_is_reported_before_an_empty_balance(client, seeded, broke_org_key):
    _, _, plaintext = broke_org_key
    assert post(client, chat(model="no-such-model"), key=plaintext).status_code == 404
    assert post(client, chat(), key=plaintext).json()["error"]["code"] == "insufficient_quota"


@pytest.mark.django_db
@pytest.mark.parametrize("limit", ["token_limit", "amount_limit", "monthly_limit"])
def test_a_spend_limit_reached_is_refused_before_dispatch(client, seeded, org_key, limit):
    from billing.models import UsageRecord
    from billing.services import set_api_key_spend_limit, set_spend_limit

    org, key, plaintext = org_key()
    if limit == "monthly_limit":
        set_spend_limit(organization=org, monthly_limit=Decimal("0"))
    else:
        set_api_key_spend_limit(api_key=key, **{limit: Decimal("0") if limit == "amount_limit" else 0})
    response = post(client, chat(), key=plaintext)
    assert response.status_code == 429, response.content
    assert response.json()["error"]["code"] == "insufficient_quota"
    assert "limit" in response.json()["error"]["message"]
    assert not UsageRecord.objects.filter(organization=org).exists()


# --- the quota figures: one query, the same figures as the selectors ------------------------------


@pytest.mark.django_db
def test_without_limits_only_the_balance_is_computed(seeded, org_key):
    from billing import selectors

    org, key, _ = org_key()
    figures = selectors.quota_figures(organization=org, api_key=key)
    assert figures.balance == selectors.balance(organization=org) > 0
    assert (figures.monthly_limit, figures.monthly_spend, figures.key_spend) == (None, None, None)


@pytest.mark.django_db
def test_with_limits_the_figures_equal_the_selectors(seeded, org_key):
    from billing import selectors
    from billing.models import UsageRecord
    from billing.services import set_api_key_spend_limit, set_spend_limit
    from models_catalog.models import Deployment

    slug = Deployment.objects.get(name=seeded).model.slug
    org, key, _ = org_key()
    _, other_key, _ = org_key()  # another organization's usage never counts
    set_spend_limit(organization=org, monthly_limit=Decimal("12.5"))
    set_api_key_spend_limit(api_key=key, amount_limit=Decimal("3"), token_limit=10**9)
    last_month = datetime.now(timezone.utc).replace(day=1) - timedelta(days=3)
    record(org, slug, api_key=key, finished_at=last_month)
    record(org, slug, api_key=key, tokens=(123, 45))
    record(org, slug, tokens=(7, 8))  # no key: the organization's, not the key's
    record(other_key.organization, slug, api_key=other_key)

    figures = selectors.quota_figures(organization=org, api_key=key)
    assert figures.balance == selectors.balance(organization=org)
    assert figures.monthly_limit == Decimal("12.5")
    assert figures.monthly_spend == selectors.monthly_spend(organization=org) > 0
    this_month = UsageRecord.objects.filter(organization=org, created_at__gte=selectors.month_start())
    assert figures.monthly_spend == sum(r.cost for r in this_month)  # last month's record is not in it
    assert (figures.key_amount_limit, figures.key_token_limit) == (Decimal("3"), 10**9)
    assert figures.key_spend == selectors.api_key_spend(api_key=key)
    assert figures.key_spend.cost == sum(r.cost for r in UsageRecord.objects.filter(api_key=key))
    assert figures.key_spend.tokens == 1000 + 500 + 123 + 45


# --- admission threads ----------------------------------------------------------------------------


@pytest.fixture
def admission_thread(monkeypatch):
    """The server's setting (gateway.admission.use_threads), one thread; its connection closed after."""
    from gateway import admission

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-admission")
    monkeypatch.setattr(admission, "_executor", executor)
    yield admission
    executor.submit(_close_connections).result()  # the test database is dropped at the end
    executor.shutdown()


def _close_connections():
    from django.db import connections

    connections.close_all()


def _backend_id():
    """The thread, the DB-API connection object and the database's own id for it."""
    import threading

    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()" if connection.vendor == "postgresql" else "SELECT 1")
        return threading.current_thread().name, connection.connection, cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_admission_threads_keep_their_database_connection(admission_thread):
    first = asyncio.run(admission_thread.run(_backend_id))
    second = asyncio.run(admission_thread.run(_backend_id))
    assert first[0].startswith("gateway-admission") and first[0] == second[0]
    assert first[1] is second[1] and first[2] == second[2]


def _break_the_connection():
    from django.db import connection

    _backend_id()
    connection.connection.close()  # as a database restart would
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


@pytest.mark.django_db(transaction=True)
def test_a_broken_connection_is_replaced_after_the_trip_that_found_it(admission_thread):
    from django.db import Error

    before = asyncio.run(admission_thread.run(_backend_id))
    with pytest.raises(Error):
        asyncio.run(admission_thread.run(_break_the_connection))
    after = asyncio.run(admission_thread.run(_backend_id))
    assert after[1] is not before[1]


def test_server_timing_round_trips():
    from gateway.timing import Stages, parse

    stages = Stages()
    for name in ("auth", "admit", "auth"):
        stages.mark(name)
    parsed = parse(stages.header())
    assert list(parsed) == ["auth", "admit"] and all(ms >= 0 for ms in parsed.values())
    assert parse("cache;desc=hit, db;dur=53.2, bad;dur=x") == {"db": 53.2}


# --- the deployment's queue limit ---------------------------------------------------------------


@pytest.fixture
def waiting_requests(settings):
    """Count n stand-in requests among a deployment's waiting ones (admitted, no first token yet)."""
    from workers import dispatch, fleet

    filled = []

    def fill(name, n, *, admitted_ms=None):
        key = dispatch.waiting_key(name)
        fleet.client().delete(key)
        now = int(time.time() * 1000) if admitted_ms is None else admitted_ms
        if n:
            fleet.client().zadd(key, {f"waiting-{i}": now for i in range(n)})
        filled.append(key)
        return key

    yield fill
    for key in filled:
        fleet.client().delete(key)


def waiting_ids(key) -> set[str]:
    from workers import fleet

    return set(fleet.client().zrange(key, 0, -1))  # a client that decodes


@pytest.mark.django_db
def test_a_full_deployment_queue_is_refused_with_429(client, seeded, org_key, waiting_requests):
    from billing.models import UsageRecord
    from models_catalog.models import Deployment

    org, _, plaintext = org_key()
    deployment = Deployment.objects.get(name="smollm2-135m-instruct")
    deployment.queue_limit = 2
    deployment.save(update_fields=["queue_limit"])
    waiting_requests("smollm2-135m-instruct", 2)
    response = post(client, chat(), key=plaintext)
    assert response.status_code == 429, response.content
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("queue_full", "server_error") and "2 requests waiting" in error["message"]
    assert response["Retry-After"] == "1" and response["x-request-id"].startswith("chatcmpl-")
    assert not UsageRecord.objects.filter(organization=org).exists()


@pytest.mark.django_db
def test_the_queue_limit_counts_the_requests_waiting_and_a_refusal_counts_nowhere(seeded, org_key,
                                                                                  waiting_requests):
    import redis
    from django.conf import settings

    from gateway import calls
    from gateway.errors import ApiError

    org, key, _ = org_key()
    caller = calls.Caller(api_key=key, organization=org)
    spec = {"name": "smollm2-135m-instruct"}
    waiting = waiting_requests("smollm2-135m-instruct", 2)
    assert calls._admit(caller, spec, 3, "req-one-place-left").allowed
    with pytest.raises(ApiError) as refused:
        calls._admit(caller, spec, 3, "req-queue-full")  # the one admitted took the last place
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    windows = redis.Redis.from_url(settings.REDIS_URL)
    assert [m.decode() for m in windows.zrange(f"rl:key:{key.pk}:req", 0, -1)] == ["req-one-place-left"]
    assert waiting_ids(waiting) == {"waiting-0", "waiting-1", "req-one-place-left"}


@pytest.mark.django_db
def test_a_burst_gets_exactly_the_queue_limit_and_a_wait_too_old_to_be_real_counts_no_more(
        seeded, org_key, waiting_requests):
    """Admission and joining the waiting requests are one step: a burst never overshoots the
    limit. A waiting request admitted longer ago than any gateway waits (its gateway died before
    it could let it go) is let go."""
    from gateway import calls
    from gateway.errors import ApiError
    from workers import dispatch

    org, key, _ = org_key()
    caller = calls.Caller(api_key=key, organization=org)
    spec = {"name": "smollm2-135m-instruct"}
    long_ago = int((time.time() - dispatch.longest_wait() - 5) * 1000)
    waiting = waiting_requests("smollm2-135m-instruct", 3, admitted_ms=long_ago)
    admitted = [calls._admit(caller, spec, 3, f"req-burst-{i}").allowed for i in range(3)]
    with pytest.raises(ApiError) as refused:
        calls._admit(caller, spec, 3, "req-burst-3")
    assert admitted == [True] * 3 and refused.value.code == "queue_full"
    assert waiting_ids(waiting) == {f"req-burst-{i}" for i in range(3)}


@pytest.mark.django_db
@pytest.mark.parametrize("event, leaves", [("inference.started", False), ("inference.delta", True),
                                           ("inference.error", True), (None, True)])
def test_a_request_waits_until_its_first_token_its_end_or_its_cancel(seeded, org_key, waiting_requests, monkeypatch,
                                                                     event, leaves):
    """A request a worker took but has not started (its engine full, its model loading) still
    waits; its first token, an error or its gateway giving up on it (None: a cancel) end that."""
    from gateway import calls

    org, key, _ = org_key()
    waiting = waiting_requests("smollm2-135m-instruct", 0)
    call = calls.Call(caller=calls.Caller(api_key=key, organization=org), request=None,
                      spec={"name": "smollm2-135m-instruct"}, request_id="req-waits", reply_channel="reply",
                      headers={}, stages=calls.Stages())
    assert calls._admit(call.caller, call.spec, 5, call.request_id).allowed

    class Layer:
        async def receive(self, channel):
            return {"type": event}

    monkeypatch.setattr(calls, "get_channel_layer", lambda: Layer())
    monkeypatch.setattr(calls, "_send_cancel", lambda request_id, void=False: asyncio.sleep(0, True))
    asyncio.run(call._receive(1) if event else call.cancel())
    assert ("req-waits" in waiting_ids(waiting)) is not leaves


@pytest.mark.django_db
def test_a_batch_request_counts_against_no_rate_limit_and_leaves_the_api_its_share_of_the_queue(
        seeded, org_key, waiting_requests, settings):
    import redis

    from gateway import calls
    from gateway.errors import ApiError

    org, key, _ = org_key()
    caller = calls.Caller(api_key=key, organization=org)
    spec = {"name": "smollm2-135m-instruct"}
    settings.RATE_LIMIT_KEY_RPM, settings.BATCH_QUEUE_PERCENT = 1, 50
    waiting_requests("smollm2-135m-instruct", 0)
    assert calls._admit(caller, spec, 10, "req-api").allowed  # the key's one request this minute
    with pytest.raises(ApiError) as limited:
        calls._admit(caller, spec, 10, "req-api-2")
    assert limited.value.code == "rate_limit_exceeded"
    batch = calls._admit(caller, spec, 10, "req-batch", batch=True)
    assert batch.allowed and batch.headers == {}
    windows = redis.Redis.from_url(settings.REDIS_URL)
    assert [m.decode() for m in windows.zrange(f"rl:key:{key.pk}:req", 0, -1)] == ["req-api"]  # not the batch's

    waiting_requests("smollm2-135m-instruct", 5)  # half the queue limit of 10
    with pytest.raises(ApiError) as full:
        calls._admit(caller, spec, 10, "req-batch-2", batch=True)
    assert (full.value.status, full.value.code) == (429, "queue_full")
    settings.RATE_LIMIT_KEY_RPM = 100
    assert calls._admit(caller, spec, 10, "req-api-3").allowed  # the other half is the API's


def test_a_known_key_and_deployment_are_read_from_the_database_once(org_key, seeded, django_assert_num_queries):
    from gateway import calls
    from inference_platform import read_cache

    org, key, plaintext = org_key()
    header = f"Bearer {plaintext}"

    def identify():
        with read_cache.pinned():
            caller = calls.authenticate_sync(header)
            return caller, calls._deployment_spec(caller, "smollm2-135m-instruct")

    first_caller, first_route = identify()
    with django_assert_num_queries(0):
        caller, route = identify()
    assert caller.api_key.pk == key.pk and route == first_route and route[0]["name"] == "smollm2-135m-instruct"
    # A change to the deployment (any process's) and the next request reads it again.
    from models_catalog.models import Deployment

    deployment = Deployment.objects.get(name="smollm2-135m-instruct")
    deployment.queue_limit = first_route.queue_limit + 1
    deployment.save(update_fields=["queue_limit"])
    assert identify()[1].queue_limit == first_route.queue_limit + 1


def test_a_request_carries_its_models_prices_at_admission_and_a_price_change_reaches_the_next(org_key, seeded):
    """The prices come with the route (the deployment's one read, cached), and a change in the
    catalog invalidates it like any change to the model: the next request is billed at the new ones."""
    from gateway import calls
    from inference_platform import read_cache
    from models_catalog.models import CatalogModel
    from models_catalog.services import update_catalog_model

    org, key, _ = org_key()
    caller = calls.Caller(api_key=key, organization=org)

    def admitted() -> dict:
        with read_cache.pinned():
            route = calls._deployment_spec(caller, seeded)
        call = calls.Call(caller=caller, request=SimpleNamespace(payload=dict, user=None, stream=False), spec=route.spec,
                          request_id="chatcmpl-prices", reply_channel="reply", headers={}, stages=None,
                          prices=route.prices)
        return call.payload()["prices"]

    model = CatalogModel.objects.get(deployments__name=seeded)
    before = admitted()
    assert before == {"input_per_mtok": format(model.price_input_per_mtok, "f"),
                      "cached_input_per_mtok": format(model.price_cached_input_per_mtok, "f"),
                      "output_per_mtok": format(model.price_output_per_mtok, "f"),
                      "per_request": format(model.price_per_request, "f")}
    assert all(type(price) is str for price in before.values())
    update_catalog_model(catalog_model=model, price_output_per_mtok=Decimal("0.25"))
    assert admitted() == {**before, "output_per_mtok": "0.250000"}


def _signed_in(user) -> str:
    """A session signing ``user`` in, as the dashboard's login makes it; its key."""
    from django.contrib.auth import login
    from django.contrib.sessions.backends.db import SessionStore
    from django.test import RequestFactory

    request = RequestFactory().get("/")
    request.session = SessionStore()
    login(request, user, backend="django.contrib.auth.backends.ModelBackend")
    request.session.save()
    return request.session.session_key


def test_a_dashboard_user_removed_or_deactivated_is_refused_from_the_next_websocket_request(db):
    """The playground's socket is authenticated once, by session; each request checks it again."""
    from accounts import services
    from gateway import calls
    from gateway.errors import ApiError

    owner = services.create_user(email=f"o-{uuid.uuid4().hex[:8]}@example.com", password="a long password 1")
    org = services.create_organization(name=f"org-{uuid.uuid4().hex[:8]}", owner=owner)
    member = services.create_user(email=f"m-{uuid.uuid4().hex[:8]}@example.com", password="a long password 2")
    services.add_member(organization=org, user=member)
    callers = {user: calls.Caller(api_key=None, organization=org, user_id=user.pk, session_key=_signed_in(user))
               for user in (owner, member)}
    for caller in callers.values():
        assert calls.session_caller(caller) is caller
    services.remove_member(organization=org, user=member)
    owner.is_active = False
    owner.save(update_fields=["is_active"])
    for caller in callers.values():
        with pytest.raises(ApiError) as refused:
            calls.session_caller(caller)
        assert refused.value.status == 401


def test_a_websocket_opened_by_a_session_is_refused_once_it_signs_out_or_the_password_changes(db):
    from django.contrib.sessions.backends.db import SessionStore

    from accounts import services
    from gateway import calls
    from gateway.errors import ApiError

    user = services.create_user(email=f"u-{uuid.uuid4().hex[:8]}@example.com", password="a long password 3")
    org = services.create_organization(name=f"org-{uuid.uuid4().hex[:8]}", owner=user)
    signed_out, password_changed = _signed_in(user), _signed_in(user)
    for key in (signed_out, password_changed):
        assert calls.session_caller(calls.Caller(api_key=None, organization=org, user_id=user.pk, session_key=key))
    SessionStore(session_key=signed_out).delete()  # what logout does
    with pytest.raises(ApiError) as refused:
        calls.session_caller(calls.Caller(api_key=None, organization=org, user_id=user.pk, session_key=signed_out))
    assert refused.value.code == "invalid_session"
    user.set_password("another long password")  # a reset: the session's password hash no longer matches
    user.save()
    with pytest.raises(ApiError):
        calls.session_caller(calls.Caller(api_key=None, organization=org, user_id=user.pk,
                                          session_key=password_changed))
