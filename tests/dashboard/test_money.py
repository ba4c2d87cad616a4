"""How the dashboard writes money: exact to the micro-dollar; below a cent, all six decimals so that
a column's small costs line up ($0.000010 beside $0.000031, not $0.00001); zero and amounts from a
cent, trailing zeros trimmed past the cents. The playground's formatUsd follows the same rule."""

from __future__ import annotations

import json
import shutil
import subprocess
from decimal import Decimal

import pytest

from dashboard.templatetags.dashboard import per_mtok, signed_usd, usd, usd_exact
from tests.support import REPO_ROOT


AMOUNTS = [
    ("0.00001", "$0.000010"),
    ("0.000031", "$0.000031"),
    ("0.000001", "$0.000001"),
    ("0.009999", "$0.009999"),
    ("0.0001", "$0.000100"),
    ("0", "$0.00"),
    ("0.000000", "$0.00"),
    ("0.01", "$0.01"),
    ("0.010000", "$0.01"),
    ("0.125", "$0.125"),
    ("4.999958", "$4.999958"),
    ("5.000000", "$5.00"),
    ("1234.5", "$1,234.50"),
    ("-0.000004", "-$0.000004"),
    ("-2.5", "-$2.50"),
    ("0.0000004", "$0.00"),  # past the micro-dollar billing keeps: rounded to it
]


@pytest.mark.parametrize(("amount", "shown"), AMOUNTS)
def test_usd_exact(amount, shown):
    assert usd_exact(Decimal(amount)) == shown
    assert usd_exact(amount) == shown  # a figure as text (from JSON), the same


@pytest.mark.parametrize("value", [None, "", "not money"])
def test_what_is_not_an_amount_is_a_dash(value):
    assert usd_exact(value) == usd(value) == signed_usd(value) == "—"


@pytest.mark.parametrize(("amount", "shown"), [
    ("0.00001", "$0.000010"),  # was $0.00001
    ("0.000031", "$0.000031"),
    ("0", "$0.00"),
    ("0.015", "$0.02"),  # from a cent, rounded half up to the cent, as billing rounds
    ("1234.565", "$1,234.57"),
    ("-0.00002", "-$0.000020"),
])
def test_usd_rounds_from_a_cent_and_writes_less_as_usd_exact(amount, shown):
    assert usd(Decimal(amount)) == shown


@pytest.mark.parametrize(("amount", "shown"), [
    ("-0.00001", "-$0.000010"),
    ("5", "+$5.00"),
    ("0", "$0.00"),
])
def test_signed_usd(amount, shown):
    assert signed_usd(Decimal(amount)) == shown


def test_a_price_below_a_cent_per_million_tokens_is_written_as_any_small_amount():
    assert (per_mtok(Decimal("0.005")), per_mtok(Decimal("0.025")), per_mtok(Decimal("0"))) == \
        ("$0.005000", "$0.025", "Free")


# --- playground.js: the session's and each reply's cost ------------------------------------------------

_FORMAT = """
global.window = {};
global.document = {getElementById: () => null};  // no playground on this "page": only its money helpers
require(%s);
const money = window.PlaygroundMoney;
console.log(JSON.stringify(%s.map((amount) => money.formatUsd(money.micros(amount)))));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the dashboard's script")
def test_the_playground_writes_costs_as_the_filter_does():
    amounts = [amount for amount, _ in AMOUNTS if not amount.startswith("-")]  # a cost is never negative
    script = _FORMAT % (json.dumps(str(REPO_ROOT / "static" / "js" / "playground.js")), json.dumps(amounts))
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, check=True,
                         env={"LANG": "en_US.UTF-8", "PATH": "/usr/bin:/bin:/usr/local/bin"})
    assert json.loads(out.stdout) == [usd_exact(amount) for amount in amounts]
