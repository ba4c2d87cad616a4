"""The free sign-up credit goes to the first organization a user creates, never to the next ones:
creating organizations must not be a way to farm free credit."""

from __future__ import annotations

import threading
import uuid
from decimal import Decimal

import pytest
from django.db import connection, connections, transaction

from accounts.models import Membership
from accounts.services import add_member, create_organization, create_user, remove_member
from billing import selectors
from billing.models import LedgerEntry
from tests.support import wait_until

SIGNUP = Decimal("5.000000")


def _user(tag: str = "u"):
    return create_user(email=f"{tag}-{uuid.uuid4().hex[:8]}@example.com", password=None, validate=False)


def _signup_credits(user) -> int:
    return LedgerEntry.objects.filter(kind="signup_credit", organization__memberships__user=user).count()


@pytest.mark.django_db
def test_a_users_second_organization_gets_no_credit():
    user = _user()
    first = create_organization(name="First", owner=user)
    second = create_organization(name="Second", owner=user)
    assert selectors.balance(organization=first) == SIGNUP
    assert selectors.balance(organization=second) == 0
    assert not LedgerEntry.objects.filter(organization=second).exists()
    assert _signup_credits(user) == 1


@pytest.mark.django_db
def test_leaving_the_first_organization_does_not_earn_another_credit():
    user, heir = _user("ada"), _user("heir")
    first = create_organization(name="First", owner=user)
    add_member(organization=first, user=heir, role=Membership.Role.OWNER)
    remove_member(organization=first, user=user)  # the user owns nothing now
    again = create_organization(name="Again", owner=user)
    assert selectors.balance(organization=again) == 0
    assert selectors.balance(organization=first) == SIGNUP  # the first keeps its own


@pytest.mark.django_db
def test_belonging_to_someone_elses_organization_does_not_use_up_the_credit():
    owner, member = _user("owner"), _user("member")
    theirs = create_organization(name="Theirs", owner=owner)
    add_member(organization=theirs, user=member, role=Membership.Role.ADMIN)
    mine = create_organization(name="Mine", owner=member)
    assert selectors.balance(organization=mine) == SIGNUP
    assert selectors.balance(organization=theirs) == SIGNUP


@pytest.mark.django_db
def test_an_owner_of_someone_elses_organization_still_gets_a_credit_for_their_own():
    """Invited as an owner (or promoted) of an organization whose credit was granted before
    credits named their user: that credit was its founder's, not this user's."""
    founder, invited = _user("founder"), _user("invited")
    theirs = create_organization(name="Theirs", owner=founder)
    LedgerEntry.objects.filter(organization=theirs, kind="signup_credit").update(reference=f"organization:{theirs.pk}")
    add_member(organization=theirs, user=invited, role=Membership.Role.OWNER)
    mine = create_organization(name="Mine", owner=invited)
    assert selectors.balance(organization=mine) == SIGNUP


@pytest.mark.django_db
def test_a_credit_granted_before_credits_named_their_user_still_counts():
    """Earlier sign-up credits were referenced by organization: the owner's next one gets none."""
    from billing import services

    user = _user()
    first = create_organization(name="First", owner=user)
    LedgerEntry.objects.filter(organization=first, kind="signup_credit").update(reference=f"organization:{first.pk}")
    second = create_organization(name="Second", owner=user)
    assert selectors.balance(organization=second) == 0
    assert services.grant_signup_credit(organization=first).reference == f"organization:{first.pk}"


@pytest.mark.django_db(transaction=True)
def test_two_organizations_created_at_once_by_one_user_get_one_credit():
    """Neither creation sees the other's uncommitted credit, so only the unique reference can stop
    the second: it waits for the first to commit and then grants nothing."""
    user = _user()
    created: dict[str, object] = {}
    errors: list[BaseException] = []
    first_written, commit_first = threading.Event(), threading.Event()

    def first():
        try:
            with transaction.atomic():
                created["first"] = create_organization(name="First", owner=user)
                first_written.set()
                commit_first.wait(60)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            first_written.set()
            connections.close_all()

    def second():
        try:
            with connection.cursor() as cursor:  # this thread's own connection
                cursor.execute("SELECT pg_backend_pid()")
                created["second_pid"] = cursor.fetchone()[0]
            first_written.wait(60)
            created["second"] = create_organization(name="Second", owner=user)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    try:
        # The first commits only once the second waits on its uncommitted ledger row. (Asked from
        # this thread: a transaction sees pg_stat_activity as it was at its first look.)
        wait_until(lambda: _blocked(created.get("second_pid")), timeout=30, interval=0.02,
                   message="the second creation to wait for the first's sign-up credit")
    finally:
        commit_first.set()
        for thread in threads:
            thread.join(timeout=60)
    assert not errors, errors
    assert selectors.balance(organization=created["first"]) == SIGNUP
    assert selectors.balance(organization=created["second"]) == 0
    assert _signup_credits(user) == 1


def _blocked(pid: int | None) -> bool:
    """Whether the backend ``pid`` waits for a lock another backend holds."""
    if pid is None:
        return False
    with connection.cursor() as cursor:
        cursor.execute("SELECT cardinality(pg_blocking_pids(%s))", [pid])
        return cursor.fetchone()[0] > 0
