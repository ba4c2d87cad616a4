"""The members page: its organization switcher, revoking invitations, a member's direct post of
the invite form, and a Leave button only for those who may leave."""

from __future__ import annotations

import pytest
from django.test import Client

from accounts.services import add_member, create_organization
from dashboard import selectors
from dashboard.models import Invitation
from tests.dashboard.conftest import sign_up


def _switcher_entries(page: str, organization) -> int:
    return page.count(f'name="organization" value="{organization.pk}"')


def test_the_switcher_lists_the_users_organizations_not_the_members(ada, acme):
    owner, acme_org = acme
    second = create_organization(name="Second", owner=owner)
    for name in ("Mel", "Al"):
        add_member(organization=acme_org, user=sign_up(name, f"{name}'s own")[0], role="member")
    ada.post("/organizations/switch/", {"organization": acme_org.pk})

    response = ada.get("/settings/members/")
    page = response.content.decode()
    assert _switcher_entries(page, acme_org) == 1 and _switcher_entries(page, second) == 1
    assert len(response.context["members"]) == 3
    assert page.count("<tr data-member=") == 3


def _invite(client, email: str):
    return client.post("/settings/members/", {"email": email, "role": "member"})


def test_revoking_an_unknown_invitation_says_so(ada, acme):
    response = ada.post("/settings/invitations/99999/revoke/", follow=True)
    page = response.content.decode()
    assert "no such pending invitation" in page and "Invitation revoked." not in page


def test_another_organizations_invitation_is_untouched(ada, globex):
    grace, _ = globex
    grace_client = Client()
    grace_client.force_login(grace)
    _invite(grace_client, "globex.hire@example.com")
    theirs = Invitation.objects.get()

    page = ada.post(f"/settings/invitations/{theirs.pk}/revoke/", follow=True).content.decode()
    assert "Invitation revoked." not in page
    theirs.refresh_from_db()
    assert theirs.status == "pending"


def test_revoking_twice_reports_success_once(ada, acme):
    _invite(ada, "later@example.com")
    invitation = Invitation.objects.get()
    assert "Invitation revoked." in ada.post(f"/settings/invitations/{invitation.pk}/revoke/", follow=True).content.decode()
    again = ada.post(f"/settings/invitations/{invitation.pk}/revoke/", follow=True).content.decode()
    assert "Invitation revoked." not in again and "no such pending invitation" in again


def test_a_member_posting_the_invite_form_is_refused_with_a_message(acme):
    _, org = acme
    member, _ = sign_up("Mel", "Mel's own")
    add_member(organization=org, user=member, role="member")
    client = Client()
    client.force_login(member)
    client.post("/organizations/switch/", {"organization": org.pk})

    response = _invite(client, "x@example.com")
    assert response.status_code == 403
    assert "Only owners and admins can invite people" in response.content.decode()
    assert not Invitation.objects.exists()


def _leave_button(page: str, user) -> str:
    """The member's own row's last cell: its Leave button, and why it is disabled when it is."""
    row = page[page.index(f'<tr data-member="{user.email}">'):]
    cell = row[row.index('<td class="right">'):]
    return cell[:cell.index("</td>")]


def test_the_sole_owner_is_shown_why_they_cannot_leave_instead_of_a_leave_button_that_fails(ada, acme):
    user, org = acme
    assert selectors.members_page(organization=org, user=user)["leave_refusal"] == \
        "The last owner cannot leave the organization."
    cell = _leave_button(ada.get("/settings/members/").content.decode(), user)
    assert "disabled" in cell and "The last owner cannot leave the organization." in cell
    assert "<form" not in cell  # nothing to post that can only fail


@pytest.mark.parametrize("role", ["owner", "admin", "member"])
def test_a_member_who_may_leave_gets_the_leave_button(acme, role):
    owner, org = acme
    user, _ = sign_up("Mel", "Mel's own")
    add_member(organization=org, user=user, role=role)
    client = Client()
    client.force_login(user)
    client.post("/organizations/switch/", {"organization": org.pk})

    assert selectors.members_page(organization=org, user=user)["leave_refusal"] is None
    cell = _leave_button(client.get("/settings/members/").content.decode(), user)
    assert f'action="/settings/members/{user.pk}/remove/"' in cell and "disabled" not in cell
    first_owners = selectors.members_page(organization=org, user=owner)["leave_refusal"]
    assert (first_owners is None) == (role == "owner")  # a second owner lets the first one leave too


def test_invitations_to_one_address_are_at_most_one_a_minute_and_five_a_day(ada, acme, monkeypatch):
    """An owner may revoke and invite again, but not mail an address (with a subject naming
    whatever their organization is called) more than that; nor an organization more than its day's
    invitations. The link goes under SITE_URL, not the request's Host."""
    from django.core import mail
    from django.core.cache import cache

    from dashboard import mail_quota, services

    _, org = acme
    monkeypatch.setattr(services.settings, "SITE_URL", "https://llm.example.com")
    assert _invite(ada, "target@example.com").status_code == 302
    assert mail.outbox[-1].body.count("https://llm.example.com/invitations/") == 1
    recipient = services._invitation_recipient(org, "target@example.com")
    for sent in range(1, services.INVITATIONS_A_DAY + 1):
        assert len(mail.outbox) == sent
        ada.post(f"/settings/invitations/{Invitation.objects.get(revoked_at__isnull=True).pk}/revoke/")
        page = _invite(ada, "target@example.com").content.decode()
        assert "less than a minute ago" in page and len(mail.outbox) == sent
        cache.delete(mail_quota.keys("invitation", recipient)[0])
        page = _invite(ada, "target@example.com").content.decode()
    assert "the most a day" in page and len(mail.outbox) == services.INVITATIONS_A_DAY
    assert not Invitation.objects.filter(revoked_at__isnull=True).exists()  # none kept unsent

    monkeypatch.setattr(services, "ORGANIZATION_INVITATIONS_A_DAY", services.INVITATIONS_A_DAY + 1)  # five went
    _invite(ada, "one@example.com")
    page = _invite(ada, "two@example.com").content.decode()
    assert "invitations today, the most a day" in page
    assert [m.to for m in mail.outbox[-1:]] == [["one@example.com"]]


def test_invitations_that_could_not_be_sent_do_not_count(ada, acme, monkeypatch):
    from django.core import mail

    from dashboard import services

    def down(**kwargs):
        raise OSError("Connection refused")

    monkeypatch.setattr(services, "send_mail", down)
    for _ in range(services.INVITATIONS_A_DAY + 1):
        assert "could not be sent" in _invite(ada, "target@example.com").content.decode()
    monkeypatch.undo()
    assert _invite(ada, "target@example.com").status_code == 302 and len(mail.outbox) == 1
