"""Users, organizations, membership and the organization_created signal."""

from __future__ import annotations

import pytest
from django.contrib.auth import authenticate, get_user_model
from django.db import IntegrityError, transaction

from accounts.errors import InvalidInput
from accounts.models import Membership, Organization, User
from accounts.selectors import current_organization_for_user, organizations_for_user
from accounts.services import add_member, create_organization, create_user, remove_member
from accounts.signals import organization_created

pytestmark = pytest.mark.django_db

PASSWORD = "a-long-pass-phrase-42"


def test_the_user_model_logs_in_by_email_case_insensitively():
    assert get_user_model() is User
    user = create_user(email="Ada@Example.COM", password=PASSWORD)
    assert user.email == "ada@example.com"
    assert authenticate(username="ADA@example.com", password=PASSWORD) == user
    assert authenticate(username="ada@example.com", password="wrong") is None


def test_create_user_refuses_duplicates_bad_emails_and_weak_passwords():
    create_user(email="ada@example.com", password=PASSWORD)
    for kwargs, field in [
        ({"email": "ADA@example.com", "password": PASSWORD}, "email"),
        ({"email": "not-an-email", "password": PASSWORD}, "email"),
        ({"email": "bob@example.com", "password": "123"}, "password"),
    ]:
        with pytest.raises(InvalidInput) as info:
            create_user(**kwargs)
        assert info.value.field == field
    assert User.objects.count() == 1


def test_the_database_refuses_emails_differing_only_in_case():
    User.objects.create(email="x@example.com")
    with pytest.raises(IntegrityError), transaction.atomic():
        User.objects.create(email="X@example.com")


def test_a_user_without_password_cannot_log_in():
    user = create_user(email="cli@example.com", password=None)
    assert not user.has_usable_password()


def test_create_organization_makes_the_owner_and_sends_the_signal_once():
    owner = create_user(email="ada@example.com", password=PASSWORD)
    received = []

    def receiver(sender, organization, **kwargs):
        # Inside the creation: the owner's membership already exists.
        received.append((organization.pk, Membership.objects.get(organization=organization).role))

    organization_created.connect(receiver)
    try:
        org = create_organization(name="Acme Labs", owner=owner)
    finally:
        organization_created.disconnect(receiver)
    assert received == [(org.pk, "owner")]
    assert org.slug == "acme-labs"
    assert create_organization(name="Acme Labs", owner=owner).slug == "acme-labs-2"


def test_a_failing_receiver_rolls_the_organization_back():
    owner = create_user(email="ada@example.com", password=PASSWORD)

    def broken(sender, organization, **kwargs):
        raise RuntimeError("credit grant failed")

    organization_created.connect(broken)
    try:
        with pytest.raises(RuntimeError):
            create_organization(name="Acme", owner=owner)
    finally:
        organization_created.disconnect(broken)
    assert not Organization.objects.exists() and not Membership.objects.exists()


CONTROL = ["a\r\nb", "a\nb", "a\rb", "a\tb", "a\x00b", "a\x1bb", "a\x7fb", "a\x85b", "a\u2028b", "a\u2029b"]


@pytest.mark.parametrize("name", CONTROL)
def test_names_with_control_characters_are_refused_by_every_service(name):
    from accounts.models import ApiKey
    from accounts.services import create_api_key

    with pytest.raises(InvalidInput) as caught:
        create_user(email="ada@example.com", password=PASSWORD, name=name)
    assert caught.value.field == "name" and "control characters" in caught.value.message
    owner = create_user(email="ada@example.com", password=PASSWORD, name="Ada Lovelace")
    with pytest.raises(InvalidInput) as caught:
        create_organization(name=name, owner=owner)
    assert caught.value.field == "name" and "control characters" in caught.value.message
    org = create_organization(name="Acme", owner=owner)
    with pytest.raises(InvalidInput) as caught:
        create_api_key(organization=org, name=name, scopes=["inference"])
    assert caught.value.field == "name" and "control characters" in caught.value.message
    assert Organization.objects.count() == 1 and not ApiKey.objects.exists()


def test_names_in_any_script_with_spaces_and_punctuation_are_fine():
    owner = create_user(email="ada@example.com", password=PASSWORD, name="  Ada Lovelace-Byron  ")
    assert owner.name == "Ada Lovelace-Byron"
    assert create_organization(name="Société Générale · 研究所 (R&D)", owner=owner).name == "Société Générale · 研究所 (R&D)"


@pytest.mark.parametrize("model", ["user", "organization", "apikey"])
def test_the_models_validate_names_too_for_the_admin_sites_forms(model):
    from django.core.exceptions import ValidationError

    from accounts.models import ApiKey

    owner = create_user(email="ada@example.com", password=PASSWORD)
    org = create_organization(name="Acme", owner=owner)
    instance = {"user": owner, "organization": org,
                "apikey": ApiKey(organization=org, name="k", prefix="p" * 12, secret_hash="h" * 64)}[model]
    instance.name = "x\r\ny"
    with pytest.raises(ValidationError) as caught:
        instance.full_clean()
    assert "name" in caught.value.message_dict


