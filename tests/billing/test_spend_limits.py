"""Customers set their organization's monthly spend limit themselves: ``GET/PUT /v1/billing/limits``
(an API key: read_usage to read, manage to change; the dashboard session: owners and admins) and the
billing page's form. The limit is what the quota check then refuses at."""

from __future__ import annotations

import json
import uuid
from decimal import Decimal

import pytest
from django.test import Client

from accounts.models import Membership
from accounts.services import add_member, create_user
from billing import selectors, services
from billing.errors import QuotaExceeded
from billing.models import SpendLimit
from tests.billing.conftest import make_key, make_organization

pytestmark = pytest.mark.django_db

LIMITS = "/v1/billing/limits"


def bearer(plaintext: str) -> dict:
    return {"Authorization": f"Bearer {plaintext}"}


def limit_of(organization):
    return selectors.organization_monthly_limit(organization=organization)


def put(client, body, *, key: str | None = None, raw: str | None = None):
    return client.generic("PUT", LIMITS, raw if raw is not None else json.dumps(body), content_type="application/json",
                          headers=bearer(key) if key else {})


@pytest.fixture
def acme(db):
    organization = make_organization("Acme")
    _, manager = make_key(organization, scopes=["manage"], name="manager")
    _, reader = make_key(organization, scopes=["read_usage"], name="reader")
    return organization, manager, reader


def member_of(organization, role: str):
    user = create_user(email=f"{role}-{uuid.uuid4().hex[:8]}@example.com", password=None, validate=False)
    add_member(organization=organization, user=user, role=role)
    return user


# --- the API -----------------------------------------------------------------------------------------


def test_a_manage_key_sets_reads_and_removes_the_limit(client, acme):
    organization, manager, reader = acme
    body = client.get(LIMITS, headers=bearer(reader)).json()
    assert body == {"object": "billing.spend_limit", "monthly_limit": None, "monthly_spend": "0.000000",
                    "balance_alert": None, "spend_alert": None, "currency": "usd"}

    response = put(client, {"monthly_limit": "100.00"}, key=manager)
    assert response.status_code == 200, response.content
    assert response.json()["monthly_limit"] == "100.000000"
    assert limit_of(organization) == Decimal("100")
    assert client.get(LIMITS, headers=bearer(reader)).json()["monthly_limit"] == "100.000000"
    assert client.get("/v1/billing/balance", headers=bearer(reader)).json()["monthly_limit"] == "100.000000"

    assert put(client, {"monthly_limit": "0.125"}, key=manager).json()["monthly_limit"] == "0.125000"
    assert limit_of(organization) == Decimal("0.125")

    response = put(client, {"monthly_limit": None}, key=manager)
    assert response.status_code == 200 and response.json()["monthly_limit"] is None
    assert limit_of(organization) is None


def test_the_limit_set_through_the_api_is_what_the_quota_check_refuses_at(client, acme):
    organization, manager, _ = acme
    assert put(client, {"monthly_limit": "0"}, key=manager).status_code == 200
    with pytest.raises(QuotaExceeded) as caught:
        services.check_quota(organization=organization)
    # The refusal says where the limit is changed, and that place exists.
    assert "billing page" in caught.value.message and "PUT /v1/billing/limits" in caught.value.message
    assert put(client, {"monthly_limit": None}, key=manager).status_code == 200
    services.check_quota(organization=organization)  # no limit: the balance alone decides


@pytest.mark.parametrize("raw", [
    '{"monthly_limit": 100}', '{"monthly_limit": 100.5}', '{"monthly_limit": 1e2}', '{"monthly_limit": "abc"}',
    '{"monthly_limit": "-1"}', '{"monthly_limit": "1e3"}', '{"monthly_limit": "1.0000001"}',
    '{"monthly_limit": "1000000000000"}', '{"monthly_limit": "999999999999.999999"}',
    '{"monthly_limit": "1000000000"}', '{"monthly_limit": ""}', '{"monthly_limit": true}',
    '{"monthly_limit": ["1"]}', '{"monthly_limit": {"amount": "1"}}', "{}",
])
def test_bad_input_is_400_naming_monthly_limit_and_changes_nothing(client, acme, raw):
    organization, manager, _ = acme
    services.set_spend_limit(organization=organization, monthly_limit=Decimal("42"))
    response = put(client, None, key=manager, raw=raw)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "monthly_limit" and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert limit_of(organization) == Decimal("42")


