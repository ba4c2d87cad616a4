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
    assert selectors.conversation_after(organization_id=mine.pk, response_id="resp_a") == (
        [*odd, *response["output"]], "completed")
    assert selectors.stored_response(organization_id=theirs.pk, response_id="resp_a") is None
    assert not services.delete_response(organization_id=theirs.pk, response_id="resp_a")
    assert selectors.stored_response(organization_id=mine.pk, response_id="resp_a") == response
    assert services.delete_response(organization_id=mine.pk, response_id="resp_a")
    assert selectors.stored_response(organization_id=mine.pk, response_id="resp_a") is None


@pytest.mark.django_db
def test_text_is_stored_as_utf8_and_only_a_lone_surrogate_is_escaped(org_key):
    org, _, _ = org_key()
    _store(org, "resp_utf8", text="日本語")
    assert "日本語" in StoredResponse.objects.get(pk="resp_utf8").response
    _store(org, "resp_surrogate", text="日本\ud800")
    row = StoredResponse.objects.get(pk="resp_surrogate")
    assert "\\ud800" in row.response and "\\u65e5" in row.response
    assert selectors.stored_response(organization_id=org.pk, response_id="resp_surrogate")["output"][0][
        "content"][0]["text"] == "日本\ud800"


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
    assert not services.delete_response(organization_id=org.pk, response_id="resp_old")  # as gone as unread
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
        history=lambda rid: (HISTORY, "completed") if rid == "resp_1" else None, can_store=True)
    assert parsed.inference.messages == [
        {"role": "system", "content": "New rules."}, {"role": "user", "content": "Call it."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    assert parsed.conversation[:2] == HISTORY and parsed.conversation[2]["type"] == "function_call_output"
    assert parsed.conversation[2]["id"].startswith("fco_")
    assert parsed.settings["previous_response_id"] == "resp_1" and parsed.store


def test_a_call_of_input_is_its_own_message_even_right_after_the_stored_conversations_call():
    # The stored conversation ends with an unanswered call; input adds a call and only one result.
    with pytest.raises(ApiError) as refused:
        parse_response_request(
            {"model": "m", "previous_response_id": "resp_1", "input": [
                {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_2", "output": "x"}]},
            history=lambda rid: (HISTORY, "completed"))
    assert refused.value.param == "input"  # what the client must add to: not a name it never sent
    assert "input[0]" not in refused.value.message  # the unanswered call is the stored one


def test_assistant_text_in_input_is_stored_as_the_clients_output_text_type_has_it():
    from openai.types.responses import ResponseItem
    from pydantic import TypeAdapter

    parsed = parse_response_request({"model": "m", "input": [{"role": "user", "content": "Hi"},
                                                             {"role": "assistant", "content": "Hello."}]})
    items = [TypeAdapter(ResponseItem).validate_python(item) for item in parsed.conversation]
    assert items[1].content[0].annotations == [] and items[1].content[0].text == "Hello."
    assert items[0].content[0].type == "input_text"


@pytest.mark.parametrize("body, can_store, stored", [({}, True, True), ({"store": False}, True, False),
                                                     ({"store": True}, False, False), ({}, False, False)])
def test_a_response_is_stored_unless_it_asks_not_to_be_or_none_are_kept(body, can_store, stored):
    parsed = parse_response_request({"model": "m", "input": "Hi", **body}, can_store=can_store)
    assert parsed.store is stored and parsed.settings["store"] is stored


@pytest.mark.parametrize("previous, code", [(7, "invalid_value"), ("", "invalid_value"),
                                            ("resp_unknown", "previous_response_not_found"),
                                            ("resp_\x00", "previous_response_not_found")])
def test_a_previous_response_id_that_names_nothing_is_refused(previous, code):
    looked_up = []
    with pytest.raises(ApiError) as refused:
        parse_response_request({"model": "m", "input": "Hi", "previous_response_id": previous},
                               history=lambda rid: looked_up.append(rid))
    # A 400 even for an id that names nothing, as OpenAI answers it (clients resend the whole
    # conversation on that 400).
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "previous_response_id", code)
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


def test_before_is_the_page_just_before_its_cursor():
    page = pages.page(ITEMS, pages.parse({"order": "asc", "before": "item_4", "limit": "2"}))
    assert _ids(page) == ["item_2", "item_3"] and not page["has_more"]


@pytest.mark.parametrize("query, param", [({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"),
                                          ({"limit": "1" * 5000}, "limit"), ({"limit": "020"}, None),
                                          ({"limit": "²"}, "limit"), ({"limit": "-1"}, "limit"),
                                          ({"order": "newest"}, "order")])
def test_a_bad_page_query_names_its_parameter(query, param):
    if param is None:
        assert pages.parse(query).limit == 20
        return
    with pytest.raises(ApiError) as refused:
        pages.parse(query)
    assert refused.value.status == 400 and refused.value.param == param


def test_a_cursor_that_is_not_in_the_list_names_its_parameter():
    for name in ("after", "before"):
        with pytest.raises(ApiError) as refused:
            pages.page(ITEMS, pages.parse({name: "item_9"}))
        assert refused.value.param == name


# ------------------------------------------------------------------------------------------ views

def _get(client, path: str, key: str):
    return client.get(path, HTTP_AUTHORIZATION=f"Bearer {key}")


@pytest.mark.django_db
def test_the_stored_response_endpoints_answer_their_organization_only(client, org_key):
    mine, _, key = org_key()
    _, _, their_key = org_key()
    reader_org, _, reader_key = org_key(scopes=("read_usage",))
    response = _store(mine, "resp_v")
    assert _get(client, "/v1/responses/resp_v", key).json() == response
    assert _get(client, "/v1/responses/resp_v/input_items", key).json()["data"][0]["id"] == "msg_in"
    for path in ("/v1/responses/resp_v", "/v1/responses/resp_v/input_items"):
        refused = _get(client, path, their_key)
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "response_not_found"
        assert _get(client, path, reader_key).status_code == 403  # the inference scope reads them
    assert client.delete("/v1/responses/resp_v", HTTP_AUTHORIZATION=f"Bearer {their_key}").status_code == 404
    streamed = client.get("/v1/responses/resp_v?stream=true", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    assert client.post("/v1/responses/resp_v", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 405
    deleted = client.delete("/v1/responses/resp_v", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert deleted.json() == {"id": "resp_v", "object": "response", "deleted": True}
    assert _get(client, "/v1/responses/resp_v", key).status_code == 404


# ---------------------------------------------------------------------------------------- events

class _Call:
    """What ``response_events`` reads of a call: its events."""

    def __init__(self, *events: dict):
        self._events = events

    async def events(self):
        for event in self._events:
            yield event


def _delta(text: str, logprob: float | None = None) -> dict:
    entries = None if logprob is None else [{"token": text, "logprob": logprob, "bytes": list(text.encode()),
                                             "top": [[text, logprob, list(text.encode())]]}]
    return {"type": "inference.delta", "text": text, "token_ids": [1], "logprobs": entries}


FINISHED = {"type": "inference.finished", "finish_reason": "stop", "error": None, "timings": {},
            "usage": {"prompt_tokens": 3, "cached_prompt_tokens": 0, "completion_tokens": 2}}


def _builder(**settings):
    from gateway.response_events import ResponseBuilder

    return ResponseBuilder(response_id="resp_e", created=0, model="m", sampling={}, settings={"store": True, **settings})


@pytest.mark.parametrize("stored", [True, False])
def test_a_streamed_response_is_kept_before_its_last_event_and_says_whether_it_was(stored):
    import asyncio

    from gateway.response_events import stream

    sent, kept = [], []

    async def keep(response):
        kept.append((len(sent), response["status"], response["output"][0]["content"][0]["text"]))
        return stored

    async def scenario():
        async for event in stream(_Call(_delta("Hi"), _delta("!"), FINISHED), _builder(), keep):
            sent.append(event)

    asyncio.run(scenario())
    assert kept == [(len(sent) - 1, "completed", "Hi!")]  # every event but the last was out already
    assert sent[-1]["type"] == "response.completed" and sent[-1]["response"]["store"] is stored


def test_a_response_that_does_not_ask_to_be_stored_is_not_kept_and_a_restart_keeps_only_the_last_run():
    import asyncio

    from gateway.response_events import collect

    kept = []

    async def keep(response):
        kept.append(response["output"][0]["content"][0]["text"])
        return True

    restarted = _Call(_delta("Old"), {"type": "inference.restarted"}, _delta("New"), FINISHED)
    whole = asyncio.run(collect(restarted, _builder, keep))
    assert kept == ["New"] and whole["output"][0]["content"][0]["text"] == "New"
    asyncio.run(collect(_Call(_delta("Hi"), FINISHED), lambda: _builder(store=False), keep))
    assert kept == ["New"]


def test_asked_for_logprobs_go_with_the_text_they_scored():
    builder = _builder()
    events = builder.start() + builder.feed(_delta("Hi", -0.25)) + builder.feed(_delta("!", -1.5))
    events += builder.finish(FINISHED)
    deltas = [e["logprobs"] for e in events if e["type"] == "response.output_text.delta"]
    assert [[(lp["token"], lp["logprob"]) for lp in entries] for entries in deltas] == [[("Hi", -0.25)], [("!", -1.5)]]
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert [lp["logprob"] for lp in done["logprobs"]] == [-0.25, -1.5]
    assert builder.response["output"][0]["content"][0]["logprobs"] == done["logprobs"]
    assert done["logprobs"][0]["top_logprobs"] == [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]}]
    # The part announced when the message opened stays as it was then.
    [added] = [e for e in events if e["type"] == "response.content_part.added"]
    assert added["part"]["logprobs"] == []


@pytest.mark.parametrize("body, param", [({"include": "x"}, "include"), ({"include": ["file.bogus"]}, "include[0]"),
                                         ({"top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": True}, "top_logprobs")])
def test_bad_logprob_settings_name_their_parameter(body, param):
    with pytest.raises(ApiError) as refused:
        parse_response_request({"model": "m", "input": "Hi", **body})
    assert refused.value.param == param


def test_include_or_top_logprobs_asks_for_logprobs():
    def sampling(**body):
        return parse_response_request({"model": "m", "input": "Hi", **body}).inference.sampling

    assert sampling(include=["message.output_text.logprobs"])["logprobs"] is True
    assert sampling(top_logprobs=3)["top_logprobs"] == 3 and sampling(top_logprobs=3)["logprobs"] is True
    assert not sampling(include=["reasoning.encrypted_content"]).get("logprobs")


def test_what_asks_for_nothing_is_accepted_and_reasoning_as_a_response_repeats_it():
    """SDKs and frameworks send these at their neutral values (null), and replay ``reasoning`` as
    a response shows it."""
    body = {"model": "m", "input": "Hi", "reasoning": {"effort": None, "summary": None}, "conversation": None,
            "prompt": None, "context_management": None, "prompt_cache_retention": "in_memory"}
    assert parse_response_request(body).inference.messages == [{"role": "user", "content": "Hi"}]
    parse_response_request({"model": "m", "input": "Hi", "reasoning": {"effort": "none"}})
    for reasoning in ({"effort": "high"}, {"summary": "auto"}, "low"):
        with pytest.raises(ApiError) as refused:
            parse_response_request({"model": "m", "input": "Hi", "reasoning": reasoning})
        assert (refused.value.param, refused.value.code) == ("reasoning", "unsupported_value")
    with pytest.raises(ApiError) as refused:
        parse_response_request({"model": "m", "input": "Hi", "conversation": "conv_1"})
    assert (refused.value.param, refused.value.code) == ("conversation", "unsupported_value")
