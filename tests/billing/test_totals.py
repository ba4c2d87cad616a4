"""The running totals beside the billing rows: what the quota check reads instead of summing the
history, kept equal to the rows, recomputed by ``reconcile_billing``, filled in by the migration."""

from __future__ import annotations

import io
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing import selectors, services, totals
from billing.errors import QuotaExceeded
from billing.models import LedgerEntry, MonthlySpend, OrganizationBalance, UsageRecord
from tests.billing.conftest import make_catalog_model, make_key, make_organization, usage_event

pytestmark = pytest.mark.django_db


def test_micros_are_exact_and_refuse_finer_amounts():
    assert totals.micros(Decimal("-12.345678")) == -12_345_678
    assert totals.usd(-12_345_678) == Decimal("-12.345678") and totals.usd(None) == 0
    with pytest.raises(ValueError):
        totals.micros(Decimal("0.0000001"))


def test_the_quota_check_reads_the_totals_not_the_history(organization, catalog_model):
    api_key, _ = make_key(organization)
    services.set_spend_limit(organization=organization, monthly_limit=Decimal("100"))
    services.set_api_key_spend_limit(api_key=api_key, amount_limit=Decimal("100"), token_limit=10**9)
    for _ in range(3):
        services.record_usage(event=usage_event(organization, api_key=api_key))
    with CaptureQueriesContext(connection) as queries:
        figures = selectors.quota_figures(organization=organization, api_key=api_key)
    assert len(queries) == 1
    sql = queries[0]["sql"]
    assert LedgerEntry._meta.db_table not in sql and UsageRecord._meta.db_table not in sql
    rows = UsageRecord.objects.filter(organization=organization)
    assert figures.balance == sum(e.amount for e in LedgerEntry.objects.filter(organization=organization))
    assert figures.monthly_spend == figures.key_spend.cost == sum(r.cost for r in rows) > 0
    assert figures.key_spend.tokens == sum(r.prompt_tokens + r.completion_tokens for r in rows)


def test_every_kind_of_ledger_entry_moves_the_balance_once(organization):
    start = selectors.balance(organization=organization)
    services.add_adjustment(organization=organization, amount=Decimal("2.5"), description="goodwill", reference="g-1")
    services.add_adjustment(organization=organization, amount=Decimal("2.5"), description="goodwill", reference="g-1")
    services.add_adjustment(organization=organization, amount=Decimal("-0.25"), description="correction")
    assert selectors.balance(organization=organization) == start + Decimal("2.25")
    assert totals.stored(organization_id=organization.pk) == totals.from_rows(organization_id=organization.pk)


def test_usage_counts_toward_the_month_it_finished_in(organization, catalog_model):
    last_month = datetime.now(timezone.utc).replace(day=1) - timedelta(days=2)
    services.record_usage(event=usage_event(organization, finished_at=last_month))
    services.record_usage(event=usage_event(organization))
    months = dict(MonthlySpend.objects.filter(organization=organization).values_list("month", "micros"))
    assert set(months) == {totals.month_of(last_month), selectors.month_start().date()}
    assert selectors.monthly_spend(organization=organization) == totals.usd(months[selectors.month_start().date()])


def _reconcile(*args) -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("reconcile_billing", *args, stdout=out)
    except SystemExit as exc:
        return exc.code, out.getvalue()
    return 0, out.getvalue()


def test_reconcile_finds_and_corrects_totals_that_differ_from_the_rows(organization, catalog_model):
    api_key, _ = make_key(organization)
    services.record_usage(event=usage_event(organization, api_key=api_key))
    healthy = make_organization("Healthy")
    # Rows changed outside the platform's services: a record inserted directly, a total edited.
    UsageRecord.objects.create(request_id="req-raw", organization=organization, api_key=api_key, model="tiny-llama",
                               prompt_tokens=10, completion_tokens=5, status="completed", cost=Decimal("0.25"),
                               created_at=datetime.now(timezone.utc), price_input_per_mtok=0,
                               price_cached_input_per_mtok=0, price_output_per_mtok=0, price_per_request=0)
    OrganizationBalance.objects.filter(organization=organization).update(micros=1)
    truth = totals.from_rows(organization_id=organization.pk)
    assert totals.stored(organization_id=organization.pk) != truth

    status, out = _reconcile("--check")
    assert status == 1 and f"organization {organization.pk}: differs" in out and "monthly spend" in out
    assert f"organization {healthy.pk}:" not in out
    assert OrganizationBalance.objects.get(organization=organization).micros == 1  # --check changes nothing

    status, out = _reconcile("--organization", str(organization.pk))
    assert status == 0 and f"organization {organization.pk}: corrected" in out
    assert totals.stored(organization_id=organization.pk) == truth
    assert selectors.api_key_spend(api_key=api_key).cost == sum(r.cost for r in UsageRecord.objects.all())
    assert _reconcile("--check") == (0, f"{_organizations()} organizations checked, 0 differ.\n")


