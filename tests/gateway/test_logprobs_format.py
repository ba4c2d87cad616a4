"""Logprobs in OpenAI's two shapes. The legacy completions endpoint always lists the sampled token
among a position's top_logprobs ("up to logprobs+1 elements"); chat lists the top alternatives
alone."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import pytest

from gateway import answers, formatting
from gateway.calls import Call
from gateway.timing import Stages
from tests.gateway.test_timeouts import reply_channel_with

COMMA, IN, DOT = [",", -0.075, [44]], [" in", -4.135, [32, 105, 110]], [".", -3.2, [46]]


def entry(sampled: list, top: list[list]) -> dict:
    token, logprob, raw = sampled
    return {"token": token, "bytes": raw, "logprob": logprob, "top": top}


# The worker sends as many alternatives as asked for; " in" is sampled though unlikely.
ENTRIES_BY_COUNT = {
    0: [entry(IN, []), entry(COMMA, [])],
    1: [entry(IN, [COMMA]), entry(COMMA, [COMMA])],
    2: [entry(IN, [COMMA, DOT]), entry(COMMA, [COMMA, IN])],
}


@pytest.mark.parametrize("count, expected", [
    (0, [{" in": -4.135}, {",": -0.075}]),
    (1, [{",": -0.075, " in": -4.135}, {",": -0.075}]),
    (2, [{",": -0.075, ".": -3.2, " in": -4.135}, {",": -0.075, " in": -4.135}]),
])
def test_completion_top_logprobs_hold_the_sampled_token_beside_the_top_ones(count, expected):
    shaped = formatting.completion_logprobs(ENTRIES_BY_COUNT[count], text_offset=0)
    assert shaped["top_logprobs"] == expected
    assert all(len(top) <= count + 1 for top in shaped["top_logprobs"])
    assert shaped["tokens"] == [" in", ","] and shaped["token_logprobs"] == [-4.135, -0.075]
    assert shaped["text_offset"] == [0, 3]


def test_chat_top_logprobs_list_the_alternatives_alone():
    shaped = formatting.chat_logprobs(ENTRIES_BY_COUNT[1])
    first = shaped["content"][0]
    assert (first["token"], first["logprob"]) == (" in", -4.135)
    assert first["top_logprobs"] == [{"token": ",", "logprob": -0.075, "bytes": [44]}]
    assert formatting.chat_logprobs(ENTRIES_BY_COUNT[0])["content"][0]["top_logprobs"] == []


def new_call(reply_channel: str, sampling: dict) -> Call:
    caller = SimpleNamespace(key_id=f"test-{uuid.uuid4().hex}", org_id=f"test-{uuid.uuid4().hex}")
    return Call(caller=caller, request=SimpleNamespace(sampling=sampling, n=1, prompts=None), spec={"name": "smol"},
                request_id=f"cmpl-{uuid.uuid4().hex}", reply_channel=reply_channel, headers={},
                stages=Stages(), queue_timeout=5)


def test_a_completion_response_lists_the_sampled_token_through_the_gateway():
    events = [
        {"type": "inference.started", "prompt_tokens": 3},
        {"type": "inference.delta", "text": " in,", "token_ids": [1, 2], "logprobs": ENTRIES_BY_COUNT[0]},
        {"type": "inference.finished", "finish_reason": "length", "error": None, "timings": {},
         "usage": {"prompt_tokens": 3, "cached_prompt_tokens": 0, "completion_tokens": 2}},
    ]

    async def scenario():
        call = new_call(await reply_channel_with(*events), {"logprobs": True, "top_logprobs": 0})
        await call.start()
        ctx = formatting.Context(kind="completion", id=call.request_id, created=0, model="smol")
        return await answers.collect(call, ctx)

    body = asyncio.run(scenario())
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" in", ","]
    assert logprobs["top_logprobs"] == [{" in": -4.135}, {",": -0.075}]