def test_a_misspelt_field_is_400_naming_it_and_changes_nothing(client, acme):
    organization, manager, _ = acme
    services.set_spend_limit(organization=organization, monthly_limit=Decimal("42"))
    response = put(client, None, key=manager, raw='{"montly_limit": "5"}')
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("montly_limit", "unknown_parameter")
    assert "monthly_limit, balance_alert, spend_alert" in error["message"]
    assert limit_of(organization) == Decimal("42")


def test_what_a_get_answered_can_be_sent_back_with_a_change(client, acme):
    organization, manager, reader = acme
    read = client.get(LIMITS, headers=bearer(reader)).json()
    assert {"object", "monthly_spend", "currency"} <= set(read)
    response = put(client, {**read, "monthly_limit": "55.00"}, key=manager)
    assert response.status_code == 200, response.content
    assert limit_of(organization) == Decimal("55")


def test_a_negative_amount_is_refused_as_negative(client, acme):
    organization, manager, _ = acme
    error = put(client, None, key=manager, raw='{"monthly_limit": "-5"}').json()["error"]
    assert (error["param"], error["code"]) == ("monthly_limit", "invalid_value")
    assert error["message"] == "'monthly_limit' cannot be negative: '-5'."


def test_the_largest_limit_is_accepted_and_one_above_is_refused_naming_the_maximum(client, acme):
    organization, manager, reader = acme
    response = put(client, {"monthly_limit": "999999999.999999"}, key=manager)
    assert response.status_code == 200 and response.json()["monthly_limit"] == "999999999.999999"
    assert client.get("/v1/billing/balance", headers=bearer(reader)).json()["monthly_limit"] == "999999999.999999"
    response = put(client, {"monthly_limit": "999999999999.999999"}, key=manager)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "monthly_limit" and "at most 999,999,999.999999 USD" in error["message"]
    assert limit_of(organization) == Decimal("999999999.999999")