def test_membership_is_unique_per_pair_and_roles_are_checked():
    owner = create_user(email="ada@example.com", password=PASSWORD)
    bob = create_user(email="bob@example.com", password=PASSWORD)
    org = create_organization(name="Acme", owner=owner)
    add_member(organization=org, user=bob, role="member")
    add_member(organization=org, user=bob, role="admin")
    assert Membership.objects.get(organization=org, user=bob).role == "admin"
    with pytest.raises(InvalidInput):
        add_member(organization=org, user=bob, role="god")
    with pytest.raises(IntegrityError), transaction.atomic():
        Membership.objects.create(organization=org, user=bob, role="member")
    with pytest.raises(IntegrityError), transaction.atomic():
        Membership.objects.filter(organization=org, user=bob).update(role="god")


def test_the_last_owner_cannot_leave():
    owner = create_user(email="ada@example.com", password=PASSWORD)
    org = create_organization(name="Acme", owner=owner)
    with pytest.raises(InvalidInput):
        remove_member(organization=org, user=owner)
    bob = create_user(email="bob@example.com", password=PASSWORD)
    add_member(organization=org, user=bob, role="owner")
    remove_member(organization=org, user=owner)
    assert list(organizations_for_user(user=owner)) == []


def test_a_removed_member_loses_the_keys_they_created():
    from accounts.errors import ApiKeyError
    from accounts.selectors import authenticate_api_key
    from accounts.services import create_api_key

    owner = create_user(email="ada@example.com", password=PASSWORD)
    org = create_organization(name="Acme", owner=owner)
    bob = create_user(email="bob@example.com", password=PASSWORD)
    add_member(organization=org, user=bob)
    _, bobs = create_api_key(organization=org, name="bob's", scopes=["inference"], created_by=bob)
    _, owners = create_api_key(organization=org, name="owner's", scopes=["inference"], created_by=owner)
    elsewhere = create_organization(name="Bob's own", owner=bob)
    _, bobs_own = create_api_key(organization=elsewhere, name="own", scopes=["inference"], created_by=bob)
    assert authenticate_api_key(bobs).organization == org  # cached by the gateway's read cache
    assert remove_member(organization=org, user=bob) == 1
    with pytest.raises(ApiKeyError):
        authenticate_api_key(bobs)
    assert authenticate_api_key(owners) and authenticate_api_key(bobs_own)  # others', and his elsewhere


def _bob_with_keys():
    """Ada's organization with Bob in it, a key each there, and Bob's key in his own organization."""
    from accounts.services import create_api_key

    owner = create_user(email="ada@example.com", password=PASSWORD)
    org = create_organization(name="Acme", owner=owner)
    bob = create_user(email="bob@example.com", password=PASSWORD)
    add_member(organization=org, user=bob, role="admin")
    keys = {
        "bob's": create_api_key(organization=org, name="bob's", scopes=["manage"], created_by=bob)[1],
        "owner's": create_api_key(organization=org, name="owner's", scopes=["manage"], created_by=owner)[1],
        "bob's own": create_api_key(organization=create_organization(name="Bob's own", owner=bob), name="own",
                                    scopes=["manage"], created_by=bob)[1],
    }
    return org, bob, keys


def _usable(raw) -> bool:
    from accounts.errors import ApiKeyError
    from accounts.selectors import authenticate_api_key

    try:
        authenticate_api_key(raw)
    except ApiKeyError:
        return False
    return True


@pytest.mark.parametrize("how", ["instance", "queryset"])
def test_deleting_a_membership_any_way_revokes_the_members_keys_there(how):
    """The admin site deletes the row (one, or a selection): no service runs, the keys go all the same."""
    org, bob, keys = _bob_with_keys()
    assert all(_usable(raw) for raw in keys.values())  # now in the read cache
    memberships = Membership.objects.filter(organization=org, user=bob)
    memberships.get().delete() if how == "instance" else memberships.delete()
    assert {name: _usable(raw) for name, raw in keys.items()} == {"bob's": False, "owner's": True, "bob's own": True}


def test_deleting_a_user_revokes_all_their_keys_and_nobody_elses():
    org, bob, keys = _bob_with_keys()
    assert all(_usable(raw) for raw in keys.values())
    bob.delete()
    assert {name: _usable(raw) for name, raw in keys.items()} == {"bob's": False, "owner's": True, "bob's own": False}
    from accounts.models import ApiKey

    # Revoked, not left active with no creator (which the command line's keys alone may be).
    assert not ApiKey.objects.filter(created_by__isnull=True, revoked_at__isnull=True).exists()


def test_deleting_an_organization_still_deletes_its_memberships_and_keys():
    from accounts.models import ApiKey

    org, bob, keys = _bob_with_keys()
    org.delete()
    assert not Membership.objects.filter(organization_id=org.pk).exists()
    assert not ApiKey.objects.filter(organization_id=org.pk).exists()
    assert _usable(keys["bob's own"])


