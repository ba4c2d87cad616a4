"""Recording usage: idempotent by request id, charged once, exact under concurrency; the sign-up
credit; spend limits and the quota check."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from decimal import ROUND_FLOOR, Decimal

import pytest
from django.db import connection

from billing import selectors, services, totals
from billing.errors import InvalidParameter, InvalidUsageEvent, QuotaExceeded, UnknownModel
from billing.models import LedgerEntry, OrganizationBalance, UsageRecord
from billing.pricing import COST_QUANTUM, EXACT_PLACES, Prices, exact_cost, request_cost
from models_catalog.models import CatalogModel
from tests.billing.conftest import make_catalog_model, make_key, make_organization, usage_event

pytestmark = pytest.mark.django_db

SAMPLE_COST = Decimal("0.000535")  # 1000 prompt (200 cached), 500 completion at the sample prices
SIGNUP = Decimal("5.000000")


def carry_of(organization) -> Decimal:
    """What the organization's usage cost beyond its charges (USD), as stored."""
    return Decimal(OrganizationBalance.objects.get(organization=organization).carry).scaleb(-EXACT_PLACES)


def test_a_new_organization_gets_the_signup_credit_once(organization):
    assert selectors.balance(organization=organization) == SIGNUP
    assert services.grant_signup_credit(organization=organization).amount == SIGNUP
    assert LedgerEntry.objects.filter(organization=organization, kind="signup_credit").count() == 1
    assert selectors.balance(organization=organization) == SIGNUP


def test_signup_credit_follows_the_setting(settings):
    settings.BILLING_SIGNUP_CREDIT = Decimal("0.50")
    assert selectors.balance(organization=make_organization("Small")) == Decimal("0.500000")
    settings.BILLING_SIGNUP_CREDIT = Decimal("0")
    assert selectors.balance(organization=make_organization("None")) == 0


def test_usage_is_recorded_with_prices_applied_and_charged(organization, catalog_model):
    api_key, _ = make_key(organization)
    event = usage_event(organization, api_key=api_key, latency_ms=901.6)
    record = services.record_usage(event=event)
    assert record.cost == SAMPLE_COST
    assert (record.prompt_tokens, record.cached_prompt_tokens, record.completion_tokens) == (1000, 200, 500)
    assert record.price_output_per_mtok == Decimal("0.6") and record.price_per_request == Decimal("0.0001")
    assert record.latency_ms == 902 and record.api_key == api_key
    assert record.created_at == datetime.fromisoformat(event["finished_at"])
    entry = LedgerEntry.objects.get(kind="usage", reference=event["request_id"])
    assert entry.amount == -SAMPLE_COST and entry.organization == organization
    assert selectors.balance(organization=organization) == SIGNUP - SAMPLE_COST


@pytest.mark.parametrize("cut_tokens", [0, 7])  # cut before any output (free), or after some (charged)
def test_a_completed_run_replaces_a_cancelled_record_of_its_id_and_nothing_replaces_a_completed_one(
        organization, catalog_model, cut_tokens):
    """A batch line cut off and run again to the end under the same id is charged for the answer
    it gave, once; the totals follow."""
    api_key, _ = make_key(organization)
    cut = usage_event(organization, api_key=api_key, status="cancelled", completion_tokens=cut_tokens)
    assert (services.record_usage(event=cut).cost > 0) == (cut_tokens > 0)
    api_request = dict(cut, status="completed", completion_tokens=500)  # not a rerun: its record stands
    assert services.record_usage(event=api_request).status == "cancelled"
    whole = dict(cut, status="completed", completion_tokens=500, rerun=True)
    record = services.record_usage(event=whole)
    assert (record.status, record.completion_tokens, record.cost) == ("completed", 500, SAMPLE_COST)
    assert UsageRecord.objects.filter(request_id=cut["request_id"]).count() == 1
    assert [e.amount for e in LedgerEntry.objects.filter(kind="usage", reference=cut["request_id"])] == [-SAMPLE_COST]
    assert selectors.balance(organization=organization) == SIGNUP - SAMPLE_COST
    assert selectors.api_key_spend(api_key=api_key).tokens == 1500
    stored, from_rows = totals.reconcile(organization_id=organization.pk, fix=False)
    assert stored == from_rows
    for later in (cut, dict(whole, completion_tokens=9)):  # a replay, or another run: the answer stands
        assert services.record_usage(event=later).completion_tokens == 500
    assert selectors.balance(organization=organization) == SIGNUP - SAMPLE_COST


