"""Two of a user's organizations with the same name are told apart in the switcher by their slug
(unique across the platform); organizations with distinct names are shown by name alone."""

from __future__ import annotations

import re

from accounts.services import add_member, create_organization
from tests.dashboard.conftest import sign_up


def _entries(page: str) -> dict[int, str]:
    """Each switcher entry's text (name, role, disambiguator), by organization id."""
    menu = page.split('class="org-menu"')[1].split("<hr>")[0]
    entries = re.findall(r'name="organization" value="(\d+)">.*?<span class="org-name">(.*?)</span></span>', menu,
                         flags=re.DOTALL)
    return {int(pk): " ".join(re.sub(r"<[^>]+>", " ", text).split()) for pk, text in entries}


def _current(page: str) -> str:
    summary = page.split('<summary aria-label="Switch organization">')[1].split("</summary>")[0]
    return " ".join(re.sub(r"<[^>]+>", " ", summary).split())


def test_two_organizations_with_one_name_show_their_slugs(ada, acme):
    user, own = acme  # "Acme", made at sign-up
    other_owner, _ = sign_up("Grace", "Elsewhere")
    invited = create_organization(name="acme", owner=other_owner)  # another team's "acme"
    add_member(organization=invited, user=user, role="member")
    distinct = create_organization(name="Globex", owner=user)
    assert own.slug != invited.slug

    ada.post("/organizations/switch/", {"organization": invited.pk})
    page = ada.get("/").content.decode()
    entries = _entries(page)
    assert entries[own.pk] == f"Acme owner · {own.slug}"
    assert entries[invited.pk] == f"acme member · {invited.slug}"
    assert entries[distinct.pk] == "Globex owner"  # a name of its own needs nothing more
    assert _current(page) == f"A acme member · {invited.slug}"


def test_distinct_names_show_no_slug(ada, acme):
    user, own = acme
    create_organization(name="Acme Labs", owner=user)
    page = ada.get("/").content.decode()
    assert own.slug not in _current(page)
    assert all("·" not in text for text in _entries(page).values())
