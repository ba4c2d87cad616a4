"""The organization switcher, members and roles, invitations."""

from __future__ import annotations

import re

import pytest
from django.core import mail
from django.test import Client

from accounts.models import Membership, User
from accounts.services import add_member
from dashboard.models import Invitation
from tests.dashboard.conftest import PASSWORD, sign_up


def test_the_switcher_changes_the_current_organization(ada, acme, globex):
    user, acme_org = acme
    second = ada.post("/organizations/new/", {"name": "Second Lab"})
    assert second.status_code == 302
    assert "Second Lab" in ada.get("/settings/members/").content.decode().split("<h1>")[1]
    response = ada.post("/organizations/switch/", {"organization": acme_org.pk, "next": "/usage/"})
    assert response.status_code == 302 and response["Location"] == "/usage/"
    assert ada.session["organization_id"] == acme_org.pk
    # An organization the user does not belong to cannot be chosen.
    _, globex_org = globex
    assert ada.post("/organizations/switch/", {"organization": globex_org.pk}).status_code == 404
    assert ada.post("/organizations/switch/", {"organization": "x"}).status_code == 404
    assert ada.session["organization_id"] == acme_org.pk


def test_switching_from_an_object_page_lands_on_the_section_list(ada, acme):
    _, acme_org = acme
    response = ada.post("/organizations/switch/", {"organization": acme_org.pk, "next": "/deployments/mine-1/"})
    assert response["Location"] == "/deployments/"
    response = ada.post("/organizations/switch/", {"organization": acme_org.pk, "next": "https://evil.example/"})
    assert response["Location"] == "/"


def _invite(client, email, role="member"):
    return client.post("/settings/members/", {"email": email, "role": role})


def _link(message) -> str:
    return re.search(r"http://testserver(/invitations/\S+/)", message.body).group(1)


def test_an_invitation_is_mailed_and_accepted_by_a_new_user(ada, acme):
    _, org = acme
    response = _invite(ada, "Newbie@Example.com", "admin")
    assert response.status_code == 302
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["newbie@example.com"]
    link = _link(mail.outbox[0])
    invitation = Invitation.objects.get()
    assert invitation.token_hash not in link  # only the hash is stored
    assert "newbie@example.com" in ada.get("/settings/members/").content.decode()

    guest = Client()
    page = guest.get(link).content.decode()
    assert "Join Acme" in page and "Create your account" in page
    token = link.rstrip("/").rsplit("/", 1)[1]
    signup = guest.get(f"/signup/?invitation={token}").content.decode()
    assert 'value="newbie@example.com"' in signup
    response = guest.post("/signup/", {"email": "newbie@example.com", "password": PASSWORD, "invitation": token})
    assert response.status_code == 302
    user = User.objects.get(email="newbie@example.com")
    assert list(Membership.objects.filter(user=user).values_list("organization_id", "role")) == [(org.pk, "admin")]
    assert user.email_verified and len(mail.outbox) == 1  # the invitation came to that address: no link to open
    invitation.refresh_from_db()
    assert invitation.accepted_by == user
    assert guest.get(link).status_code == 404  # used


def test_an_existing_user_accepts_while_logged_in_with_the_invited_address(ada, acme, globex):
    grace, globex_org = globex
    _, acme_org = acme
    _invite(ada, grace.email)
    link = _link(mail.outbox[0])
    other = Client()
    other.force_login(sign_up("Eve", "Evil")[0])
    response = other.post(link)
    assert response.status_code == 200 and not Membership.objects.filter(organization=acme_org, user__name="Eve").exists()
    guest = Client()
    guest.force_login(grace)
    assert "Accept and join Acme" in guest.get(link).content.decode()
    response = guest.post(link)
    assert response.status_code == 302
    assert Membership.objects.get(user=grace, organization=acme_org).role == "member"
    assert guest.session["organization_id"] == acme_org.pk


def test_invitations_are_refused_for_members_and_duplicates(ada, acme):
    user, _ = acme
    assert "already a member" in _invite(ada, user.email).content.decode()
    _invite(ada, "twice@example.com")
    assert "already has a pending invitation" in _invite(ada, "TWICE@example.com").content.decode()
    assert Invitation.objects.count() == 1


def test_members_cannot_invite_and_admins_cannot_make_owners(client, acme):
    _, org = acme
    member, _ = sign_up("Mel", "Mine")
    admin, _ = sign_up("Al", "Own")
    add_member(organization=org, user=member, role="member")
    add_member(organization=org, user=admin, role="admin")
    client.force_login(member)
    client.post("/organizations/switch/", {"organization": org.pk})
    assert "Only owners and admins" in client.get("/settings/members/").content.decode()
    _invite(client, "x@example.com")
    assert not Invitation.objects.exists()

    client.force_login(admin)
    client.post("/organizations/switch/", {"organization": org.pk})
    response = _invite(client, "boss@example.com", "owner")
    assert response.status_code == 200 and not Invitation.objects.exists()  # "owner" is not a choice for admins
    response = client.post(f"/settings/members/{member.pk}/role/", {"role": "owner"}, follow=True)
    assert "Only an owner can make someone an owner" in response.content.decode()
    response = client.post(f"/settings/members/{member.pk}/role/", {"role": "admin"})
    assert Membership.objects.get(user=member, organization=org).role == "admin"


def test_the_last_owner_keeps_the_role_and_cannot_leave(ada, acme):
    user, org = acme
    response = ada.post(f"/settings/members/{user.pk}/role/", {"role": "member"}, follow=True)
    assert "at least one owner" in response.content.decode()
    response = ada.post(f"/settings/members/{user.pk}/remove/", follow=True)
    assert "last owner" in response.content.decode()
    assert Membership.objects.get(user=user, organization=org).role == "owner"


