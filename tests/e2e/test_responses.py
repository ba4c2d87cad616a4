"""OpenAI's Responses API through the real stack, with the official client: text, streaming,
function calls and their results, structured output, and the errors that name its parameters."""

from __future__ import annotations

import json
import time

import openai
import pytest
from pydantic import BaseModel

from .conftest import DEPLOYMENT

pytestmark = pytest.mark.slow
QUESTION = "Name three colours of the rainbow."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_response_says_what_chat_says_for_the_same_conversation(openai_client):
    response = openai_client.responses.create(model=DEPLOYMENT, instructions="Be brief.", input=QUESTION,
                                              max_output_tokens=20, temperature=0)
    chat = openai_client.chat.completions.create(
        model=DEPLOYMENT, temperature=0, max_tokens=20,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    assert response.id.startswith("resp_") and response.object == "response" and response.model == DEPLOYMENT
    assert response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.instructions == "Be brief." and response.store is True


def test_a_stream_of_events_adds_up_to_the_response(openai_client):
    whole = openai_client.responses.create(model=DEPLOYMENT, input=QUESTION, max_output_tokens=12, temperature=0)
    events = list(openai_client.responses.create(model=DEPLOYMENT, input=QUESTION, max_output_tokens=12,
                                                 temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == \
        "max_output_tokens"
    # The client's own helper rebuilds a response that ends from the events.
    ended = openai_client.responses.create(model=DEPLOYMENT, input=QUESTION, max_output_tokens=400, temperature=0)
    assert ended.status == "completed"
    assert ended.created_at <= ended.completed_at <= time.time() + 1
    assert events[-1].response.completed_at is None  # incomplete: it never completed
    with openai_client.responses.stream(model=DEPLOYMENT, input=QUESTION, max_output_tokens=400,
                                        temperature=0) as stream:
        assert stream.get_final_response().output_text == ended.output_text


def test_a_function_call_and_its_result_make_a_conversation(openai_client):
    first = openai_client.responses.create(model=DEPLOYMENT, input="What is the weather in Paris?", tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False, temperature=0,
                                           max_output_tokens=60)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    streamed = list(openai_client.responses.create(
        model=DEPLOYMENT, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_output_tokens=60, stream=True))
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert arguments == calls[0].arguments
    assert [e.item.type for e in streamed if e.type == "response.output_item.done"] == ["function_call"]

    second = openai_client.responses.create(
        model=DEPLOYMENT, tools=[WEATHER], temperature=0, max_output_tokens=30,
        input=[{"role": "user", "content": "What is the weather in Paris?"}, calls[0].model_dump(),
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"}])
    assert second.output_text  # an answer in text, after the result


def test_output_logprobs_are_chats_for_the_same_conversation(openai_client):
    response = openai_client.responses.create(model=DEPLOYMENT, input=QUESTION, max_output_tokens=8, temperature=0,
                                              include=["message.output_text.logprobs"], top_logprobs=2)
    chat = openai_client.chat.completions.create(model=DEPLOYMENT, messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    [part] = response.output[0].content
    expected = chat.choices[0].logprobs.content
    assert [lp.token for lp in part.logprobs] == [lp.token for lp in expected] and len(expected) == 8
    assert [lp.logprob for lp in part.logprobs] == pytest.approx([lp.logprob for lp in expected], abs=1e-3)
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    streamed = list(openai_client.responses.create(model=DEPLOYMENT, input=QUESTION, max_output_tokens=8,
                                                   temperature=0, top_logprobs=2, stream=True))
    deltas = [lp.token for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert deltas == [lp.token for lp in expected]


def test_structured_output_parses_into_the_clients_model(openai_client):
    class Cat(BaseModel):
        name: str
        age: int

    parsed = openai_client.responses.parse(model=DEPLOYMENT, input="Describe a cat as JSON with its name and age.",
                                           text_format=Cat, temperature=0, max_output_tokens=80)
    assert isinstance(parsed.output_parsed, Cat)


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "previous_response_id": 123}, "previous_response_id"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call_output", "call_id": "call_9",
                                                    "output": "x"}]}, "input[1].call_id"),
    ({"input": "Hi", "temprature": 0}, "temprature"),
])
def test_errors_name_the_responses_parameter(openai_client, body, param):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.responses.create(model=DEPLOYMENT, **body) if "temprature" not in body else \
            openai_client.post("/responses", body={"model": DEPLOYMENT, **body}, cast_to=object)
    assert refused.value.body["param"] == param, refused.value.body


@pytest.mark.parametrize("body, param, said", [
    ({"input": [{"role": "user", "content": [{"type": [], "text": "x"}]}]}, "input[0].content[0]", None),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role", None),
    ({"input": "Hi", "max_output_tokens": 10_000_000}, "max_output_tokens", "max_output_tokens"),
    # Instructions come first among chat's messages: the item is still named by its own index.
    ({"instructions": "Be brief.", "input": [{"role": "user", "content": "Hi"},
                                             {"type": "function_call_output", "call_id": "zz", "output": "x"}]},
     "input[1].call_id", "input[1]"),
    ({"input": "word " * 9000, "max_output_tokens": 4}, "input", None),
])
def test_errors_found_later_still_name_what_the_client_sent(openai_client, body, param, said):
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.post("/responses", body={"model": DEPLOYMENT, **body}, cast_to=object)
    error = refused.value.body
    assert error["param"] == param, error
    assert said is None or said in error["message"], error
    assert "messages" not in error["message"] and "max_completion_tokens" not in error["message"], error
    assert "tool" not in error["message"] and "tool" not in error["param"], error  # chat's words: items here
