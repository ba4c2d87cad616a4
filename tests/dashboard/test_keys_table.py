"""The API keys table: each key's spend limit, and names too long to show whole."""

from __future__ import annotations

import re
from decimal import Decimal

from accounts.services import create_api_key
from billing.services import set_api_key_spend_limit


def _row(page: str, name: str) -> str:
    return page.split(f'data-key="{name}"')[1].split("</tr>")[0]


def _limit(page: str, name: str) -> str:
    """The line under the key's spend."""
    return re.search(r"<span [^>]*data-limit>(.*?)</span>", _row(page, name)).group(1)


def test_each_key_shows_its_spend_limit(ada, acme):
    _, org = acme
    for name, limit in (("capped", "1000"), ("frozen", "0")):
        key, _ = create_api_key(organization=org, name=name, scopes=["inference"])
        set_api_key_spend_limit(api_key=key, amount_limit=Decimal(limit))
    create_api_key(organization=org, name="open", scopes=["inference"])

    page = ada.get("/api-keys/").content.decode()
    assert _limit(page, "capped") == "of $1,000.00"
    assert _limit(page, "frozen") == "of $0.00"  # a limit of nothing is a limit, not "none"
    assert _limit(page, "open") == "no limit"


def test_a_limit_set_in_the_create_form_is_shown(ada, acme):
    ada.post("/api-keys/", {"name": "budget", "scopes": ["inference"], "spend_limit": "12.50"})
    assert _limit(ada.get("/api-keys/").content.decode(), "budget") == "of $12.50"


def test_a_long_name_is_shortened_with_the_whole_name_in_its_title(ada, acme):
    _, org = acme
    name = "x" * 100
    create_api_key(organization=org, name=name, scopes=["inference"])
    row = _row(ada.get("/api-keys/").content.decode(), name)
    assert f'title="{name}"' in row
    shown = row.split(f'title="{name}">')[1].split("<")[0]
    assert len(shown) <= 32 and shown.endswith("…")
