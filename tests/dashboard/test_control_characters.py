"""A name with a line break (or any control character) is refused wherever a name is given, and an
invitation's email cannot fail on one: a CR/LF in an organization's name made every invitation to
it a 500 (Django refuses it in the subject header) and left the invitation pending."""

from __future__ import annotations

import pytest
from django.core import mail
from django.core.mail import BadHeaderError

from accounts.models import ApiKey, Organization, User
from dashboard.models import Invitation
from tests.dashboard.conftest import PASSWORD

REFUSED = "cannot contain line breaks, tabs or other control characters"
BAD = ["Acme\r\nBcc: victim@example.com", "Acme\nLabs", "Acme\tLabs", "Acme\x1b[31m", "Acme\u2028Labs", "Acme\x85Labs"]


@pytest.mark.parametrize("name", BAD)
def test_sign_up_refuses_such_an_organization_name_on_its_field_and_makes_nothing(client, db, name):
    response = client.post("/signup/", {"name": "Ada", "email": "ada@example.com", "password": PASSWORD,
                                        "organization_name": name})
    assert response.status_code == 200
    assert REFUSED in response.context["form"].errors["organization_name"][0]
    assert not User.objects.exists() and not Organization.objects.exists()


@pytest.mark.parametrize("name", BAD)
def test_sign_up_refuses_such_a_user_name(client, db, name):
    response = client.post("/signup/", {"name": name, "email": "ada@example.com", "password": PASSWORD,
                                        "organization_name": "Acme"})
    assert response.status_code == 200 and REFUSED in response.context["form"].errors["name"][0]
    assert not User.objects.exists()


def test_a_new_organization_and_a_key_refuse_such_names(ada, acme):
    response = ada.post("/organizations/new/", {"name": "Second\r\nLab"})
    assert response.status_code == 200 and REFUSED in response.content.decode()
    assert Organization.objects.count() == 1
    response = ada.post("/api-keys/", {"name": "prod\r\nkey", "scopes": ["inference"]})
    assert response.status_code == 400 and REFUSED in response.content.decode()
    assert not ApiKey.objects.exists()


def test_an_invitation_from_an_organization_named_so_before_is_sent_with_a_one_line_subject(ada, acme):
    """A name saved before the rule (or by other means) still holds its line break."""
    user, org = acme
    Organization.objects.filter(pk=org.pk).update(name="Acme\r\nBcc: victim@example.com")
    User.objects.filter(pk=user.pk).update(name="Ada\nLovelace")
    response = ada.post("/settings/members/", {"email": "grace@example.com", "role": "member"})
    assert response.status_code == 302
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["grace@example.com"]
    assert mail.outbox[0].subject == "Ada Lovelace invited you to Acme Bcc: victim@example.com"
    assert Invitation.objects.get().email == "grace@example.com"


@pytest.mark.parametrize("failure", [BadHeaderError("Header values can't contain newlines"), RuntimeError("boom")])
def test_an_invitation_whose_email_cannot_be_made_is_not_left_pending(ada, acme, monkeypatch, failure):
    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr("dashboard.services.send_mail", fail)
    if isinstance(failure, BadHeaderError):
        response = ada.post("/settings/members/", {"email": "grace@example.com", "role": "member"})
        assert response.status_code == 200 and "could not be sent" in response.content.decode()
    else:
        with pytest.raises(RuntimeError):
            ada.post("/settings/members/", {"email": "grace@example.com", "role": "member"})
    assert not Invitation.objects.exists()