def test_requests_cheaper_than_a_micro_dollar_are_charged_together(organization):
    """25 embeddings of three tokens at 0.05 USD per million cost 3.75 micro-dollars: 3 charged,
    0.75 carried to the next request. Rounded one by one (0.15 each) they would cost nothing."""
    make_catalog_model(slug="embedder", price_input_per_mtok=Decimal("0.05"), price_cached_input_per_mtok=0,
                       price_output_per_mtok=0, price_per_request=0)
    for _ in range(25):
        services.record_usage(event=usage_event(organization, model="embedder", prompt_tokens=3,
                                                cached_prompt_tokens=0, completion_tokens=0))
    costs = list(UsageRecord.objects.values_list("cost", flat=True))
    assert sum(costs) == Decimal("0.000003") and set(costs) == {0, Decimal("0.000001")}
    assert selectors.balance(organization=organization) == SIGNUP - Decimal("0.000003")
    assert carry_of(organization) == Decimal("0.00000075")
    assert LedgerEntry.objects.filter(kind="usage").count() == 3  # a usage entry is never zero
    stored, from_rows = totals.reconcile(organization_id=organization.pk, fix=False)
    assert stored == from_rows


def test_a_replaced_record_keeps_charges_and_carry_at_the_exact_costs(organization):
    """A cut run's charge is given back and the whole run's charged, through the same carry."""
    make_catalog_model(slug="cheap", price_input_per_mtok=Decimal("0.3"), price_cached_input_per_mtok=0,
                       price_output_per_mtok=Decimal("0.7"), price_per_request=0)
    tokens = {"model": "cheap", "prompt_tokens": 3, "cached_prompt_tokens": 0}
    cut = usage_event(organization, status="cancelled", completion_tokens=1, **tokens)  # 1.6 micro-dollars
    services.record_usage(event=usage_event(organization, completion_tokens=0, **tokens))  # 0.9
    services.record_usage(event=cut)
    services.record_usage(event=dict(cut, status="completed", completion_tokens=4, rerun=True))  # 3.7
    charged = sum(UsageRecord.objects.values_list("cost", flat=True))
    assert charged == Decimal("0.000004") and carry_of(organization) == Decimal("0.0000006")
    assert selectors.balance(organization=organization) == SIGNUP - charged


