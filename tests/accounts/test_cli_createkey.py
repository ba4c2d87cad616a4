"""`inference-platform createkey` as an operator runs it, and the key `up` prints."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

from accounts.models import ApiKey, Membership, Organization, User
from accounts.selectors import authenticate_api_key
from accounts.services import create_organization, create_user
from inference_platform import cli, read_cache
from tests.conftest import child_env
from tests.support import REPO_ROOT

# The command runs in its own process against the test database: the data must be committed.
pytestmark = pytest.mark.django_db(transaction=True)

CLI = [sys.executable, "-m", "inference_platform.cli", "createkey"]


def createkey(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=120)


def test_createkey_prints_exactly_the_key_and_creates_org_and_user():
    result = createkey("--org", "Acme", "--email", "ops@example.com", "--scopes", "inference,manage", "--name", "deploy")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and result.stdout == lines[0] + "\n"
    api_key = authenticate_api_key(lines[0])
    assert api_key.organization.name == "Acme" and api_key.name == "deploy"
    assert api_key.scopes == ["inference", "manage"]
    assert api_key.created_by.email == "ops@example.com" and api_key.origin == ApiKey.Origin.COMMAND_LINE
    assert Membership.objects.get(user__email="ops@example.com", organization__name="Acme").role == "owner"
    assert "created the organization" in result.stderr and lines[0] not in result.stderr


def test_createkey_reuses_an_existing_org_and_its_owner():
    owner = create_user(email="ada@example.com", password="a-long-pass-phrase-42")
    org = create_organization(name="Acme", owner=owner)
    result = createkey("--org", "Acme")
    assert result.returncode == 0, result.stderr
    api_key = authenticate_api_key(result.stdout.strip())
    assert api_key.organization == org and api_key.created_by == owner and api_key.origin == "command_line"
    assert api_key.scopes == ["inference", "read_usage"]
    assert Organization.objects.count() == 1 and User.objects.count() == 1


@pytest.mark.parametrize("scopes, role", [("inference", "member"), ("inference,manage", "admin")])
def test_createkey_for_a_new_user_of_an_existing_org_gives_them_the_role_the_key_needs(scopes, role):
    """A key acts with its creator's role: only one that manages needs an admin."""
    owner = create_user(email="ada@example.com", password="a-long-pass-phrase-42")
    org = create_organization(name="Acme", owner=owner)
    result = createkey("--org", "Acme", "--email", "bob@example.com", "--scopes", scopes)
    assert result.returncode == 0, result.stderr
    assert Membership.objects.get(organization=org, user__email="bob@example.com").role == role
    assert f"to 'Acme' as {'an admin' if role == 'admin' else 'a member'}" in result.stderr
    assert authenticate_api_key(result.stdout.strip()).created_by.email == "bob@example.com"


def test_createkey_into_an_organization_without_owner_makes_a_key_that_acts_as_it():
    """No user to make it for: the key says the command line made it, the one creator-less key with
    an owner's rights (a deleted member's key is revoked, never left like this)."""
    owner = create_user(email="ada@example.com", password="a-long-pass-phrase-42")
    org = create_organization(name="Acme", owner=owner)
    Membership.objects.filter(organization=org).update(role="member")
    result = createkey("--org", "Acme", "--scopes", "manage")
    assert result.returncode == 0, result.stderr
    api_key = authenticate_api_key(result.stdout.strip())
    assert api_key.created_by is None and api_key.acts_as_organization


def test_createkey_refuses_an_unknown_scope_in_one_line_and_writes_nothing():
    result = createkey("--org", "Acme", "--email", "ops@example.com", "--scopes", "inference,root")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().count("\n") == 0 and "scope" in result.stderr and "Traceback" not in result.stderr
    assert not Organization.objects.exists() and not User.objects.exists() and not ApiKey.objects.exists()


def test_createkey_has_help():
    result = subprocess.run([*CLI, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: inference-platform createkey")
    assert "--scopes" in result.stdout and "--org" in result.stdout


def test_up_saves_one_key_and_prints_the_same_one_again(tmp_path, settings):
    settings.DATA_DIR = tmp_path
    cli.ensure_admin(settings)
    first = cli.ensure_api_key(settings)
    saved = tmp_path / "api-key.txt"
    assert saved.read_text().strip() == first
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert cli.ensure_api_key(settings) == first
    api_key = authenticate_api_key(first)
    assert api_key.organization.name == "default" and api_key.created_by.is_superuser
    assert api_key.origin == ApiKey.Origin.COMMAND_LINE
    # A revoked (or lost) key is replaced by a working one.
    ApiKey.objects.update(revoked_at="2000-01-01T00:00:00Z")
    read_cache.invalidate()  # a queryset update sends no signal
    second = cli.ensure_api_key(settings)
    assert second != first and authenticate_api_key(second).organization == api_key.organization