def _sqlite_round_trip(value: Decimal) -> Decimal:
    """``value`` written to and read back from a SpendLimit-like column of a real SQLite database,
    through Django's own SQLite adapter and converter (the suite's database is PostgreSQL)."""
    from django.db.models.expressions import Col
    from django.db.utils import ConnectionHandler

    connection = ConnectionHandler({"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}})["default"]
    field = SpendLimit._meta.get_field("monthly_limit")
    try:
        with connection.cursor() as cursor:
            cursor.execute("CREATE TABLE limits (monthly_limit decimal)")
            cursor.execute("INSERT INTO limits VALUES (%s)", [connection.ops.adapt_decimalfield_value(
                value, field.max_digits, field.decimal_places)])
            cursor.execute("SELECT monthly_limit FROM limits")
            stored = cursor.fetchone()[0]
        column = Col("limits", field)
        return connection.ops.get_decimalfield_converter(column)(stored, column, connection)
    finally:
        connection.close()


def test_every_limit_billing_accepts_round_trips_exactly_on_sqlite():
    from decimal import InvalidOperation

    from billing.models import LIMIT_MAX

    for value in (LIMIT_MAX, Decimal("123456789.123456"), Decimal("0.000001")):
        services._limit("monthly_limit", value)  # accepted
        assert _sqlite_round_trip(value) == value
    # What the old bound let through: read back rounded, or not at all.
    assert _sqlite_round_trip(Decimal("123456789012.123456")) != Decimal("123456789012.123456")
    with pytest.raises(InvalidOperation):
        _sqlite_round_trip(Decimal("999999999999.999999"))


@pytest.mark.django_db(transaction=True)
def test_the_migration_brings_stored_limits_down_to_the_maximum():
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    from billing.models import LIMIT_MAX, ApiKeySpendLimit

    organization, small = make_organization("Big"), make_organization("Small")
    big_key, _ = make_key(organization)
    small_key, _ = make_key(small)
    before = [("billing", "0006_refused_usage_events")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    try:  # what the old bound (below 10^12) let through
        apps = executor.loader.project_state(before).apps
        old_limit, old_key_limit = apps.get_model("billing", "SpendLimit"), apps.get_model("billing", "ApiKeySpendLimit")
        old_limit.objects.create(organization_id=organization.pk, monthly_limit=Decimal("999999999999.999999"))
        old_limit.objects.create(organization_id=small.pk, monthly_limit=Decimal("100"))
        old_key_limit.objects.create(api_key_id=big_key.pk, amount_limit=Decimal("1000000000"))
        old_key_limit.objects.create(api_key_id=small_key.pk, amount_limit=None, token_limit=5)
    finally:  # to the latest again: later tests need every migration
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
    assert limit_of(organization) == LIMIT_MAX and limit_of(small) == Decimal("100")
    assert ApiKeySpendLimit.objects.get(api_key=big_key).amount_limit == LIMIT_MAX
    assert ApiKeySpendLimit.objects.get(api_key=small_key).amount_limit is None


def test_a_json_number_is_refused_asking_for_a_string(client, acme):
    _, manager, _ = acme
    message = put(client, None, key=manager, raw='{"monthly_limit": 100.10}').json()["error"]["message"]
    assert "as a string" in message


def test_a_body_that_is_not_json_is_400(client, acme):
    _, manager, _ = acme
    response = put(client, None, key=manager, raw="{not json")
    assert response.status_code == 400 and set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_another_organizations_key_changes_only_its_own_limit(client, acme):
    organization, _, _ = acme
    globex = make_organization("Globex")
    _, their_manager = make_key(globex, scopes=["manage", "read_usage"], name="theirs")
    services.set_spend_limit(organization=organization, monthly_limit=Decimal("42"))
    response = put(client, {"monthly_limit": "1.00"}, key=their_manager)
    assert response.status_code == 200
    assert limit_of(globex) == Decimal("1") and limit_of(organization) == Decimal("42")
    assert client.get(LIMITS, headers=bearer(their_manager)).json()["monthly_limit"] == "1.000000"


def test_scopes_and_authentication(client, acme):
    organization, manager, reader = acme
    _, inference = make_key(organization, scopes=["inference"], name="inference")
    for key in (reader, inference):  # changing takes the manage scope
        response = put(client, {"monthly_limit": "1.00"}, key=key)
        assert response.status_code == 403 and response.json()["error"]["code"] == "missing_scope"
    response = client.get(LIMITS, headers=bearer(inference))  # reading takes read_usage
    assert response.status_code == 403 and response.json()["error"]["code"] == "missing_scope"
    response = put(client, {"monthly_limit": "1.00"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "invalid_request_error"
    assert client.get(LIMITS).status_code == 401
    assert limit_of(organization) is None
    assert client.post(LIMITS, {"monthly_limit": "1.00"}, content_type="application/json",
                       headers=bearer(manager)).status_code == 405


@pytest.mark.parametrize("role, allowed", [("owner", True), ("admin", True), ("member", False)])
def test_dashboard_session_owners_and_admins_may_change_it_members_may_not(client, acme, role, allowed):
    organization, _, _ = acme
    user = organization.memberships.get().user if role == "owner" else member_of(organization, role)
    client.force_login(user)
    assert client.get(LIMITS).json()["monthly_limit"] is None  # every member may read it
    response = put(client, {"monthly_limit": "25.00"})
    if allowed:
        assert response.status_code == 200 and limit_of(organization) == Decimal("25")
    else:
        assert response.status_code == 403
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "insufficient_role"
        assert limit_of(organization) is None


@pytest.mark.parametrize("role, allowed", [("owner", True), ("admin", True), ("member", False)])
def test_a_key_acts_with_its_creators_role(client, acme, role, allowed):
    """A member cannot lift the limit with a manage key of their own making."""
    from accounts.services import create_api_key

    organization, _, _ = acme
    user = organization.memberships.get().user if role == "owner" else member_of(organization, role)
    _, plaintext = create_api_key(organization=organization, name=f"{role}'s", scopes=["manage"], created_by=user)
    response = put(client, {"monthly_limit": "25.00"}, key=plaintext)
    assert response.status_code == (200 if allowed else 403), response.content
    assert limit_of(organization) == (Decimal("25") if allowed else None)


def test_a_key_without_a_creator_not_made_by_the_command_line_may_not_change_it(client, acme):
    organization, _, _ = acme
    _, orphan = make_key(organization, scopes=["manage", "read_usage"], name="orphan", origin="member")
    response = put(client, {"monthly_limit": "25.00"}, key=orphan)
    assert response.status_code == 403 and response.json()["error"]["code"] == "insufficient_role"
    assert limit_of(organization) is None
    assert client.get(LIMITS, headers=bearer(orphan)).status_code == 200  # reading stays allowed


def test_a_deleted_members_key_cannot_change_it(client, acme):
    """Their creator deleted, keys used to act as the command line's: a member's 403 became a 200."""
    from accounts.services import create_api_key

    organization, _, _ = acme
    member = member_of(organization, "member")
    _, plaintext = create_api_key(organization=organization, name="theirs", scopes=["manage"], created_by=member)
    assert put(client, {"monthly_limit": "25.00"}, key=plaintext).status_code == 403
    member.delete()
    response = put(client, {"monthly_limit": "25.00"}, key=plaintext)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert "revoked" in response.json()["error"]["message"]
    assert limit_of(organization) is None


def test_a_session_put_needs_the_csrf_token(acme):
    organization, _, _ = acme
    client = Client(enforce_csrf_checks=True)
    client.force_login(organization.memberships.get().user)
    response = put(client, {"monthly_limit": "25.00"})
    assert response.status_code == 403
    assert limit_of(organization) is None


def test_the_openapi_document_describes_the_limits_endpoint(client):
    document = client.get("/v1/openapi.json").json()
    operations = document["paths"]["/v1/billing/limits"]
    assert {"get", "put"} <= set(operations)
    request = operations["put"]["requestBody"]["content"]["application/json"]["schema"]
    name = request["$ref"].rsplit("/", 1)[1]
    for name_ in ("monthly_limit", "balance_alert", "spend_alert"):  # any of them: one left out stays
        field = document["components"]["schemas"][name]["properties"][name_]
        assert field["type"] == "string" and field.get("nullable") is True
        assert name_ not in document["components"]["schemas"][name].get("required", [])
    answer = operations["put"]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert {"monthly_limit", "monthly_spend", "balance_alert", "spend_alert"} <= \
        set(document["components"]["schemas"][answer]["properties"])
    for code in ("400", "401", "403"):
        assert code in operations["put"]["responses"]


# --- the billing page's form --------------------------------------------------------------------------


FORM = "/billing/limit/"


@pytest.fixture
def owner(client, acme):
    organization, _, _ = acme
    client.force_login(organization.memberships.get().user)
    return client, organization


def test_owners_see_the_form_members_do_not(client, acme):
    organization, _, _ = acme
    client.force_login(organization.memberships.get().user)
    page = client.get("/billing/").content.decode()
    assert 'id="spend-limit-form"' in page and 'action="/billing/limit/"' in page and "csrfmiddlewaretoken" in page
    assert 'id="spend-limit-remove"' not in page  # nothing to remove yet
    client.force_login(member_of(organization, Membership.Role.MEMBER))
    page = client.get("/billing/").content.decode()
    assert 'id="spend-limit-form"' not in page and "No monthly limit" in page


def test_the_form_sets_shows_and_removes_the_limit(owner):
    client, organization = owner
    response = client.post(FORM, {"monthly_limit": " 50.5 ", "action": "save"})
    assert response.status_code == 302 and response["Location"] == "/billing/"
    assert limit_of(organization) == Decimal("50.5")
    page = client.get("/billing/").content.decode()
    assert 'value="50.50"' in page and 'id="spend-limit-remove"' in page
    assert "The monthly spend limit is now $50.50." in page

    response = client.post(FORM, {"monthly_limit": "50.50", "action": "remove"})
    assert response.status_code == 302 and limit_of(organization) is None
    assert client.post(FORM, {"monthly_limit": "7", "action": "save"}).status_code == 302
    assert limit_of(organization) == Decimal("7")
    assert client.post(FORM, {"monthly_limit": "", "action": "save"}).status_code == 302  # empty: no limit
    assert limit_of(organization) is None


@pytest.mark.parametrize("value", ["abc", "-5", "1e3", "12,50", "1.0000001", "1000000000000", "999999999999.999999"])
def test_the_form_refuses_bad_amounts_and_says_why(owner, value):
    client, organization = owner
    services.set_spend_limit(organization=organization, monthly_limit=Decimal("42"))
    response = client.post(FORM, {"monthly_limit": value, "action": "save"})
    assert response.status_code == 400
    page = response.content.decode()
    assert 'id="spend-limit-error"' in page and 'aria-invalid="true"' in page
    assert f'value="{value}"' in page  # what was typed stays in the field
    assert ("such as 100 or 100.50" in page) == (value in ("abc", "-5", "1e3", "12,50"))
    assert limit_of(organization) == Decimal("42")


def test_a_member_cannot_post_the_form(client, acme):
    organization, _, _ = acme
    client.force_login(member_of(organization, Membership.Role.MEMBER))
    response = client.post(FORM, {"monthly_limit": "1.00", "action": "save"})
    assert response.status_code == 403 and not SpendLimit.objects.filter(organization=organization).exists()


def test_the_form_needs_the_csrf_token_and_a_login(acme):
    organization, _, _ = acme
    anonymous = Client()
    response = anonymous.post(FORM, {"monthly_limit": "1.00"})
    assert response.status_code == 302 and "/login/" in response["Location"]
    client = Client(enforce_csrf_checks=True)
    client.force_login(organization.memberships.get().user)
    assert client.post(FORM, {"monthly_limit": "1.00"}).status_code == 403
    assert client.get(FORM).status_code == 405
    assert limit_of(organization) is None