@pytest.mark.parametrize("cut_tokens", [0, 7])
def test_a_rerun_that_costs_nothing_leaves_no_usage_entry(organization, catalog_model, cut_tokens):
    """A usage entry is never zero: a free completed rerun (a cheap model's few tokens, rounded to
    nothing) removes the cut run's entry, or writes none."""
    cut = usage_event(organization, status="cancelled", completion_tokens=cut_tokens)
    services.record_usage(event=cut)
    free = {name: "0" for name in ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok", "per_request")}
    record = services.record_usage(event=dict(cut, status="completed", completion_tokens=500, prices=free, rerun=True))
    assert (record.status, record.cost) == ("completed", 0)
    assert not LedgerEntry.objects.filter(kind="usage", reference=cut["request_id"]).exists()
    assert selectors.balance(organization=organization) == SIGNUP
    stored, from_rows = totals.reconcile(organization_id=organization.pk, fix=False)
    assert stored == from_rows


def test_the_same_event_twice_bills_once(organization, catalog_model):
    event = usage_event(organization)
    first = services.record_usage(event=event)
    second = services.record_usage(event=dict(event, completion_tokens=9999))  # a redelivery never rewrites
    assert first.pk == second.pk and second.completion_tokens == 500
    assert UsageRecord.objects.filter(request_id=event["request_id"]).count() == 1
    assert LedgerEntry.objects.filter(kind="usage", reference=event["request_id"]).count() == 1
    assert selectors.balance(organization=organization) == SIGNUP - SAMPLE_COST


def test_an_event_is_recorded_in_ten_statements_and_a_redelivery_in_eight(organization, catalog_model,
                                                                         django_assert_max_num_queries):
    """Every request ends in one of these: validate (one query), then the balance's row taken and
    its carry read, the record, its charge and the three totals in one transaction. A redelivery
    rolls back at the record and reads the first."""
    from models_catalog.services import create_deployment

    api_key, _ = make_key(organization)
    deployment = create_deployment(organization=organization, model=catalog_model, name="counted")
    services.record_usage(event=usage_event(organization, api_key=api_key))  # the catalog model's read cached
    event = usage_event(organization, api_key=api_key, deployment=deployment)
    with django_assert_max_num_queries(10):  # in a test's transaction BEGIN/COMMIT are a savepoint's
        first = services.record_usage(event=event)
    with django_assert_max_num_queries(8):  # its savepoint is rolled back and released
        assert services.record_usage(event=event).pk == first.pk
    assert first.api_key == api_key and first.deployment == deployment
    assert LedgerEntry.objects.filter(kind="usage", reference=event["request_id"]).count() == 1
    assert selectors.api_key_totals(api_keys=[api_key])[api_key.pk][2] == 2


def test_an_event_for_a_deleted_key_is_recorded_without_it(organization, catalog_model):
    api_key, _ = make_key(organization)
    event = usage_event(organization, api_key=api_key)
    api_key.delete()
    record = services.record_usage(event=event)
    assert record.api_key_id is None and record.cost == SAMPLE_COST
    assert selectors.balance(organization=organization) == SIGNUP - SAMPLE_COST


def test_prices_are_a_snapshot(organization, catalog_model):
    record = services.record_usage(event=usage_event(organization))
    catalog_model.price_output_per_mtok = Decimal("99")
    catalog_model.save()
    record.refresh_from_db()
    assert record.price_output_per_mtok == Decimal("0.6") and record.cost == SAMPLE_COST


def test_an_event_is_billed_at_the_prices_it_carries_and_one_without_at_the_catalogs(organization, catalog_model):
    """The price changed while the events waited in the billing queue: a request carries the prices
    of its admission; an event without them (queued across the upgrade) gets the catalog's now."""
    from models_catalog.services import update_catalog_model

    admitted = dict(usage_event(organization), prices=Prices.of(catalog_model).as_strings())
    older = usage_event(organization)
    update_catalog_model(catalog_model=catalog_model, price_input_per_mtok=Decimal("1.5"),
                         price_output_per_mtok=Decimal("6"), price_per_request=Decimal("0.01"))

    record = services.record_usage(event=admitted)
    assert (record.price_input_per_mtok, record.price_cached_input_per_mtok, record.price_output_per_mtok,
            record.price_per_request) == (Decimal("0.15"), Decimal("0.075"), Decimal("0.6"), Decimal("0.0001"))
    assert record.cost == SAMPLE_COST
    assert LedgerEntry.objects.get(kind="usage", reference=admitted["request_id"]).amount == -SAMPLE_COST

    fallback = services.record_usage(event=older)  # 800 x 1.5 + 200 x 0.075 + 500 x 6 per million, + 0.01
    assert (fallback.price_input_per_mtok, fallback.price_output_per_mtok) == (Decimal("1.5"), Decimal("6"))
    assert fallback.cost == Decimal("0.014215")
    assert selectors.balance(organization=organization) == SIGNUP - SAMPLE_COST - Decimal("0.014215")


def test_an_event_with_prices_is_recorded_though_its_model_left_the_catalog_since(organization, catalog_model):
    event = dict(usage_event(organization), prices=Prices.of(catalog_model).as_strings())
    catalog_model.delete()
    assert services.record_usage(event=event).cost == SAMPLE_COST
    with pytest.raises(UnknownModel):  # without prices there is nothing to bill it at
        services.record_usage(event=usage_event(organization))


def test_a_cancelled_request_without_output_is_free(organization, catalog_model):
    record = services.record_usage(event=usage_event(organization, status="cancelled", completion_tokens=0))
    assert record.cost == 0
    assert not LedgerEntry.objects.filter(kind="usage").exists()
    assert selectors.balance(organization=organization) == SIGNUP


def test_deleting_a_deployment_keeps_its_usage(organization, catalog_model):
    from models_catalog.services import create_deployment, delete_deployment

    deployment = create_deployment(organization=organization, model=catalog_model, name="acme-tiny")
    record = services.record_usage(event=usage_event(organization, deployment=deployment))
    delete_deployment(deployment=deployment)
    record.refresh_from_db()
    assert record.deployment is None and record.deployment_name == "acme-tiny" and record.cost == SAMPLE_COST


def test_an_event_for_a_deployment_already_deleted_is_still_recorded(organization, catalog_model):
    from models_catalog.services import create_deployment, delete_deployment

    deployment = create_deployment(organization=organization, model=catalog_model, name="gone")
    event = usage_event(organization, deployment=deployment)
    delete_deployment(deployment=deployment)
    record = services.record_usage(event=event)
    assert record.deployment_id is None and record.deployment_name == "gone"


def test_permanent_errors_write_nothing(organization, other_organization, catalog_model):
    other_key, _ = make_key(other_organization)
    with pytest.raises(UnknownModel):
        services.record_usage(event=usage_event(organization, model="no-such-model"))
    with pytest.raises(InvalidUsageEvent) as caught:
        services.record_usage(event=usage_event(organization, api_key=other_key))
    assert caught.value.field == "api_key_id"
    with pytest.raises(InvalidUsageEvent) as caught:
        services.record_usage(event=dict(usage_event(organization), organization_id=10**9))
    assert caught.value.field == "organization_id"
    with pytest.raises(InvalidUsageEvent):
        services.record_usage(event=dict(usage_event(organization), prompt_tokens=1.5))
    assert not UsageRecord.objects.exists() and not LedgerEntry.objects.filter(kind="usage").exists()


def test_the_database_refuses_a_second_charge_for_the_same_request(organization):
    from django.db import IntegrityError, transaction

    LedgerEntry.objects.create(organization=organization, kind="usage", amount=Decimal("-1"), reference="req-x")
    with pytest.raises(IntegrityError), transaction.atomic():
        LedgerEntry.objects.create(organization=organization, kind="usage", amount=Decimal("-1"), reference="req-x")
    with pytest.raises(IntegrityError), transaction.atomic():  # a charge is negative
        LedgerEntry.objects.create(organization=organization, kind="usage", amount=Decimal("1"), reference="req-y")


# --- concurrency (threads with their own database connections) ----------------------------------


def _run_concurrently(events: list[dict]) -> list[BaseException]:
    barrier = threading.Barrier(len(events))
    errors: list[BaseException] = []

    def work(event):
        try:
            barrier.wait(timeout=30)
            services.record_usage(event=event)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=work, args=(event,)) for event in events]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return errors