def _organizations() -> int:
    from accounts.models import Organization

    return Organization.objects.count()


def test_reconcile_finds_nothing_to_correct_after_free_requests(organization, catalog_model):
    free = {name: Decimal(0) for name in ("price_input_per_mtok", "price_cached_input_per_mtok",
                                          "price_output_per_mtok", "price_per_request")}
    make_catalog_model(slug="free-model", **free)
    api_key, _ = make_key(organization)
    services.record_usage(event=usage_event(organization, api_key=api_key, model="free-model"))
    assert totals.stored(organization_id=organization.pk) == totals.from_rows(organization_id=organization.pk)
    assert _reconcile("--check", "--organization", str(organization.pk)) == (
        0, "1 organizations checked, 0 differ.\n")


def test_a_request_that_is_not_billed_uses_up_none_of_its_keys_token_limit(organization, catalog_model):
    """Cancelled or failed before its first output token: free, so its prompt is nobody's tokens."""
    api_key, _ = make_key(organization)
    services.set_api_key_spend_limit(api_key=api_key, token_limit=1500)
    for status in ("cancelled", "failed"):
        services.record_usage(event=usage_event(organization, api_key=api_key, status=status, completion_tokens=0))
    assert selectors.api_key_spend(api_key=api_key).tokens == 0
    services.check_quota(organization=organization, api_key=api_key)  # still allowed
    services.record_usage(event=usage_event(organization, api_key=api_key, status="cancelled", completion_tokens=3))
    assert selectors.api_key_spend(api_key=api_key).tokens == 1003  # billed: its whole prompt and output
    services.record_usage(event=usage_event(organization, api_key=api_key))
    with pytest.raises(QuotaExceeded):
        services.check_quota(organization=organization, api_key=api_key)
    assert totals.stored(organization_id=organization.pk) == totals.from_rows(organization_id=organization.pk)


def test_reconcile_names_an_unknown_organization():
    with pytest.raises(CommandError, match="no organization has id 987654"):
        call_command("reconcile_billing", "--organization", "987654")


@pytest.mark.django_db(transaction=True)
def test_the_migration_fills_the_totals_of_existing_rows():
    from django.db.migrations.executor import MigrationExecutor

    organization = make_organization("Old")
    api_key, _ = make_key(organization)
    before = [("billing", "0001_initial")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    try:
        apps = executor.loader.project_state(before).apps
        old_ledger, old_usage = apps.get_model("billing", "LedgerEntry"), apps.get_model("billing", "UsageRecord")
        old_ledger.objects.create(organization_id=organization.pk, kind="topup", amount=Decimal("10"), reference="pi_1")
        old_ledger.objects.create(organization_id=organization.pk, kind="usage", amount=Decimal("-0.000535"),
                                  reference="req-old")
        old_usage.objects.create(request_id="req-old", organization_id=organization.pk, api_key_id=api_key.pk,
                                 model="tiny-llama", prompt_tokens=1000, completion_tokens=500, status="completed",
                                 cost=Decimal("0.000535"), created_at=datetime.now(timezone.utc),
                                 price_input_per_mtok=0, price_cached_input_per_mtok=0, price_output_per_mtok=0,
                                 price_per_request=0)
    finally:
        # Forward through 0002_running_totals (the migration under test) to the latest: a test
        # database left behind at 0002 fails every later test that writes a usage record.
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
    assert selectors.balance(organization=organization) == Decimal("10") - Decimal("0.000535") + _signup_credit()
    assert selectors.monthly_spend(organization=organization) == Decimal("0.000535")
    assert selectors.api_key_spend(api_key=api_key).tokens == 1500


def _signup_credit() -> Decimal:
    """The sign-up credit the organization got when it was made (a ledger entry like the others)."""
    from django.conf import settings

    return settings.BILLING_SIGNUP_CREDIT


@pytest.mark.django_db(transaction=True)
def test_the_migration_takes_the_tokens_of_unbilled_requests_out_of_the_key_totals():
    from django.db.migrations.executor import MigrationExecutor

    organization = make_organization("Counted")
    api_key, _ = make_key(organization)
    make_catalog_model()
    for status, completion_tokens in (("completed", 500), ("cancelled", 0), ("failed", 0), ("cancelled", 7)):
        services.record_usage(event=usage_event(organization, api_key=api_key, status=status,
                                                completion_tokens=completion_tokens))
    before = [("billing", "0004_ledger_kind_index")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    try:  # as the totals stood before: every request's tokens counted
        apps = executor.loader.project_state(before).apps
        apps.get_model("billing", "ApiKeyTotals").objects.filter(api_key_id=api_key.pk).update(tokens=4 * 1000 + 507)
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
    assert selectors.api_key_spend(api_key=api_key).tokens == 2 * 1000 + 507
    assert totals.stored(organization_id=organization.pk) == totals.from_rows(organization_id=organization.pk)
