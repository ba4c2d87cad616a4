"""``manage.py adjust_balance``: an operator's manual credit or debit, from the command line."""

from __future__ import annotations

import io
from decimal import Decimal

import pytest
from django.core.management import CommandError, call_command

from billing import selectors
from billing.models import LedgerEntry
from tests.billing.conftest import make_organization

pytestmark = pytest.mark.django_db


def adjust(*args) -> str:
    out = io.StringIO()
    call_command("adjust_balance", *args, stdout=out)
    return out.getvalue()


def test_a_credit_by_name_and_a_debit_by_id_are_ledger_entries_the_balance_follows():
    org = make_organization(name="Initech")
    start = selectors.balance(organization=org)
    said = adjust("Initech", "25", "--reason", "Credit for the outage of 3 May")
    assert "+25.000000 USD" in said and f"balance now {start + 25}" in said
    adjust(str(org.pk), "-3.5", "--reason", "Invoice 17 paid twice")
    assert selectors.balance(organization=org) == start + Decimal("21.5")
    adjust(org.slug, "1", "--reason", "By its slug, as the API shows it (owned_by)")
    assert selectors.balance(organization=org) == start + Decimal("22.5")
    entries = LedgerEntry.objects.filter(organization=org, kind=LedgerEntry.Kind.ADJUSTMENT).order_by("pk")
    assert [(e.amount, e.description) for e in entries][:2] == [
        (Decimal("25"), "Credit for the outage of 3 May"), (Decimal("-3.5"), "Invoice 17 paid twice")]


def test_a_reference_makes_it_happen_once():
    org = make_organization(name="Hooli")
    start = selectors.balance(organization=org)
    adjust("Hooli", "10", "--reason", "Wire transfer", "--reference", "INV-2026-0042")
    again = adjust("Hooli", "10", "--reason", "Wire transfer", "--reference", "INV-2026-0042")
    assert "nothing added now" in again
    assert selectors.balance(organization=org) == start + 10


@pytest.mark.parametrize(("args", "says"), [
    (["Nobody Inc", "5", "--reason", "x"], "no organization has the id, name or slug 'Nobody Inc'"),
    (["Twin", "5", "--reason", "x"], "several organizations are named 'Twin'"),
    (["Umbrella", "ten", "--reason", "x"], "amount must be a number of USD"),
    (["Umbrella", "0.0000001", "--reason", "x"], "at most 6 decimals"),
    (["Umbrella", "NaN", "--reason", "x"], "must be finite"),
    (["Umbrella", "0", "--reason", "x"], "cannot be zero"),
    (["Umbrella", "5", "--reason", "  "], "--reason must say why"),
])
def test_bad_input_is_one_clear_line_and_changes_nothing(args, says):
    make_organization(name="Twin"), make_organization(name="Twin"), make_organization(name="Umbrella")
    before = LedgerEntry.objects.count()
    with pytest.raises(CommandError, match=says):
        adjust(*args)
    assert LedgerEntry.objects.count() == before
