"""The Logs pages: an organization's stored responses, newest first, one with its conversation,
and their deletion; another organization's stay out of sight."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from gateway import services
from gateway.models import StoredResponse

pytestmark = pytest.mark.django_db


def _store(organization, response_id: str, *, asked: str = "Name a colour.", answered: str = "Blue.",
           previous: str | None = None, age: timedelta = timedelta()) -> None:
    conversation = [{"id": f"msg_in_{response_id}", "type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": asked}]}]
    response = {"id": response_id, "object": "response", "model": "smollm2", "status": "completed",
                "instructions": "Be brief.", "previous_response_id": previous,
                "usage": {"input_tokens": 12, "output_tokens": 3},
                "output": [{"id": f"msg_out_{response_id}", "type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": answered}]},
                           {"id": f"fc_{response_id}", "type": "function_call", "call_id": "call_1",
                            "name": "lookup", "arguments": '{"q": "sky"}'}]}
    services.store_response(organization_id=organization.pk, response=response, conversation=conversation)
    StoredResponse.objects.filter(pk=response_id).update(created_at=timezone.now() - age)


def test_the_log_lists_the_organizations_responses_newest_first(ada, acme, globex):
    _, organization = acme
    _store(organization, "resp_old", asked="First <b>question</b>", age=timedelta(hours=2))
    _store(organization, "resp_new", asked="Second question", answered="x" * 500)
    _store(globex[1], "resp_theirs", asked="Not yours")
    page = ada.get("/responses/")
    html = page.content.decode()
    assert page.status_code == 200
    assert html.index('data-response="resp_new"') < html.index('data-response="resp_old"')
    assert "resp_theirs" not in html and "Not yours" not in html
    assert "First &lt;b&gt;question&lt;/b&gt;" in html  # escaped
    assert "x" * 160 not in html and "x" * 159 + "…" in html  # a long answer is cut
    assert "lookup({&quot;q&quot;: &quot;sky&quot;})" in html  # a call shows as its name and arguments


def test_the_log_pages_through_older_responses(ada, acme):
    _, organization = acme
    for i in range(27):
        _store(organization, f"resp_{i:02d}", age=timedelta(minutes=i))
    first = ada.get("/responses/").content.decode()
    assert first.count("data-response=") == 25 and 'id="older"' in first and 'id="newer"' not in first
    second = ada.get("/responses/?page=2").content.decode()
    assert second.count("data-response=") == 2 and 'data-response="resp_26"' in second and 'id="newer"' in second
    assert ada.get("/responses/?page=abc").status_code == 200  # read as the first page
    assert "No stored responses on this page" in ada.get("/responses/?page=99").content.decode()


def test_a_response_shows_its_conversation_and_can_be_deleted(ada, acme, globex):
    _, organization = acme
    _store(organization, "resp_a", previous="resp_before")
    detail = ada.get("/responses/resp_a/")
    html = detail.content.decode()
    assert detail.status_code == 200
    assert "Be brief." in html and "Name a colour." in html and "Blue." in html and "call_1" in html
    assert 'href="/responses/resp_before/"' in html
    _store(globex[1], "resp_theirs")
    assert ada.get("/responses/resp_theirs/").status_code == 404
    assert ada.post("/responses/resp_theirs/delete/").status_code == 404
    assert StoredResponse.objects.filter(pk="resp_theirs").exists()
    assert ada.get("/responses/resp_a/delete/").status_code == 405
    deleted = ada.post("/responses/resp_a/delete/", follow=True)
    assert "Response resp_a is deleted." in deleted.content.decode()
    assert not StoredResponse.objects.filter(pk="resp_a").exists()
    assert ada.get("/responses/resp_a/").status_code == 404


def test_a_failed_response_shows_as_failed_with_its_error(ada, acme):
    _, organization = acme
    _store(organization, "resp_failed")
    StoredResponse.objects.filter(pk="resp_failed").update(response=json.dumps({
        **json.loads(StoredResponse.objects.get(pk="resp_failed").response), "status": "failed",
        "error": {"code": "engine_error", "message": "The model failed while generating: <oops>."}}))
    assert 'class="badge badge-failed">Failed' in ada.get("/responses/").content.decode()
    html = ada.get("/responses/resp_failed/").content.decode()
    assert "Failed" in html and "engine_error" in html and "The model failed while generating: &lt;oops&gt;." in html


def test_an_expired_response_is_not_shown(ada, acme, settings):
    _, organization = acme
    _store(organization, "resp_expired", age=timedelta(days=settings.RESPONSES_RETENTION_DAYS, seconds=1))
    assert "resp_expired" not in ada.get("/responses/").content.decode()
    assert ada.get("/responses/resp_expired/").status_code == 404


def test_the_log_needs_a_signed_in_member(client):
    assert client.get("/responses/").status_code == 302


def test_only_an_owner_or_admin_deletes_a_stored_response(acme):
    """Stored responses keep no creator: a member reads them and cannot delete one."""
    from django.test import Client

    from accounts.services import add_member
    from tests.dashboard.conftest import sign_up

    owner, organization = acme
    member, _ = sign_up("Mel", "Mel's own")
    add_member(organization=organization, user=member, role="member")
    _store(organization, "resp_kept")
    as_member = Client()
    as_member.force_login(member)
    as_member.post("/organizations/switch/", {"organization": organization.pk})
    page = as_member.get("/responses/resp_kept/").content.decode()
    assert "Blue." in page and "/responses/resp_kept/delete/" not in page
    assert as_member.post("/responses/resp_kept/delete/").status_code == 403
    assert StoredResponse.objects.filter(pk="resp_kept").exists()
    as_owner = Client()
    as_owner.force_login(owner)
    assert "/responses/resp_kept/delete/" in as_owner.get("/responses/resp_kept/").content.decode()