@pytest.mark.django_db(transaction=True)
def test_fifty_concurrent_charges_leave_the_exact_balance():
    organization = make_organization("Busy")
    make_catalog_model()
    keys = [make_key(organization, name=f"key {i}")[0] for i in range(2)] + [None]
    events = [usage_event(organization, prompt_tokens=1000 + i, cached_prompt_tokens=i, completion_tokens=3 * i + 1,
                          api_key=keys[i % 3]) for i in range(50)]
    assert _run_concurrently(events) == []
    prices = Prices.of(CatalogModel.objects.get(slug="tiny-llama"))
    exact = sum((exact_cost(prices=prices, prompt_tokens=e["prompt_tokens"], cached_prompt_tokens=e["cached_prompt_tokens"],
                            completion_tokens=e["completion_tokens"]) for e in events), Decimal(0))
    assert UsageRecord.objects.count() == 50
    assert LedgerEntry.objects.filter(kind="usage").count() == 50
    # Each charge read the carry the one before it left: together they are the exact cost, rounded down.
    charged = exact.quantize(COST_QUANTUM, rounding=ROUND_FLOOR)
    assert selectors.balance(organization=organization) == SIGNUP - charged
    assert carry_of(organization) == exact - charged
    # The running totals the quota check reads add up to the rows, per key too.
    stored = totals.stored(organization_id=organization.pk)
    assert stored == totals.from_rows(organization_id=organization.pk) and len(stored.keys) == 2


@pytest.mark.django_db(transaction=True)
def test_concurrent_redeliveries_of_the_same_events_charge_once_each():
    organization = make_organization("Racy")
    make_catalog_model()
    distinct = [usage_event(organization) for _ in range(10)]
    assert _run_concurrently([event for event in distinct for _ in range(5)]) == []
    assert UsageRecord.objects.count() == 10
    assert LedgerEntry.objects.filter(kind="usage").count() == 10
    assert selectors.balance(organization=organization) == SIGNUP - 10 * SAMPLE_COST


# --- quota ------------------------------------------------------------------------------------------


def test_check_quota_passes_with_credit(organization):
    services.check_quota(organization=organization)


def test_zero_balance_raises_insufficient_quota(organization):
    services.add_adjustment(organization=organization, amount=-SIGNUP, description="use it all")
    assert selectors.balance(organization=organization) == 0
    with pytest.raises(QuotaExceeded) as caught:
        services.check_quota(organization=organization)
    assert caught.value.code == "insufficient_quota" and caught.value.status == 429


