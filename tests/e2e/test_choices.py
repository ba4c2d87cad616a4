"""OpenAI's ``n`` through the real stack: several answers to one prompt, each sampled on its own,
streamed under their indexes, billed as one request (the prompt once, every answer's tokens)."""

from __future__ import annotations

import json

import pytest

from tests.support import wait_until

from .conftest import DEPLOYMENT
from .stats import engine_stats, wait_idle
from .test_metering import record
from .test_websocket import frames_until_done, open_ws

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Give me a name for a cat."}]
SAMPLED = {"temperature": 1.0, "seed": 11, "max_tokens": 12}


def test_each_answer_is_the_one_its_seed_gives_and_the_request_is_billed_once(openai_client, db_read):
    reply = openai_client.chat.completions.create(model=DEPLOYMENT, messages=QUESTION, n=3, **SAMPLED)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1, texts  # sampled on their own, not one answer three times
    # Answer i samples with seed + i: each is the answer a single request with that seed gets.
    alone = [openai_client.chat.completions.create(model=DEPLOYMENT, messages=QUESTION,
                                                   **{**SAMPLED, "seed": SAMPLED["seed"] + i}) for i in range(3)]
    assert texts == [a.choices[0].message.content for a in alone]
    assert [c.finish_reason for c in reply.choices] == [a.choices[0].finish_reason for a in alone]
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt counts once
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    row = wait_until(lambda: record(db_read, reply.id), timeout=60, message="the usage record")
    assert (row.status, row.prompt_tokens, row.completion_tokens) == \
        ("completed", reply.usage.prompt_tokens, reply.usage.completion_tokens)


def test_a_stream_of_answers_matches_the_whole_reply(openai_client):
    whole = openai_client.chat.completions.create(model=DEPLOYMENT, messages=QUESTION, n=2, logprobs=True, **SAMPLED)
    chunks = list(openai_client.chat.completions.create(model=DEPLOYMENT, messages=QUESTION, n=2, logprobs=True,
                                                        stream=True, stream_options={"include_usage": True}, **SAMPLED))
    texts, ends, tokens = ["", ""], [[], []], [0, 0]
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            tokens[choice.index] += len(choice.logprobs.content) if choice.logprobs else 0
            if choice.finish_reason:
                ends[choice.index].append(choice.finish_reason)
    assert texts == [c.message.content for c in whole.choices]
    assert ends == [[c.finish_reason] for c in whole.choices]
    assert tokens == [len(c.logprobs.content) for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_take_n_and_best_of_equal_to_it(openai_client):
    reply = openai_client.completions.create(model=DEPLOYMENT, prompt="My favourite fruit is", n=2, best_of=2,
                                             **SAMPLED)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.text for c in reply.choices)


def test_cancelling_a_request_stops_every_answer_and_frees_their_blocks(tenant, inference_worker):
    aborted_before = engine_stats(inference_worker, DEPLOYMENT)["requests_aborted"]
    with open_ws(tenant) as ws:
        ws.send(json.dumps({"request_id": "n", "model": DEPLOYMENT, "n": 3, "max_tokens": 2000,
                            "messages": [{"role": "user", "content": "Write a long story about the sea."}],
                            "stream_options": {"include_usage": True}}))
        seen = set()
        while len(seen) < 3:  # every answer is generating
            frame = json.loads(ws.recv(timeout=120))
            assert frame.get("type") not in ("error", "done"), frame
            seen |= {c["index"] for c in frame.get("choices", []) if c["delta"].get("content")}
        ws.send(json.dumps({"type": "cancel", "request_id": "n"}))
        frames = frames_until_done(ws, "n")
    usage = [f for f in frames if f.get("usage")][-1]["usage"]
    assert 3 <= usage["completion_tokens"] < 3 * 2000
    stats = wait_idle(inference_worker, DEPLOYMENT)
    assert stats["requests_aborted"] >= aborted_before + 3


def test_a_batch_of_prompts_is_answered_prompt_by_prompt(openai_client, reference_engine):
    """lm-evaluation-harness and batch clients send several prompts at once: the choices come
    n per prompt, in order, each the answer a lone request gets."""
    prompts = ["The capital of France is", reference_engine.tokenizer.encode("One, two, three,")]
    reply = openai_client.completions.create(model=DEPLOYMENT, prompt=prompts, n=2, max_tokens=6, temperature=0.8,
                                             seed=3, echo=True)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    alone = [openai_client.completions.create(model=DEPLOYMENT, prompt=prompt, max_tokens=6, temperature=0.8,
                                              seed=3 + j) for prompt in prompts for j in range(2)]
    echoed = [prompts[0], reference_engine.tokenizer.decode(prompts[1])]
    assert [c.text for c in reply.choices] == [echoed[i // 2] + a.choices[0].text for i, a in enumerate(alone)]
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[2].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    too_long = openai_client.with_options(max_retries=0).completions.with_raw_response
    import openai
    with pytest.raises(openai.BadRequestError) as refused:
        too_long.create(model=DEPLOYMENT, prompt=["Hi", "word " * 9000], max_tokens=4)
    assert "prompt[1]" in refused.value.message and refused.value.body["param"] == "prompt"
