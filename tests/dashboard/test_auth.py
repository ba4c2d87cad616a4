"""Sign-up, log in and out, password reset by email."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from decimal import Decimal

from django.core import mail
from django.core.cache import cache

from accounts.models import Membership, User
from billing.selectors import balance
from dashboard.services import confirmation_keys
from tests.dashboard.conftest import PASSWORD


def _confirmation_link(outbox) -> str:
    return re.search(r"http://testserver(/confirm-email/\S+/)", outbox[-1].body).group(1)


def test_sign_up_creates_the_user_and_their_organization_whose_credit_waits_for_the_email(client, db):
    response = client.post("/signup/", {"name": "Ada Lovelace", "email": "Ada@Example.com", "password": PASSWORD,
                                        "organization_name": "Analytical Engines"})
    assert response.status_code == 302 and response["Location"] == "/"
    user = User.objects.get(email="ada@example.com")
    membership = Membership.objects.get(user=user)
    assert membership.role == "owner" and membership.organization.name == "Analytical Engines"
    assert balance(organization=membership.organization) == Decimal("0")  # a scripted address gets nothing
    page = client.get("/").content.decode()
    assert "Analytical Engines" in page and "Good to see you, Ada Lovelace" in page
    assert 'id="email-unconfirmed"' in page and "$5.00 sign-up credit" in page
    # Requests are refused meanwhile, saying why: nothing was spent, the credit waits.
    assert "no credit yet: its sign-up credit comes once its founder confirms" in page
    [sent] = mail.outbox
    assert sent.to == ["ada@example.com"] and "$5.00 sign-up credit" in sent.body

    link = _confirmation_link(mail.outbox)
    client.post("/logout/")  # the link works signed out, as a password reset's does
    assert client.get(link).status_code == 302
    assert balance(organization=membership.organization) == Decimal("5.000000")
    client.get(link)  # once
    assert balance(organization=membership.organization) == Decimal("5.000000")
    client.post("/login/", {"username": "ada@example.com", "password": PASSWORD})
    page = client.get("/").content.decode()
    assert 'id="email-unconfirmed"' not in page and 'id="quota-refusal"' not in page


def test_a_confirmation_link_confirms_only_its_own_address(client, db):
    client.post("/signup/", {"email": "eve@example.com", "password": PASSWORD})
    link = _confirmation_link(mail.outbox)
    organization = Membership.objects.get(user__email="eve@example.com").organization
    token = link.split("/")[-2]
    forged = token[:-1] + ("0" if token[-1] != "0" else "1")
    assert client.get(link.replace(token, forged)).status_code == 302
    assert balance(organization=organization) == Decimal("0")  # a token made up
    User.objects.filter(email="eve@example.com").update(email="eve2@example.com")
    client.get(link)  # the address changed since it was sent
    assert balance(organization=organization) == Decimal("0")
    assert not User.objects.get(email="eve2@example.com").email_verified

    User.objects.filter(email="eve2@example.com").update(email="eve@example.com")
    response = client.post("/confirm-email/resend/", {"next": "/usage/"}, follow=True)
    assert response.redirect_chain[-1][0] == "/usage/" and "less than a minute ago" in response.content.decode()
    assert len(mail.outbox) == 1  # one a minute: "Send it again" floods nobody
    cache.delete(confirmation_keys(User.objects.get(email="eve@example.com"))[0])
    client.post("/confirm-email/resend/", {"next": "/usage/"})
    client.get(_confirmation_link(mail.outbox))
    assert balance(organization=organization) == Decimal("5.000000")


def test_confirmation_emails_to_one_user_are_at_most_one_a_minute_and_five_a_day(client, db, monkeypatch):
    """Anyone may sign up with someone else's address: "Send it again" must not flood it. A send
    that failed counts against neither the minute nor the day."""
    from dashboard import services

    client.post("/signup/", {"email": "target@example.com", "password": PASSWORD})
    user = User.objects.get(email="target@example.com")
    minute = confirmation_keys(user)[0]
    cache.delete(minute)

    def down(**kwargs):
        raise OSError("Connection refused")

    monkeypatch.setattr(services, "send_mail", down)
    page = client.post("/confirm-email/resend/", follow=True).content.decode()
    assert "could not be sent" in page
    monkeypatch.undo()
    sent = len(mail.outbox)
    for _ in range(services.CONFIRMATIONS_A_DAY - 1):  # the sign-up's counts for the day, the failed one not
        client.post("/confirm-email/resend/")  # the first at once: the failed send held nothing
        cache.delete(minute)
    assert len(mail.outbox) == sent + services.CONFIRMATIONS_A_DAY - 1
    page = client.post("/confirm-email/resend/", follow=True).content.decode()
    assert "the most a day" in page and len(mail.outbox) == sent + services.CONFIRMATIONS_A_DAY - 1


def test_without_email_confirmation_the_sign_up_credit_comes_at_once(client, db, settings):
    settings.SIGNUP_VERIFY_EMAIL = False
    client.post("/signup/", {"email": "ada@example.com", "password": PASSWORD})
    membership = Membership.objects.get(user__email="ada@example.com")
    assert balance(organization=membership.organization) == Decimal("5.000000") and not mail.outbox
    assert 'id="email-unconfirmed"' not in client.get("/").content.decode()


def test_sign_up_names_an_organization_when_none_is_given(client, db):
    client.post("/signup/", {"email": "grace@example.com", "password": PASSWORD})
    assert Membership.objects.get(user__email="grace@example.com").organization.name == "grace's organization"


def test_sign_up_refuses_a_taken_email_and_a_weak_password(client, acme):
    user, _ = acme
    response = client.post("/signup/", {"email": user.email.upper(), "password": PASSWORD})
    assert response.status_code == 200 and "already exists" in response.content.decode()
    response = client.post("/signup/", {"email": "new@example.com", "password": "password"})
    assert response.status_code == 200 and "too common" in response.content.decode()
    assert not User.objects.filter(email="new@example.com").exists()


def test_log_in_with_the_email_then_log_out(client, acme):
    user, _ = acme
    response = client.post("/login/", {"username": user.email, "password": "wrong"})
    assert response.status_code == 200 and "don&#x27;t match" in response.content.decode()
    response = client.post("/login/", {"username": user.email, "password": PASSWORD, "next": "/usage/"})
    assert response.status_code == 302 and response["Location"] == "/usage/"
    assert client.get("/usage/").status_code == 200
    assert client.get("/logout/").status_code == 200  # a confirmation: logging out is a POST (CSRF-protected)
    response = client.post("/logout/")
    assert response.status_code == 302
    assert client.get("/usage/").status_code == 302


def test_password_reset_by_email(client, acme):
    user, _ = acme
    response = client.post("/password-reset/", {"email": user.email})
    assert response.status_code == 302 and response["Location"] == "/password-reset/sent/"
    assert len(mail.outbox) == 1 and mail.outbox[0].to == [user.email]
    link = re.search(r"http://testserver(/reset/\S+/)", mail.outbox[0].body).group(1)
    response = client.get(link, follow=True)
    assert response.status_code == 200 and "Choose a new password" in response.content.decode()
    form_url = response.redirect_chain[-1][0]
    new_password = "another-long-password-77"
    response = client.post(form_url, {"new_password1": new_password, "new_password2": new_password})
    assert response.status_code == 302 and response["Location"] == "/reset/done/"
    assert client.login(username=user.email, password=new_password)
    # The link works once.
    assert "This link has expired" in client.get(link, follow=True).content.decode()


def test_password_reset_says_nothing_about_unknown_addresses(client, db):
    response = client.post("/password-reset/", {"email": "nobody@example.com"})
    assert response.status_code == 302 and response["Location"] == "/password-reset/sent/"
    assert mail.outbox == []


def test_where_sign_up_is_closed_only_an_invitation_makes_an_account(client, acme, settings):
    from dashboard.services import invite_member

    settings.SIGNUP_OPEN = False
    page = client.get("/signup/")
    assert page.status_code == 403 and "by invitation only" in page.content.decode()
    refused = client.post("/signup/", {"name": "Eve", "email": "eve@example.com", "password": PASSWORD,
                                       "organization_name": "Eve Corp"})
    assert refused.status_code == 403 and not User.objects.filter(email="eve@example.com").exists()
    assert "Create an account" not in client.get("/login/").content.decode()

    owner, organization = acme
    tokens = []
    invite_member(organization=organization, invited_by=owner, email="bob@example.com", role="member",
                  link_for=lambda token: tokens.append(token) or f"http://testserver/invitation/{token}/")
    joined = client.post("/signup/", {"name": "Bob", "email": "bob@example.com", "password": PASSWORD,
                                      "invitation": tokens[0]})
    assert joined.status_code == 302
    assert Membership.objects.filter(user__email="bob@example.com", organization=organization).exists()


def test_the_sign_up_service_refuses_too_where_it_is_closed(client, db, settings):
    import pytest

    from dashboard.errors import SignUpClosed
    from dashboard.services import sign_up

    assert "Create an account" in client.get("/login/").content.decode()  # open by default
    settings.SIGNUP_OPEN = False
    with pytest.raises(SignUpClosed, match="invitation only"):
        sign_up(email="mallory@example.com", password=PASSWORD, organization_name="M")
    assert not User.objects.filter(email="mallory@example.com").exists()


def test_sign_ins_to_an_account_stop_after_repeated_failures_even_with_the_right_password(client, acme, django_user_model):
    from accounts import login_throttle

    user, _ = acme
    other = django_user_model.objects.create_user(email="bystander@example.com", password=PASSWORD)
    try:
        for _ in range(login_throttle.MAX_FAILURES):
            assert client.post("/login/", {"username": user.email, "password": "wrong"}).status_code == 200
        response = client.post("/login/", {"username": user.email.upper(), "password": PASSWORD})
        assert response.status_code == 200 and "Too many failed sign-ins" in response.content.decode()
        assert client.get("/usage/").status_code == 302  # not signed in
        # The admin site's sign-in is held to the same count.
        response = client.post("/admin/login/", {"username": user.email, "password": PASSWORD})
        assert response.status_code == 200 and "Too many failed sign-ins" in response.content.decode()
        # Another account is not locked with it.
        assert client.post("/login/", {"username": other.email, "password": PASSWORD}).status_code == 302
        client.post("/logout/")
        # A password reset lifts the lock.
        assert client.post("/password-reset/", {"email": user.email}).status_code == 302
        link = re.search(r"http://testserver(/reset/\S+/)", mail.outbox[-1].body).group(1)
        form = client.get(link, follow=True)
        client.post(form.redirect_chain[-1][0], {"new_password1": "a brand new pass 42", "new_password2": "a brand new pass 42"})
        assert client.post("/login/", {"username": user.email, "password": "a brand new pass 42"}).status_code == 302
    finally:
        login_throttle.clear(user.email)


def test_every_spelling_that_signs_in_to_an_account_counts_against_it(client, django_user_model):
    """PostgreSQL matches emails case-insensitively with Unicode's case mapping: "ſ" (long s) and
    "ı" (dotless i) sign in as "s" and "i", and their failures must lock the same account."""
    from accounts import login_throttle

    user = django_user_model.objects.create_user(email="sister@example.com", password=PASSWORD)
    try:
        for spelling in ["ſister@example.com", "sıster@example.com"] * (login_throttle.MAX_FAILURES // 2):
            assert client.post("/login/", {"username": spelling, "password": "wrong"}).status_code == 200
        for spelling in ("sister@example.com", "ſiſter@example.com"):
            response = client.post("/login/", {"username": spelling, "password": PASSWORD})
            assert response.status_code == 200 and "Too many failed sign-ins" in response.content.decode()
    finally:
        login_throttle.clear(user.email)


def test_sign_ins_sent_together_get_no_more_password_checks_than_the_limit(db, django_user_model):
    """Each attempt is counted before its password is checked: many at once cannot all pass a
    check that their failures would only fail later."""
    from concurrent.futures import ThreadPoolExecutor

    from accounts import login_throttle

    from django.db import connection

    user = django_user_model.objects.create_user(email="target@example.com", password=PASSWORD)

    def attempt(_):
        try:
            return login_throttle.take_attempt("target@example.com")
        finally:
            connection.close()  # this thread's own

    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            waits = list(pool.map(attempt, range(48)))
        assert waits.count(0) == login_throttle.MAX_FAILURES
        assert all(0 < wait <= login_throttle.WINDOW_S for wait in waits if wait)
    finally:
        login_throttle.clear(user.email)


class _Focusable(HTMLParser):
    """What Tab reaches in a page, in document order (the dashboard sets no tabindex)."""

    def __init__(self):
        super().__init__()
        self.order: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "input" and attrs.get("type") != "hidden" or tag in ("button", "select", "textarea"):
            self.order.append(attrs.get("id") or f"{tag}[type={attrs.get('type')}]")
        elif tag == "a" and "href" in attrs:
            self.order.append(attrs["href"])


def test_the_login_form_tabs_from_the_email_to_the_password(client, db):
    page = _Focusable()
    page.feed(client.get("/login/").content.decode())
    order = page.order
    # Nothing between the two fields: the "Forgot your password?" link sat there, in the label's row.
    assert order.index("id_password") == order.index("id_username") + 1, order
    assert order.index("/password-reset/") > order.index("id_password"), order


def test_password_resets_to_one_account_are_few_and_link_under_the_site_url(client, acme, settings):
    """Anyone may ask to reset anyone's password: one email a minute and five a day go, and the
    page says the same whatever happened. The link is SITE_URL's, not a Host header's (whose port
    Django's host check ignores)."""
    from dashboard import mail_quota

    user, _ = acme
    settings.SITE_URL = "https://llm.example.com"
    for _ in range(3):
        response = client.post("/password-reset/", {"email": user.email}, HTTP_HOST="testserver:6666")
        assert response.status_code == 302 and response["Location"] == "/password-reset/sent/"
    assert len(mail.outbox) == 1 and "https://llm.example.com/reset/" in mail.outbox[0].body
    assert "6666" not in mail.outbox[0].body
    minute = mail_quota.keys("password-reset", mail_quota.of_user(user))[0]
    for _ in range(mail_quota.A_DAY):
        cache.delete(minute)
        client.post("/password-reset/", {"email": user.email})
    assert len(mail.outbox) == mail_quota.A_DAY