@pytest.mark.parametrize("keys, remedy", [(("sk_test_x", "pk_test_x"), "Top up your credits on the dashboard's billing page"),
                                          (("", ""), "ask its operator to credit your organization"),
                                          (("sk_test_x", ""), "ask its operator to credit your organization")])
def test_an_empty_balance_says_how_to_add_credit_here(organization, settings, keys, remedy):
    settings.STRIPE_SECRET_KEY, settings.STRIPE_PUBLISHABLE_KEY = keys
    services.add_adjustment(organization=organization, amount=-SIGNUP, description="use it all")
    with pytest.raises(QuotaExceeded) as caught:
        services.check_quota(organization=organization)
    assert remedy in caught.value.message


def test_usage_that_exhausts_the_credit_blocks_the_next_request(organization):
    make_catalog_model(slug="pricey", price_per_request=Decimal("5"))
    services.record_usage(event=usage_event(organization, model="pricey"))
    assert selectors.balance(organization=organization) < 0
    with pytest.raises(QuotaExceeded):
        services.check_quota(organization=organization)


def test_monthly_limit_counts_this_months_usage_only(organization, catalog_model):
    services.set_spend_limit(organization=organization, monthly_limit=Decimal("0.001"))
    last_month = datetime.now(timezone.utc).replace(day=1) - timedelta(days=2)
    services.record_usage(event=usage_event(organization, finished_at=last_month))
    services.record_usage(event=usage_event(organization, finished_at=last_month))
    services.check_quota(organization=organization)  # last month's 0.00107 does not count
    services.record_usage(event=usage_event(organization))
    services.check_quota(organization=organization)  # 0.000535 < 0.001
    services.record_usage(event=usage_event(organization))
    with pytest.raises(QuotaExceeded, match="monthly spend limit") as caught:
        services.check_quota(organization=organization)
    assert caught.value.code == "insufficient_quota"
    services.set_spend_limit(organization=organization, monthly_limit=None)
    services.check_quota(organization=organization)


def test_key_limits_are_computed_from_its_own_usage(organization, catalog_model):
    key, _ = make_key(organization)
    other_key, _ = make_key(organization, name="other")
    services.set_api_key_spend_limit(api_key=key, token_limit=3000)
    services.record_usage(event=usage_event(organization, api_key=key))  # 1500 tokens
    services.record_usage(event=usage_event(organization, api_key=other_key))
    services.check_quota(organization=organization, api_key=key)
    services.record_usage(event=usage_event(organization, api_key=key))  # 3000 tokens
    with pytest.raises(QuotaExceeded, match="token limit"):
        services.check_quota(organization=organization, api_key=key)
    services.check_quota(organization=organization, api_key=other_key)
    services.check_quota(organization=organization)

    services.set_api_key_spend_limit(api_key=other_key, amount_limit=Decimal("0.000535"))
    with pytest.raises(QuotaExceeded, match="spend limit"):
        services.check_quota(organization=organization, api_key=other_key)


def test_adjustments_with_a_reference_apply_once(organization, other_organization):
    services.add_adjustment(organization=organization, amount=Decimal("2.5"), description="goodwill", reference="t-1")
    services.add_adjustment(organization=organization, amount=Decimal("2.5"), description="goodwill", reference="t-1")
    assert selectors.balance(organization=organization) == SIGNUP + Decimal("2.5")
    with pytest.raises(InvalidParameter) as reused:  # silently crediting nobody is worse than refusing
        services.add_adjustment(organization=other_organization, amount=Decimal("1"), description="x", reference="t-1")
    assert reused.value.param == "reference" and selectors.balance(organization=other_organization) == SIGNUP
    with pytest.raises(InvalidParameter):
        services.add_adjustment(organization=organization, amount=Decimal("1e40"), description="huge")
    with pytest.raises(InvalidParameter):
        services.add_adjustment(organization=organization, amount=2.5, description="float")


@pytest.mark.parametrize("deployment, description", [("", "tiny-llama"), ("tiny-llama", "tiny-llama"),
                                                     ("team-llama", "tiny-llama on team-llama")])
def test_a_usage_charge_names_its_model_and_a_deployment_named_otherwise(organization, catalog_model,
                                                                         deployment, description):
    event = {**usage_event(organization), "deployment": deployment}
    services.record_usage(event=event)
    entry = LedgerEntry.objects.get(reference=event["request_id"])
    assert entry.description == description
