"""Stored responses through the real stack, with the official client: a response is kept unless it
asks not to be, read back, continued with previous_response_id, listed item by item, and deleted;
another organization never sees it. One whose client leaves before its end is kept too, cancelled."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support import wait_until

from .conftest import DEPLOYMENT

pytestmark = pytest.mark.slow


def _texts(items) -> list[tuple]:
    """What a conversation says, item by item, without the ids."""
    out = []
    for item in items:
        if item.type == "message":
            out.append((item.role, "".join(part.text for part in item.content)))
        else:
            out.append((item.type, getattr(item, "call_id", None), getattr(item, "output", None)))
    return out


def test_a_response_is_stored_read_back_and_continued_as_if_the_conversation_were_sent(openai_client):
    first = openai_client.responses.create(model=DEPLOYMENT, input="Name a colour.", max_output_tokens=12,
                                           temperature=0, metadata={"run": "1"})
    assert first.store is True and first.previous_response_id is None
    assert openai_client.responses.retrieve(first.id).model_dump() == first.model_dump()

    second = openai_client.responses.create(model=DEPLOYMENT, previous_response_id=first.id,
                                            input="Name another one.", max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id
    # The same as sending the whole conversation: the first turn, its answer, the new question.
    explicit = openai_client.responses.create(
        model=DEPLOYMENT, max_output_tokens=12, temperature=0, store=False,
        input=[{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "Name another one."}])
    assert second.output_text == explicit.output_text
    assert second.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens

    items = list(openai_client.responses.input_items.list(second.id, order="asc"))
    assert _texts(items) == [("user", "Name a colour."), ("assistant", first.output_text),
                             ("user", "Name another one.")]
    assert items[1].id == first.output[0].id  # the previous response's output item, as it was returned
    assert len({item.id for item in items}) == 3
    # Newest first by default, and a page at a time (the client follows has_more with after).
    newest_first = list(openai_client.responses.input_items.list(second.id, limit=1))
    assert [item.id for item in newest_first] == [item.id for item in reversed(items)]
    page = openai_client.responses.input_items.list(second.id, limit=2, order="asc")
    assert [item.id for item in page.data] == [item.id for item in items[:2]] and page.has_more


def test_a_streamed_response_is_stored_too(openai_client):
    events = list(openai_client.responses.create(model=DEPLOYMENT, input="Say hello.", max_output_tokens=8,
                                                 temperature=0, stream=True))
    final = events[-1].response
    assert final.store is True
    # Read at once, with no wait (that it is stored before its last event is sent is checked in
    # tests/gateway/test_stored_responses.py).
    stored = openai_client.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.status == final.status
    assert stored.usage.output_tokens == final.usage.output_tokens


def test_an_unstored_or_deleted_response_cannot_be_read_or_continued(openai_client):
    unstored = openai_client.responses.create(model=DEPLOYMENT, input="Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as refused:
        openai_client.responses.retrieve(unstored.id)
    assert refused.value.body["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError) as refused:  # a 400, as OpenAI's
        openai_client.responses.create(model=DEPLOYMENT, input="Hi", previous_response_id=unstored.id)
    assert refused.value.body["param"] == "previous_response_id"
    assert refused.value.body["code"] == "previous_response_not_found"

    first = openai_client.responses.create(model=DEPLOYMENT, input="Hi", max_output_tokens=4)
    second = openai_client.responses.create(model=DEPLOYMENT, input="Again", max_output_tokens=4,
                                            previous_response_id=first.id)
    deleted = openai_client.responses.delete(first.id)
    assert deleted is None  # the client returns nothing; the body said deleted
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.delete(first.id)
    # A response that continued it is whole on its own: it still reads and continues.
    assert len(list(openai_client.responses.input_items.list(second.id))) == 3
    third = openai_client.responses.create(model=DEPLOYMENT, input="Once more", max_output_tokens=4,
                                           previous_response_id=second.id)
    assert third.previous_response_id == second.id


def test_a_function_call_is_answered_in_the_next_turn_by_its_id(openai_client):
    weather = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    first = openai_client.responses.create(model=DEPLOYMENT, input="What is the weather in Paris?", tools=[weather],
                                           tool_choice="required", parallel_tool_calls=False, temperature=0,
                                           max_output_tokens=60)
    [call] = [item for item in first.output if item.type == "function_call"]
    second = openai_client.responses.create(
        model=DEPLOYMENT, previous_response_id=first.id, tools=[weather], temperature=0, max_output_tokens=20,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}])
    assert second.output_text
    # Sending the call again beside previous_response_id would make it twice: refused, naming the item.
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.responses.create(
            model=DEPLOYMENT, previous_response_id=first.id, tools=[weather],
            input=[call.model_dump(), {"type": "function_call_output", "call_id": call.call_id, "output": "x"}])
    assert refused.value.body["param"] == "input[0]" and refused.value.body["code"] == "duplicate_item"


def test_another_organizations_key_never_reaches_a_stored_response(openai_client, make_tenant):
    mine = openai_client.responses.create(model=DEPLOYMENT, input="A secret.", max_output_tokens=4)
    other = make_tenant()
    theirs = openai.OpenAI(base_url=f"{other.base_url}/v1", api_key=other.api_key, max_retries=0, timeout=120)
    for attempt in (lambda: theirs.responses.retrieve(mine.id), lambda: theirs.responses.delete(mine.id),
                    lambda: list(theirs.responses.input_items.list(mine.id))):
        with pytest.raises(openai.NotFoundError):
            attempt()
    with pytest.raises(openai.BadRequestError) as refused:  # as for an id that names nothing
        theirs.responses.create(model=DEPLOYMENT, input="Hi", previous_response_id=mine.id)
    assert refused.value.body["code"] == "previous_response_not_found"
    assert openai_client.responses.retrieve(mine.id).output_text == mine.output_text  # not deleted by them


@pytest.mark.parametrize("query, param", [("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"),
                                          ("after=msg_nope", "after")])
def test_a_bad_page_is_a_400_naming_the_parameter(openai_client, query, param):
    stored = openai_client.responses.create(model=DEPLOYMENT, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.get(f"/responses/{stored.id}/input_items?{query}", cast_to=object)
    assert refused.value.body["param"] == param


STORY = "Tell me a long story."


def _retrieved(client, response_id: str):
    try:
        return client.responses.retrieve(response_id)
    except openai.NotFoundError:
        return None


def _usage_record(db_read, request_id: str):
    from billing.models import UsageRecord

    return db_read(lambda: UsageRecord.objects.filter(request_id=request_id).first())


def test_a_stream_its_client_leaves_is_stored_cancelled_with_what_was_produced_and_billed(openai_client, tenant,
                                                                                        db_read):
    body = {"model": DEPLOYMENT, "input": STORY, "max_output_tokens": 1500, "stream": True}
    received = []
    with httpx.stream("POST", f"{tenant.base_url}/v1/responses", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {tenant.api_key}"}) as response:
        for line in response.iter_lines():
            event = json.loads(line[6:]) if line.startswith("data: ") else {}
            if event.get("type") == "response.created":
                response_id = event["response"]["id"]
            elif event.get("type") == "response.output_text.delta":
                received.append(event["delta"])
                if len(received) == 3:
                    break  # leaving the block closes the connection mid-stream
    stored = wait_until(lambda: _retrieved(openai_client, response_id), timeout=60,
                        message="the response its client left")
    assert stored.status == "cancelled" and stored.error is None and stored.incomplete_details is None
    assert stored.output_text.startswith("".join(received)) and stored.output[0].status == "incomplete"
    # Its usage is what the worker billed: the tokens it made until the cancel reached it.
    row = wait_until(lambda: _usage_record(db_read, response_id), timeout=60, message="the usage record")
    assert row.status == "cancelled"
    assert (stored.usage.input_tokens, stored.usage.output_tokens) == (row.prompt_tokens, row.completion_tokens)
    assert 3 <= stored.usage.output_tokens < 1500

    # It continues with what it wrote, as a response max_output_tokens cut short does.
    after = openai_client.responses.create(model=DEPLOYMENT, previous_response_id=response_id, input="Go on.",
                                           max_output_tokens=4)
    items = list(openai_client.responses.input_items.list(after.id, order="asc"))
    assert _texts(items) == [("user", STORY), ("assistant", stored.output_text), ("user", "Go on.")]


def test_a_client_that_does_not_stream_and_leaves_has_its_response_stored_cancelled(tenant, db_read):
    from gateway.models import StoredResponse

    impatient = openai.OpenAI(base_url=f"{tenant.base_url}/v1", api_key=tenant.api_key, max_retries=0, timeout=3)
    # A reply that cannot end before it is thousands of characters long: still being written when
    # the client gives up, however short a story the model would tell.
    long_story = {"format": {"type": "json_schema", "name": "story", "strict": True, "schema": {
        "type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"],
        "additionalProperties": False}}}
    with pytest.raises(openai.APITimeoutError):
        impatient.responses.create(model=DEPLOYMENT, input=STORY, max_output_tokens=1500, text=long_story)
    # It never got the response's id (that comes with the answer): its organization's only one.
    row = wait_until(lambda: db_read(lambda: StoredResponse.objects.filter(
        organization_id=tenant.organization_id).first()), timeout=60, message="the response its client left")
    stored = json.loads(row.response)
    assert stored["status"] == "cancelled" and stored["error"] is None
    billed = wait_until(lambda: _usage_record(db_read, row.pk), timeout=60, message="the usage record")
    assert (stored["usage"]["input_tokens"], stored["usage"]["output_tokens"]) == (billed.prompt_tokens,
                                                                                  billed.completion_tokens)
    assert stored["usage"]["output_tokens"] < 1500
