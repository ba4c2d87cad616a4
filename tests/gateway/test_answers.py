"""A request's ``n`` answers through the gateway: the worker's events name each answer by index,
and the client gets OpenAI's choices, whole or streamed, each with its own finish reason."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import pytest

from gateway import answers, formatting
from gateway.calls import Call
from gateway.timing import Stages
from tests.gateway.test_timeouts import reply_channel_with

USAGE = {"prompt_tokens": 5, "cached_prompt_tokens": 0, "completion_tokens": 5}
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def delta(index: int, text: str, tokens: int = 1) -> dict:
    return {"type": "inference.delta", "index": index, "text": text, "token_ids": list(range(tokens)),
            "logprobs": None}


def finished(*reasons: str) -> dict:
    return {"type": "inference.finished", "finish_reason": reasons[0], "error": None, "timings": {},
            "usage": USAGE, "choices": [{"index": i, "finish_reason": r} for i, r in enumerate(reasons)]}


# Two answers, their tokens interleaved as the engine's steps made them.
EVENTS = [{"type": "inference.started", "prompt_tokens": 5},
          delta(1, "Blue"), delta(0, "Red"), delta(1, " sky", 2), delta(0, " rose", 2), finished("stop", "length")]


def run(kind: str, events: list[dict], *, stream: bool, n: int = 2, sampling: dict | None = None,
        extra: dict | None = None):
    async def scenario():
        caller = SimpleNamespace(key_id=f"test-{uuid.uuid4().hex}", org_id=f"test-{uuid.uuid4().hex}")
        request = SimpleNamespace(sampling=sampling or {}, n=n, prompts=None, extra=extra or {})
        call = Call(caller=caller, request=request, spec={"name": "smol"},
                    request_id=f"cmpl-{uuid.uuid4().hex}", reply_channel=await reply_channel_with(*events),
                    headers={}, stages=Stages(), queue_timeout=5)
        await call.start()
        ctx = formatting.Context(kind=kind, id=call.request_id, created=0, model="smol")
        if stream:
            return [chunk async for chunk in answers.stream_chunks(call, ctx, include_usage=True)]
        return await answers.collect(call, ctx)

    return asyncio.run(scenario())


def test_a_whole_response_lists_each_answer_in_order_with_its_own_end():
    body = run("chat", EVENTS, stream=False)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["Red rose", "Blue sky"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_stream_carries_each_answer_under_its_index(kind):
    chunks = run(kind, EVENTS, stream=True)
    texts, ends, roles = {0: "", 1: ""}, {}, []
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        piece = choice["delta"].get("content") if kind == "chat" else choice["text"]
        texts[choice["index"]] += piece or ""
        if kind == "chat" and choice["delta"].get("role"):
            roles.append(choice["index"])
        if choice["finish_reason"]:
            assert choice["index"] not in ends, "one end per answer"
            ends[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "Red rose", 1: "Blue sky"}
    assert ends == {0: "stop", 1: "length"}
    assert roles == ([0, 1] if kind == "chat" else [])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_an_answer_that_ends_first_says_so_at_once_without_an_empty_chunk(kind):
    """As OpenAI streams ``n`` answers: each one's end when it ends, not when the last ends; the
    stop token that ended it shows nothing. An aborted one's end waits for the request's."""
    events = [EVENTS[0], delta(0, "Red"), {**delta(0, ""), "finish_reason": "stop"}, delta(1, "Blue"),
              {**delta(1, " sky"), "finish_reason": "length"}, finished("stop", "length")]
    chunks = run(kind, events, stream=True)[:-1]
    shown = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"],
              c["choices"][0]["delta"].get("content") if kind == "chat" else c["choices"][0]["text"])
             for c in chunks]
    end = None if kind == "chat" else ""
    assert shown == [(0, None, ""), (1, None, "")] + [(0, None, "Red"), (0, "stop", end), (1, None, "Blue"), (1, None, " sky"),
                             (1, "length", end)]


def test_each_answer_reads_its_own_tool_calls():
    sampling = {"tools": [{"name": "f", "parameters": {"type": "object"}}], "tool_choice": "auto"}
    events = [EVENTS[0], delta(0, CALL[:20]), delta(1, "I cannot."), delta(0, CALL[20:]), finished("stop", "stop")]
    body = run("chat", events, stream=False, sampling=sampling)
    first, second = body["choices"]
    assert first["message"]["content"] is None and first["finish_reason"] == "tool_calls"
    assert [c["function"] for c in first["message"]["tool_calls"]] == [{"name": "f", "arguments": '{"a": 1}'}]
    assert second["message"]["content"] == "I cannot." and second["finish_reason"] == "stop"
    assert "tool_calls" not in second["message"]

    chunks = run("chat", events, stream=True, sampling=sampling)
    calls = [c for chunk in chunks for c in chunk["choices"] if c["delta"].get("tool_calls")]
    assert {c["index"] for c in calls} == {0}
    ends = {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}
    assert ends == {0: "tool_calls", 1: "stop"}


def test_an_event_from_a_worker_without_answers_is_the_first_answer():
    events = [EVENTS[0], {"type": "inference.delta", "text": "Hi", "token_ids": [1], "logprobs": None},
              {"type": "inference.finished", "finish_reason": "stop", "error": None, "timings": {}, "usage": USAGE}]
    body = run("completion", events, stream=False, n=1)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [(0, "Hi", "stop")]


def test_a_response_keeps_the_order_the_model_wrote_calls_and_text_in():
    """Text after a call's end in the same delta: the call item closes, then a message opens."""
    from gateway.response_events import ResponseBuilder

    sampling = {"tools": [{"name": "f", "parameters": {"type": "object"}}], "tool_choice": "auto"}
    builder = ResponseBuilder(response_id="resp_1", created=0, model="smol", sampling=sampling, settings={})
    events = builder.start() + builder.feed(delta(0, CALL[:30])) + builder.feed(delta(0, CALL[30:] + "\nDone."))
    events += builder.finish(finished("stop"))
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["function_call", "message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    call, message = builder.response["output"]
    assert (call["name"], call["arguments"], call["status"]) == ("f", '{"a": 1}', "completed")
    assert message["content"][0]["text"].strip() == "Done."


def test_a_reply_that_can_only_call_has_null_content_even_cut_short():
    """max_tokens cut the call before its name was whole: no call, and content null as streamed."""
    sampling = {"tools": [{"name": "f", "parameters": {"type": "object"}}], "tool_choice": "required"}
    events = [EVENTS[0], delta(0, CALL[:12]), finished("length")]
    [choice] = run("chat", events, stream=False, n=1, sampling=sampling)["choices"]
    assert choice["message"]["content"] is None and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


def scored(index: int, *tokens: str) -> dict:
    """A delta of ``tokens``, each with its logprob, as a worker sends them when asked."""
    entries = [{"token": t, "bytes": list(t.encode()), "logprob": -0.5, "top": []} for t in tokens]
    return {**delta(index, "".join(tokens), len(tokens)), "logprobs": entries}


def test_logprobs_cover_the_content_alone_not_the_tool_calls_tokens():
    """OpenAI's logprobs score the message's content: a call's tags and JSON are not content."""
    sampling = {"tools": [{"name": "f", "parameters": {"type": "object"}}], "tool_choice": "auto", "logprobs": True}
    call_tokens = [CALL[i:i + 7] for i in range(0, len(CALL), 7)]
    events = [EVENTS[0], scored(0, "Let", " me", " check."), scored(0, *call_tokens[:3]),
              scored(0, *call_tokens[3:]), finished("stop")]
    [choice] = run("chat", events, stream=False, n=1, sampling=sampling)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
    content = choice["message"]["content"]
    assert "".join(e["token"] for e in choice["logprobs"]["content"]) == content
    assert content.startswith("Let me check")

    chunks = run("chat", events, stream=True, n=1, sampling=sampling)
    streamed = [c for chunk in chunks for c in chunk["choices"]]
    texts = "".join(c["delta"].get("content") or "" for c in streamed)
    tokens = "".join(e["token"] for c in streamed if c["logprobs"] for e in c["logprobs"]["content"])
    assert tokens == texts and texts.startswith("Let me check")
    assert all(c["logprobs"] is None for c in streamed if c["delta"].get("tool_calls"))

    only = {**sampling, "tool_choice": "required"}
    events = [EVENTS[0], scored(0, *call_tokens), finished("stop")]
    [choice] = run("chat", events, stream=False, n=1, sampling=only)["choices"]
    assert choice["message"]["content"] is None and choice["logprobs"] == {"content": [], "refusal": None}


def test_the_system_fingerprint_is_the_engines_that_answered():
    """It says which backend configuration the answer came from (its dtype, quantization, device and
    numerics): a client comparing seeded answers learns the backend changed."""
    events = [{**EVENTS[0], "fingerprint": "fp_0123456789ab"}, delta(0, "Hi"), finished("stop")]

    async def scenario():
        caller = SimpleNamespace(key_id=f"test-{uuid.uuid4().hex}", org_id=f"test-{uuid.uuid4().hex}")
        request = SimpleNamespace(sampling={}, n=1, prompts=None, extra={})
        call = Call(caller=caller, request=request, spec={"name": "smol"}, request_id=f"cmpl-{uuid.uuid4().hex}",
                    reply_channel=await reply_channel_with(*events), headers={}, stages=Stages(), queue_timeout=5)
        await call.start()
        ctx = formatting.Context(kind="chat", id=call.request_id, created=0, model="smol", fingerprint=call.fingerprint)
        return await answers.collect(call, ctx)

    assert asyncio.run(scenario())["system_fingerprint"] == "fp_0123456789ab"
    old_worker = formatting.Context(kind="chat", id="x", created=0, model="smol")  # its start named none
    assert old_worker.envelope(chunk=False)["system_fingerprint"] == formatting.SYSTEM_FINGERPRINT


def test_the_fingerprint_changes_with_what_changes_the_numbers():
    import torch

    from workers.engine.engine import fingerprint

    base = dict(model="smol.gguf", dtype=torch.float32, quantization=None, device="cpu")
    assert fingerprint(**base) == fingerprint(**base)
    others = [fingerprint(**{**base, name: value}) for name, value in
              (("dtype", torch.bfloat16), ("quantization", "fp8"), ("device", "cuda"), ("model", "other.gguf"))]
    assert len({fingerprint(**base), *others}) == 5


def test_a_responses_text_keeps_the_logprobs_of_what_the_tool_reader_held_back():
    """The reader holds back what might start a call (a newline, a "<") until it knows: the
    logprobs of that text come out with it, and spell the text."""
    from gateway.response_events import ResponseBuilder

    sampling = {"tools": [{"name": "f", "parameters": {"type": "object"}}], "tool_choice": "auto", "logprobs": True}
    builder = ResponseBuilder(response_id="resp_1", created=0, model="smol", sampling=sampling, settings={})
    events = builder.start()
    for tokens in (["Hello", "\n"], ["World", " <"], ["b>", " end"]):
        events += builder.feed(scored(0, *tokens))
    events += builder.finish(finished("stop"))
    [part] = builder.response["output"][0]["content"]
    assert part["text"] == "Hello\nWorld <b> end"
    assert "".join(e["token"] for e in part["logprobs"]) == part["text"]