def test_a_deactivated_users_keys_fail_with_a_clear_error_and_work_again_once_reactivated():
    from accounts.errors import DeactivatedApiKey
    from accounts.selectors import authenticate_api_key

    org, bob, keys = _bob_with_keys()
    assert _usable(keys["bob's"])
    bob.is_active = False
    bob.save(update_fields=["is_active"])
    with pytest.raises(DeactivatedApiKey) as caught:
        authenticate_api_key(keys["bob's"])
    assert "deactivated" in caught.value.message and caught.value.code == "invalid_api_key"
    assert not _usable(keys["bob's own"]) and _usable(keys["owner's"])
    bob.is_active = True
    bob.save(update_fields=["is_active"])
    assert _usable(keys["bob's"]) and _usable(keys["bob's own"])


def test_only_the_command_line_makes_keys_that_act_as_the_organization():
    from accounts.authentication import ApiKeyUser, key_actor
    from accounts.models import ApiKey
    from accounts.services import create_api_key

    org, bob, _ = _bob_with_keys()
    by_bob, _ = create_api_key(organization=org, name="b", scopes=["manage"], created_by=bob)
    assert by_bob.origin == ApiKey.Origin.MEMBER and key_actor(by_bob) == bob
    orphan, _ = create_api_key(organization=org, name="o", scopes=["manage"])
    assert not orphan.acts_as_organization and isinstance(key_actor(orphan), ApiKeyUser)
    cli, _ = create_api_key(organization=org, name="c", scopes=["manage"], origin=ApiKey.Origin.COMMAND_LINE)
    assert cli.acts_as_organization and key_actor(cli) is None
    with pytest.raises(InvalidInput):
        create_api_key(organization=org, name="x", scopes=["manage"], origin="admin")


@pytest.mark.django_db(transaction=True)
def test_two_owners_leaving_at_once_leave_one_owner(monkeypatch):
    """Each removal counts the owners: without a lock both would count two and both leave."""
    import threading
    import time

    from django.db import connection
    from django.db.models import QuerySet

    ada = create_user(email="ada@example.com", password=PASSWORD)
    org = create_organization(name="Acme", owner=ada)
    bob = create_user(email="bob@example.com", password=PASSWORD)
    add_member(organization=org, user=bob, role="owner")
    arrived, changed = [], threading.Condition()
    count = QuerySet.count

    def other_waits_for_a_lock() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND wait_event_type = 'Lock'")
            return cursor.fetchone()[0] > 0

    def count_together(self):
        """Hold each removal at its count until the other removal is there too, or is waiting
        for a lock this one holds (the fix): then neither can count before the other has."""
        with changed:
            arrived.append(1)
            changed.notify_all()
        deadline = time.monotonic() + 30
        with changed:
            while len(arrived) < 2 and not other_waits_for_a_lock() and time.monotonic() < deadline:
                changed.wait(0.02)
        return count(self)

    monkeypatch.setattr(QuerySet, "count", count_together)
    outcomes = []

    def leave(user):
        try:
            remove_member(organization=org, user=user)
            outcomes.append("left")
        except InvalidInput:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=leave, args=(user,)) for user in (ada, bob)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    monkeypatch.setattr(QuerySet, "count", count)
    assert sorted(outcomes) == ["left", "refused"]
    assert Membership.objects.filter(organization=org, role="owner").count() == 1


def test_current_organization_is_the_session_choice_when_a_member_else_the_first():
    ada = create_user(email="ada@example.com", password=PASSWORD)
    eve = create_user(email="eve@example.com", password=PASSWORD)
    first = create_organization(name="Zeta", owner=ada)
    second = create_organization(name="Alpha", owner=ada)
    foreign = create_organization(name="Eve's", owner=eve)
    assert list(organizations_for_user(user=ada)) == [first, second]
    assert current_organization_for_user(user=ada) == first
    assert current_organization_for_user(user=ada, organization_id=second.pk) == second
    assert current_organization_for_user(user=ada, organization_id=foreign.pk) == first
    assert current_organization_for_user(user=ada, organization_id="junk") == first


@pytest.mark.django_db(transaction=True)
def test_the_migration_revokes_the_creator_less_keys_it_finds_and_keeps_the_others():
    """Before it, a deleted user's keys stayed active with no creator; the command line always
    gave its keys one (``up``: the admin; ``createkey``: --email or the owner)."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    from accounts.models import ApiKey
    from accounts.services import create_api_key

    owner = create_user(email="ada@example.com", password=PASSWORD)
    org = create_organization(name="Acme", owner=owner)
    kept, _ = create_api_key(organization=org, name="up", scopes=["manage"], created_by=owner)
    orphan, _ = create_api_key(organization=org, name="gone", scopes=["manage"])
    executor = MigrationExecutor(connection)
    try:
        executor.migrate([("accounts", "0001_initial")])
    finally:  # to the latest again: later tests need every migration
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
    kept, orphan = ApiKey.objects.get(pk=kept.pk), ApiKey.objects.get(pk=orphan.pk)
    assert kept.revoked_at is None and kept.origin == "member" and kept.created_by == owner
    assert orphan.revoked_at is not None and orphan.origin == "member"
