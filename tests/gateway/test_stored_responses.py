"""Stored responses in the process: what a row keeps and for how long, who reads it, the pages of
its input items, and what a continued request is made of."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gateway import pages, selectors, services
from gateway.errors import ApiError
from gateway.models import StoredResponse
from gateway.responses import parse_response_request


def _response(response_id: str, text: str = "Blue.") -> dict:
    return {"id": response_id, "object": "response", "status": "completed", "output": [
        {"id": f"msg_{response_id}", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}]}


def _store(org, response_id: str, conversation=None, text: str = "Blue.") -> dict:
    response = _response(response_id, text)
    services.store_response(organization_id=org.pk, response=response,
                            conversation=conversation or [{"id": "msg_in", "type": "message", "role": "user",
                                                           "content": [{"type": "input_text", "text": "Hi"}]}])
    return response


@pytest.mark.django_db
def test_a_response_is_read_back_whole_by_its_organization_only(org_key):
    mine, _, _ = org_key()
    theirs, _, _ = org_key()
    # What a JSON column refuses still comes back: a NUL and a lone surrogate in a client's text.
    odd = [{"id": "msg_x", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "a\x00b\ud800"}]}]
    response = _store(mine, "resp_a", odd, text="é\x00")
    assert selectors.stored_response(organization_id=mine.pk, response_id="resp_a") == response
    assert selectors.input_items(organization_id=mine.pk, response_id="resp_a") == odd
    assert selectors.conversation_after(organization_id=mine.pk, response_id="resp_a") == [*odd, *response["output"]]
    assert selectors.stored_response(organization_id=theirs.pk, response_id="resp_a") is None
    assert not services.delete_response(organization_id=theirs.pk, response_id="resp_a")
    assert services.delete_response(organization_id=mine.pk, response_id="resp_a")
    assert selectors.stored_response(organization_id=mine.pk, response_id="resp_a") is None


@pytest.mark.django_db
def test_storing_an_id_again_changes_nothing(org_key):
    org, _, _ = org_key()
    first = _store(org, "resp_b", text="one")
    _store(org, "resp_b", text="two")
    assert selectors.stored_response(organization_id=org.pk, response_id="resp_b") == first


@pytest.mark.django_db
@pytest.mark.parametrize("response_id", ["resp_\x00", "r" * 65, "resp_\n"])
def test_an_id_the_database_cannot_hold_is_simply_not_found(org_key, response_id):
    org, _, _ = org_key()
    assert selectors.stored_response(organization_id=org.pk, response_id=response_id) is None
    assert not services.delete_response(organization_id=org.pk, response_id=response_id)


@pytest.mark.django_db
def test_a_response_past_its_retention_is_gone_at_once_and_purged_later(org_key, settings):
    from gateway.tasks import purge_expired_responses

    settings.RESPONSES_RETENTION_DAYS = 30
    org, _, _ = org_key()
    _store(org, "resp_old")
    _store(org, "resp_new")
    StoredResponse.objects.filter(pk="resp_old").update(created_at=timezone.now() - timedelta(days=30, seconds=1))
    StoredResponse.objects.filter(pk="resp_new").update(created_at=timezone.now() - timedelta(days=29))
    for read in (selectors.stored_response, selectors.input_items, selectors.conversation_after):
        assert read(organization_id=org.pk, response_id="resp_old") is None
        assert read(organization_id=org.pk, response_id="resp_new") is not None
    assert purge_expired_responses() == 1
    assert list(StoredResponse.objects.values_list("pk", flat=True)) == ["resp_new"]


def test_every_periodic_task_is_one_celery_knows():
    from django.conf import settings

    from inference_platform.celery import app

    app.loader.import_default_modules()
    for entry in settings.CELERY_BEAT_SCHEDULE.values():
        assert entry["task"] in app.tasks, entry


# ---------------------------------------------------------------------------------------- requests

HISTORY = [{"id": "msg_q", "type": "message", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": "Call it."}]},
           {"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "call_1", "name": "f",
            "arguments": "{}"}]


def test_a_continued_request_is_the_stored_conversation_then_its_input_without_old_instructions():
    parsed = parse_response_request(
        {"model": "m", "previous_response_id": "resp_1", "instructions": "New rules.",
         "input": [{"type": "function_call_output", "call_id": "call_1", "output": "42"}]},
        history=lambda rid: HISTORY if rid == "resp_1" else None, can_store=True)
    assert parsed.inference.messages == [
        {"role": "system", "content": "New rules."}, {"role": "user", "content": "Call it."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    assert parsed.conversation[:2] == HISTORY and parsed.conversation[2]["type"] == "function_call_output"
    assert parsed.conversation[2]["id"].startswith("fco_")
    assert parsed.settings["previous_response_id"] == "resp_1" and parsed.store


@pytest.mark.parametrize("body, can_store, stored", [({}, True, True), ({"store": False}, True, False),
                                                     ({"store": True}, False, False), ({}, False, False)])
def test_a_response_is_stored_unless_it_asks_not_to_be_or_none_are_kept(body, can_store, stored):
    parsed = parse_response_request({"model": "m", "input": "Hi", **body}, can_store=can_store)
    assert parsed.store is stored and parsed.settings["store"] is stored


@pytest.mark.parametrize("previous, status", [(7, 400), ("", 400), ("resp_unknown", 404), ("resp_\x00", 404)])
def test_a_previous_response_id_that_names_nothing_is_refused(previous, status):
    looked_up = []
    with pytest.raises(ApiError) as refused:
        parse_response_request({"model": "m", "input": "Hi", "previous_response_id": previous},
                               history=lambda rid: looked_up.append(rid))
    assert refused.value.status == status and refused.value.param == "previous_response_id"
    assert "\x00" not in "".join(looked_up)  # never sent to the database


# ------------------------------------------------------------------------------------------ pages

ITEMS = [{"id": f"item_{i}"} for i in range(5)]


def _ids(page: dict) -> list[str]:
    return [item["id"] for item in page["data"]]


def test_a_page_is_newest_first_by_default_and_follows_its_cursors():
    first = pages.page(ITEMS, pages.parse({"limit": "2"}))
    assert _ids(first) == ["item_4", "item_3"] and first["has_more"]
    assert (first["first_id"], first["last_id"]) == ("item_4", "item_3")
    rest = pages.page(ITEMS, pages.parse({"limit": "2", "after": first["last_id"]}))
    assert _ids(rest) == ["item_2", "item_1"] and rest["has_more"]
    last = pages.page(ITEMS, pages.parse({"after": "item_1"}))
    assert _ids(last) == ["item_0"] and not last["has_more"]
    assert _ids(pages.page(ITEMS, pages.parse({"order": "asc", "before": "item_3"}))) == ["item_0", "item_1", "item_2"]
    empty = pages.page([], pages.parse({}))
    assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


@pytest.mark.parametrize("query, param", [({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"),
                                          ({"limit": "²"}, "limit"), ({"limit": "-1"}, "limit"),
                                          ({"order": "newest"}, "order")])
def test_a_bad_page_query_names_its_parameter(query, param):
    with pytest.raises(ApiError) as refused:
        pages.parse(query)
    assert refused.value.status == 400 and refused.value.param == param


def test_a_cursor_that_is_not_in_the_list_names_its_parameter():
    for name in ("after", "before"):
        with pytest.raises(ApiError) as refused:
            pages.page(ITEMS, pages.parse({name: "item_9"}))
        assert refused.value.param == name