def test_an_invitation_revoked_while_its_sign_up_form_is_open_creates_nothing(ada, acme):
    """They asked to join: no account, and no organization of their own, behind their back."""
    _invite(ada, "frank@example.com")
    token = _link(mail.outbox[0]).rstrip("/").rsplit("/", 1)[1]
    guest = Client()
    assert "Create account and join" in guest.get(f"/signup/?invitation={token}").content.decode()
    ada.post(f"/settings/invitations/{Invitation.objects.get().pk}/revoke/")

    form = {"email": "frank@example.com", "password": PASSWORD, "name": "Frank", "invitation": token}
    response = guest.post("/signup/", form)
    page = response.content.decode()
    assert response.status_code == 400 and "not valid any more" in page and "Nothing was created" in page
    assert not User.objects.filter(email="frank@example.com").exists()
    assert 'name="invitation" value="' + token not in page and 'value="frank@example.com"' in page
    # Sent again, the form (without the invitation now) makes them an account of their own.
    again = guest.post("/signup/", {**form, "invitation": ""})
    assert again.status_code == 302
    frank = User.objects.get(email="frank@example.com")
    assert list(Membership.objects.filter(user=frank).values_list("role", flat=True)) == ["owner"]


def test_owners_remove_members_and_revoke_invitations(ada, acme, globex):
    _, org = acme
    grace, _ = globex
    add_member(organization=org, user=grace, role="member")
    ada.post(f"/settings/members/{grace.pk}/remove/")
    assert not Membership.objects.filter(user=grace, organization=org).exists()
    _invite(ada, "later@example.com")
    invitation = Invitation.objects.get()
    ada.post(f"/settings/invitations/{invitation.pk}/revoke/")
    invitation.refresh_from_db()
    assert invitation.status == "revoked"
    assert Client().get(_link(mail.outbox[0])).status_code == 404


def test_a_removed_admin_takes_their_keys_and_invitations_along(ada, acme):
    from accounts.models import ApiKey

    _, org = acme
    admin, _ = sign_up("Al", "Own")
    add_member(organization=org, user=admin, role="admin")
    client = Client()
    client.force_login(admin)
    client.post("/organizations/switch/", {"organization": org.pk})
    client.post("/api-keys/", {"name": "al's", "scopes": ["inference"]})
    _invite(client, "al.again@example.com", "admin")  # his other address, say
    response = ada.post(f"/settings/members/{admin.pk}/remove/", follow=True)
    assert "1 API key they created was revoked" in response.content.decode()
    assert ApiKey.objects.get(organization=org, created_by=admin).revoked_at is not None
    assert Invitation.objects.get().status == "revoked"
    assert Client().get(_link(mail.outbox[0])).status_code == 404


def test_an_invitation_grants_no_more_than_its_sender_still_may(ada, acme):
    _, org = acme
    admin, _ = sign_up("Al", "Own")
    add_member(organization=org, user=admin, role="admin")
    guest_user, _ = sign_up("Gus", "Gus's")
    from dashboard.services import accept_invitation, change_member_role, invite_member
    from dashboard.errors import InvalidInvitation

    tokens = []
    invite_member(organization=org, invited_by=admin, email=guest_user.email, role="admin",
                  link_for=lambda token: tokens.append(token) or token)
    change_member_role(organization=org, actor=acme[0], member=admin, role="member")
    with pytest.raises(InvalidInvitation):
        accept_invitation(raw_token=tokens[0], user=guest_user)
    assert not Membership.objects.filter(organization=org, user=guest_user).exists()


def test_accepting_an_invitation_to_a_higher_role_raises_the_members_role(ada, acme, globex):
    grace, _ = globex
    _, org = acme
    add_member(organization=org, user=grace, role="member")
    Invitation.objects.all().delete()
    from dashboard.services import accept_invitation, invite_member

    tokens = []
    for role in ("admin", "member"):  # a lower one afterwards keeps the higher
        Membership.objects.filter(organization=org, user=grace).update(role="member" if role == "admin" else "admin")
        invite_member(organization=org, invited_by=acme[0], email=f"second-{role}@example.com", role=role,
                      link_for=lambda token: tokens.append(token) or token)
        Invitation.objects.filter(email=f"second-{role}@example.com").update(email=grace.email)
        accept_invitation(raw_token=tokens[-1], user=grace)
        assert Membership.objects.get(organization=org, user=grace).role == "admin"


def test_an_invitation_whose_email_fails_is_not_kept(ada, acme, monkeypatch):
    import smtplib

    def refuse(*args, **kwargs):
        raise smtplib.SMTPRecipientsRefused({"x@example.com": (550, b"no such mailbox")})

    monkeypatch.setattr("dashboard.services.send_mail", refuse)
    response = _invite(ada, "x@example.com")
    assert response.status_code == 200 and "could not be sent" in response.content.decode()
    assert not Invitation.objects.exists()
    monkeypatch.undo()
    assert _invite(ada, "x@example.com").status_code == 302  # a retry is not "already pending"


@pytest.mark.parametrize("url", ["/settings/members/{user}/role/", "/settings/members/{user}/remove/"])
def test_members_of_another_organization_are_out_of_reach(ada, globex, url):
    grace, globex_org = globex
    response = ada.post(url.format(user=grace.pk), {"role": "member"})
    assert response.status_code == 404
    assert Membership.objects.get(user=grace, organization=globex_org).role == "owner"
