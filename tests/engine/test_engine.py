"""The engine end to end on the real bundled model (float32, so that outputs can be compared
exactly): batching, prefix caching, preemption, abort, stop strings, seeds, streaming text, the
batch window, bad input and failing steps."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from workers.engine import Engine, InvalidRequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

_WORDS = ("river stone garden little north window bright copper silent morning engine paper "
          "orange valley winter whisper market candle forest silver thunder harbor").split()


def make_prompts(n=32):
    """Distinct prompts of lengths spread from a few tokens to a couple of hundred."""
    prompts = []
    for i in range(n):
        length = 3 + (i * 37) % 90
        words = [_WORDS[(i * 7 + j * (i % 5 + 1)) % len(_WORDS)] for j in range(length)]
        prompts.append(f"Story {i}: " + " ".join(words))
    return prompts


PROMPTS = make_prompts()


def wait_until(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def make_engine(model, **kwargs):
    settings = dict(max_batch_size=32, max_batched_tokens=256, num_kv_blocks=512,
                    enable_prefix_caching=False)
    settings.update(kwargs)
    return Engine(model, **settings)


@pytest.fixture(scope="module")
def model(bundled_model_fp32):
    return bundled_model_fp32


@pytest.fixture(scope="module")
def engine(model):
    with make_engine(model, enable_prefix_caching=True) as eng:
        yield eng


@pytest.fixture(scope="module")
def batched_outputs(model):
    """Greedy outputs of all prompts, submitted in three waves that join a running batch."""
    with make_engine(model) as eng:
        handles = []
        for wave in (PROMPTS[:10], PROMPTS[10:21], PROMPTS[21:]):
            new = [eng.submit(p, GREEDY) for p in wave]
            handles += new
            next(iter(new[0]))  # the wave is decoding; the next one joins mid-flight
        results = [h.result(timeout=300) for h in handles]
        first_steps = {r.timings.first_scheduled_step for r in results}
        assert len(first_steps) >= 3, "the waves were meant to join at different steps"
        assert eng.stats()["batch_size_max"] > 10
    return [r.token_ids for r in results]


# ---------------------------------------------------------------------------- batching


def test_greedy_output_is_the_same_alone_and_in_a_batch(model, batched_outputs):
    with make_engine(model) as eng:
        for index in (0, 5, 12, 20, 27, 31):  # short and long prompts, from every wave
            alone = eng.generate(PROMPTS[index], GREEDY, timeout=120)
            assert alone.token_ids == batched_outputs[index], f"prompt {index}"


def test_a_warmed_up_engine_has_settled_its_small_steps_threads_and_answers_as_a_cold_one(model):
    """The warm-up writes into the cache before any request: what it leaves must change nothing.
    (On CPU it also settles how many threads single-token steps use, which the first requests
    would otherwise measure, at their own cost.)"""
    prompts = PROMPTS[:4]
    with make_engine(model, enable_prefix_caching=True) as cold:
        expected = [r.token_ids for r in cold.generate(prompts, GREEDY)]
    with make_engine(model, enable_prefix_caching=True, warm_up=True) as warm:
        threads = warm.runner.threads
        assert threads is None or threads.choice is not None  # before any request
        assert [r.token_ids for r in warm.generate(prompts, GREEDY)] == expected
        assert warm.stats()["requests_finished"] == len(prompts)  # the warm-up's steps are nobody's


def test_prefix_caching_reuses_blocks_and_changes_nothing(model):
    system = "You are a careful assistant. " + " ".join(_WORDS * 3)
    prompts = [f"{system} Question {i}: tell me about the {w}." for i, w in
               enumerate(["river", "forest", "market"])]
    outputs = {}
    for caching in (False, True):
        with make_engine(model, enable_prefix_caching=caching) as eng:
            # One after another, so that each later prompt can find the earlier ones' blocks.
            results = [eng.generate(p, GREEDY, timeout=120) for p in prompts]
            outputs[caching] = [r.token_ids for r in results]
            cached = [r.cached_prompt_tokens for r in results]
            stats = eng.stats()
        if caching:
            assert cached[0] == 0
            assert all(c >= 16 * 4 for c in cached[1:]), cached
            assert stats["prefix_cache_hit_tokens"] == sum(cached)
            assert stats["prefix_cache_hit_rate"] > 0
        else:
            assert cached == [0, 0, 0]
            assert stats["prefix_cache_hit_tokens"] == 0
    assert outputs[True] == outputs[False]


def test_identical_prompts_in_one_batch_share_the_prompt(model):
    prompt = PROMPTS[31]
    with make_engine(model, enable_prefix_caching=True) as eng:
        results = eng.generate([prompt] * 4, GREEDY, timeout=120)
    assert all(r.token_ids == results[0].token_ids for r in results)
    assert sum(r.cached_prompt_tokens > 0 for r in results) == 3


def test_tiny_block_pool_preempts_and_gives_the_same_outputs(model, batched_outputs):
    # 24 blocks (384 tokens) for 32 requests needing ~1,800: constant preemption.
    with make_engine(model, num_kv_blocks=24) as eng:
        results = eng.generate(PROMPTS, GREEDY, timeout=600)
        stats = eng.stats()
    assert stats["preemptions"] > 0
    assert stats["kv_blocks_used"] == 0
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    assert [r.token_ids for r in results] == batched_outputs


# ------------------------------------------------------------------------ request control


def test_abort_ends_the_request_and_frees_every_block(engine):
    handle = engine.submit(PROMPTS[30], SamplingParams(max_tokens=500, ignore_eos=True))
    stream = iter(handle)
    first = next(stream)
    assert not first.finished
    assert handle.abort()
    last = list(stream)[-1]
    assert last.finished and last.finish_reason == "abort"
    assert last.completion_tokens < 500
    wait_until(lambda: engine.stats()["kv_blocks_used"] == 0 and engine.stats()["running"] == 0,
               what="blocks to be freed")
    assert not engine.abort(handle.request_id)  # already gone
    # A waiting request can be aborted too, and the engine keeps serving.
    assert engine.generate("Hello", GREEDY, timeout=60).finish_reason == "length"


def test_a_long_prompt_shows_progress_chunk_by_chunk_before_its_first_output(model):
    """The gateway's stall timer must not fire while a long prompt is computed (no output for
    a while on a slow machine): its computed tokens grow with each chunk, readable from another
    thread; an abort between chunks ends it before any token, so nothing was produced."""
    with make_engine(model, max_batched_tokens=32) as eng:
        seen = []  # the long prompt's computed tokens after each step (a decoding request's outputs)
        watched = {}

        def after_each_step(out):
            long = watched.get("long")
            if long is None or long.finished:
                return
            seen.append(long.computed_tokens)
            if watched.get("abort_after_a_chunk") and long.computed_tokens > 0:
                long.abort()

        ticker = eng.submit("Count:", SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True),
                            listener=after_each_step)
        wait_until(lambda: eng.stats()["running"] == 1, what="the decoding request")
        long = watched["long"] = eng.submit(" ".join(PROMPTS[:8]), SamplingParams(max_tokens=4, temperature=0))
        first = next(iter(long))
        chunks = [tokens for tokens in seen if 0 < tokens < long.prompt_tokens]
        assert first.completion_tokens == 1 and long.prompt_tokens > 8 * 32
        assert len(set(chunks)) >= 4 and chunks == sorted(chunks), seen  # chunk by chunk, growing

        watched["abort_after_a_chunk"] = True
        cut = watched["long"] = eng.submit(" ".join(PROMPTS[8:16]), SamplingParams(max_tokens=4, temperature=0))
        last = cut.result(timeout=60)
        assert last.finish_reason == "abort" and last.completion_tokens == 0 and cut.computed_tokens == 0
        ticker.abort()


def test_stop_string_across_tokens_stops_and_is_left_out(engine, model):
    tokenizer = model.tokenizer
    prompt = PROMPTS[4]
    free = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0,
                                                  ignore_eos=True), timeout=60)
    # A stop string made of the end of one token's text and the start of the next one's.
    pieces = [tokenizer.decode(free.token_ids[:i]) for i in range(len(free.token_ids) + 1)]
    boundary = next(i for i in range(3, len(pieces) - 1)
                    if len(pieces[i]) - len(pieces[i - 1]) >= 2
                    and len(pieces[i + 1]) - len(pieces[i]) >= 2
                    and pieces[i].count(pieces[i][-2:]) == 1)
    stop = pieces[boundary][-2:] + pieces[boundary + 1][len(pieces[boundary]):][:2]
    assert stop in free.text
    stopped = engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0,
                                                     ignore_eos=True, stop=[stop, "zzzz"]),
                              timeout=60)
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    assert stop not in stopped.text
    assert stopped.text == free.text[:free.text.index(stop)]
    # Only tokens with a character in the text are returned; the stop string's are billed.
    assert stopped.token_ids == [t for i, t in enumerate(free.token_ids[:boundary + 1])
                                 if len(pieces[i]) < len(stopped.text)]
    # The stop string shows only once its token is handed out, while the next step already
    # runs: that step's token for this request is dropped, neither delivered nor counted.
    assert stopped.completion_tokens == boundary + 1
    wait_until(lambda: engine.stats()["kv_blocks_used"] == 0, what="blocks to be freed")


@pytest.mark.parametrize("launches_async", [False, True], ids=["cpu-order", "gpu-order"])
def test_a_stop_string_in_a_batch_leaves_the_others_running(model, launches_async):
    # In the GPU order, tokens are handed out while the next step runs (here on the CPU, whose
    # launch only returns when the step is done): the stop string is found when the request is
    # already in the next step, whose token for it must then be dropped.
    with make_engine(model) as engine:
        engine.runner.launches_async = launches_async
        prompt = PROMPTS[4]
        free = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0,
                                                      ignore_eos=True), timeout=60)
        stop = model.tokenizer.decode(free.token_ids[5:7])
        assert stop and stop in free.text
        stopped, others = engine.generate(
            [prompt, PROMPTS[1]],
            [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]),
             SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)], timeout=60)
        assert stopped.finish_reason == "stop" and stop not in stopped.text
        # The stop string's tokens are billed, not returned.
        assert len(stopped.token_ids) < stopped.completion_tokens <= 7
        assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)]
        assert others.finish_reason == "length" and others.completion_tokens == 16
        wait_until(lambda: engine.stats()["kv_blocks_used"] == 0, what="blocks to be freed")


def test_an_abort_after_the_last_token_was_taken_reports_how_the_request_ended(model,
                                                                              monkeypatch):
    # The loop is driven by hand here: a request's last token is taken in at the end of a step
    # and handed out at the next one, and an abort may arrive in between.
    engine = make_engine(model)
    monkeypatch.setattr(engine, "start", lambda: engine)
    short = engine.submit(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0,
                                                     ignore_eos=True))
    engine.submit(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert engine._wait_for_work()
    engine._step()  # both prompts prefilled; the short one's only token ends it
    assert not short.finished
    assert engine.abort(short.request_id)
    assert engine._wait_for_work()  # takes the abort in; the other request still runs
    result = short.result(timeout=5)
    assert result.finish_reason == "length" and result.completion_tokens == 1
    assert len(result.token_ids) == 1 and result.text
    counts = engine._collect_stats()
    assert counts["requests_finished"] == 1 and counts["requests_aborted"] == 0
    engine.stop()


def test_an_engine_gone_idle_reports_the_requests_it_finished_last(model):
    # With nothing left to run, the last step's outputs are handed out while the engine waits for
    # work; its figures (read by the worker's heartbeat) must count those requests too.
    with make_engine(model) as engine:
        handles = [engine.submit(p, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
                   for p in PROMPTS[:2]]
        for handle in handles:
            handle.result(timeout=60)
        wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["requests_finished"] == 2,
                   timeout=10, what="the idle engine's figures to count both requests")
        assert engine.stats()["generated_tokens"] == 6


# 3: the token that fails is also the one that reaches max_tokens.
@pytest.mark.parametrize("max_tokens", [6, 3])
def test_a_token_that_cannot_be_decoded_fails_only_its_request(model, monkeypatch, max_tokens):
    from workers.engine.tokenizer import IncrementalDetokenizer

    class Choking(IncrementalDetokenizer):
        def push(self, token_id: int) -> str:
            if len(self.ids) == 2:
                raise ValueError("cannot decode this one")
            return super().push(token_id)

    with make_engine(model) as engine:
        monkeypatch.setattr(engine, "_detokenizer", lambda: Choking(model.tokenizer))
        bad = engine.submit(PROMPTS[0], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True))
        monkeypatch.undo()
        good = engine.submit(PROMPTS[1], SamplingParams(max_tokens=6, temperature=0,
                                                        ignore_eos=True))
        failed, finished = bad.result(timeout=60), good.result(timeout=60)
    assert failed.finish_reason == "error" and "cannot decode this one" in failed.error
    # What it produced is what it reports (and what billing would charge): three tokens.
    assert failed.completion_tokens == len(failed.token_ids) == 3
    assert finished.finish_reason == "length" and finished.completion_tokens == 6


def test_stop_token_ids_and_eos(engine, model):
    free = engine.generate(PROMPTS[2], GREEDY, timeout=60)
    target = free.token_ids[3]
    stopped = engine.generate(PROMPTS[2], SamplingParams(max_tokens=8, temperature=0,
                                                         ignore_eos=True,
                                                         stop_token_ids=[target]), timeout=60)
    assert stopped.finish_reason == "stop" and stopped.stop_reason == target
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(target) + 1]
    # EOS forced by logit bias ends the request unless ignore_eos.
    eos = next(iter(model.tokenizer.eos_token_ids))
    ended = engine.generate("Hi", SamplingParams(max_tokens=8, logit_bias={eos: 100}),
                            timeout=60)
    assert ended.finish_reason == "stop" and ended.token_ids == [eos] and ended.text == ""
    kept = engine.generate("Hi", SamplingParams(max_tokens=3, logit_bias={eos: 100},
                                                ignore_eos=True), timeout=60)
    assert kept.finish_reason == "length" and kept.token_ids == [eos] * 3


def test_text_held_for_a_possible_stop_string_is_released_when_a_stop_token_ends_it(engine):
    free = engine.generate(PROMPTS[2], GREEDY, timeout=60)
    target = free.token_ids[3]
    by_token = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[target])
    baseline = engine.generate(PROMPTS[2], by_token, timeout=60)
    assert len(baseline.text) >= 2
    # Its last two characters could start this stop string, so they are held back until the
    # next token says otherwise; the stop token that comes instead must let them go.
    held = engine.generate(PROMPTS[2], replace(by_token, stop=[baseline.text[-2:] + "\x00"]), timeout=60)
    assert held.finish_reason == "stop" and held.stop_reason == target
    assert held.text == baseline.text


def test_the_token_that_ends_a_request_has_no_logprob_entry(engine, model):
    eos = next(iter(model.tokenizer.eos_token_ids))
    ended = engine.generate("Hi", SamplingParams(max_tokens=8, logit_bias={eos: 100}, logprobs=True), timeout=60)
    assert ended.token_ids == [eos] and ended.logprobs == []  # OpenAI lists no end-of-text token
    free = engine.generate(PROMPTS[2], replace(GREEDY, logprobs=True), timeout=60)
    assert len(free.logprobs) == len(free.token_ids)  # every token that is text has its entry


def test_seeded_sampling_repeats_whatever_runs_beside_it(engine):
    seeded = SamplingParams(max_tokens=8, temperature=1.5, top_p=0.98, seed=1234,
                            ignore_eos=True)
    alone = engine.generate(PROMPTS[7], seeded, timeout=60)
    again = engine.generate(PROMPTS[7], seeded, timeout=60)
    assert again.token_ids == alone.token_ids
    noisy = SamplingParams(max_tokens=8, temperature=1.3, ignore_eos=True)
    companions = [engine.submit(p, noisy) for p in PROMPTS[8:12]]
    in_batch = engine.submit(PROMPTS[7], seeded)
    companions += [engine.submit(p, noisy) for p in PROMPTS[12:15]]
    assert in_batch.result(timeout=120).token_ids == alone.token_ids
    for c in companions:
        c.result(timeout=120)
    other_seed = engine.generate(PROMPTS[7], replace(seeded, seed=4321), timeout=60)
    assert other_seed.token_ids != alone.token_ids


def test_multibyte_character_split_over_tokens_arrives_whole(engine, model):
    emoji = "😀"
    assert len(model.tokenizer.encode(emoji)) > 1  # byte-level pieces
    handle = engine.submit(emoji * 12, SamplingParams(max_tokens=9, temperature=0))
    outputs = list(handle)
    texts = [o.text for o in outputs]
    assert all("\ufffd" not in t for t in texts)
    assert emoji in "".join(texts)
    # Tokens that end mid-character have no text of their own: they come with the token that
    # completes the character, and the character comes whole.
    assert any(len(o.token_ids) > 1 and o.text for o in outputs)
    assert not any(o.token_ids and o.text == "" for o in outputs if not o.finished)


def test_streamed_pieces_add_up_to_the_result(engine):
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=True, top_logprobs=3,
                            ignore_eos=True)
    outputs = list(engine.submit(PROMPTS[9], params))
    whole = engine.generate(PROMPTS[9], params, timeout=60)
    assert [t for o in outputs for t in o.token_ids] == whole.token_ids
    assert "".join(o.text for o in outputs) == whole.text
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].completion_tokens == 10
    assert len(whole.logprobs) == 10
    for lp, token in zip(whole.logprobs, whole.token_ids):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][0] == token  # greedy picks the most likely token
        assert [v for _, v in lp.top_logprobs] == sorted((v for _, v in lp.top_logprobs),
                                                         reverse=True)
    timings = whole.timings
    assert timings.queue_time >= 0 and timings.time_to_first_token > 0
    assert timings.time_per_output_token > 0 and timings.e2e_latency >= timings.time_to_first_token


def test_a_listener_gets_the_outputs_on_the_engine_thread_and_its_failure_is_its_own(engine):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    heard, threads = [], set()

    def listener(out):
        threads.add(threading.current_thread().name)
        heard.append(out)

    def broken(out):
        raise RuntimeError("a listener bug")

    failed = engine.stats()["requests_failed"]
    engine.submit(PROMPTS[3], params, listener=broken)
    engine.submit(PROMPTS[3], params, listener=listener)
    wait_until(lambda: heard and heard[-1].finished, what="the listener's last output")
    assert [t for o in heard for t in o.token_ids] == engine.generate(PROMPTS[3], params, timeout=60).token_ids
    assert threads == {engine._thread.name}
    assert engine.stats()["requests_failed"] == failed and engine.is_running


def test_chat_messages_use_the_models_template(engine, model):
    messages = [{"role": "user", "content": "Say hello."}]
    result = engine.submit_chat(messages, SamplingParams(max_tokens=6, temperature=0)).result(60)
    expected = model.tokenizer.encode(model.tokenizer.apply_chat_template(messages),
                                      add_special_tokens=True)
    assert result.prompt_tokens == len(expected)
    assert result.completion_tokens >= 1


def test_requests_from_many_threads(engine):
    results = {}

    def worker(i):
        results[i] = engine.generate(PROMPTS[i], GREEDY, timeout=120)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(130)
    assert sorted(results) == list(range(6))
    assert all(r.completion_tokens == 8 for r in results.values())


# --------------------------------------------------------------------------- batch window


def test_requests_within_the_batch_window_share_the_first_prefill(model):
    with make_engine(model, batch_window_ms=1000) as eng:
        handles = [eng.submit(p, GREEDY) for p in PROMPTS[:5]]
        results = [h.result(timeout=120) for h in handles]
    assert len({r.timings.first_scheduled_step for r in results}) == 1
    # Each was decoded alongside the others: what the dashboard charts as the batch size.
    assert all(r.timings.mean_batch_size > 1 for r in results), [r.timings.mean_batch_size for r in results]
    alone = eng_result_alone(model)
    assert alone.timings.mean_batch_size == 1.0


def eng_result_alone(model):
    with make_engine(model) as eng:
        return eng.generate(PROMPTS[0], GREEDY, timeout=120)


def test_a_full_batch_does_not_wait_for_the_window(model):
    # A minute-long window would time the results out if a full batch still waited for it.
    with make_engine(model, batch_window_ms=60_000, max_batch_size=3) as eng:
        handles = [eng.submit(p, GREEDY) for p in PROMPTS[:3]]
        results = [h.result(timeout=30) for h in handles]
    assert len({r.timings.first_scheduled_step for r in results}) == 1


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("prompt, param", [
    ("", "prompt"), ([], "prompt"), ([1, -1], "prompt"), ([10 ** 9], "prompt"),
    (42, "prompt"), ("word " * 200, "prompt"),
])
def test_bad_prompts_are_refused_and_the_engine_keeps_working(model, prompt, param):
    with make_engine(model, max_model_len=128) as eng:
        with pytest.raises(InvalidRequestError) as info:
            eng.submit(prompt, GREEDY)
        assert info.value.param == param
        assert eng.generate("Hello", GREEDY, timeout=60).completion_tokens == 8


def test_bad_parameters_are_refused_at_submit(engine, model):
    vocab = model.config.vocab_size
    for params, param in [
        (SamplingParams(logit_bias={vocab + 5: 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            engine.submit("Hello", params)
        assert info.value.param == param
    with pytest.raises(InvalidRequestError) as info:
        engine.submit_chat([{"content": "no role"}])
    assert info.value.param == "messages"
    handle = engine.submit("Hello", SamplingParams(max_tokens=50, ignore_eos=True),
                           request_id="dup")
    with pytest.raises(InvalidRequestError) as info:
        engine.submit("Hello", GREEDY, request_id="dup")
    assert info.value.param == "request_id"
    handle.abort()
    assert engine.generate("Hello", GREEDY, timeout=60).completion_tokens == 8


def test_a_request_without_max_tokens_fills_the_context_and_one_asking_for_more_is_refused(model):
    with make_engine(model, max_model_len=40) as eng:
        prompt = model.tokenizer.encode(PROMPTS[3])[:30]
        result = eng.generate(prompt, SamplingParams(temperature=0, ignore_eos=True), timeout=60)
        assert result.finish_reason == "length"
        assert result.prompt_tokens + result.completion_tokens == 40
        room = 40 - len(prompt)
        exact = eng.generate(prompt, SamplingParams(max_tokens=room, temperature=0, ignore_eos=True),
                             timeout=60)
        assert exact.completion_tokens == room
        with pytest.raises(InvalidRequestError, match="holds 40 tokens, but 41 were asked for") as refused:
            eng.submit(prompt, SamplingParams(max_tokens=room + 1))
        assert refused.value.param == "prompt"


# ------------------------------------------------------------------------- failing steps


class _PoisonedModel:
    """The real model, except that any step containing the poison token raises."""

    def __init__(self, model, poison):
        self.model, self.poison = model, poison

    def __call__(self, input_ids, *args):
        if bool((input_ids == self.poison).any()):
            raise RuntimeError("poisoned step")
        return self.model(input_ids, *args)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(model):
    with make_engine(model, enable_prefix_caching=True) as eng:
        poison = 31337
        eng.runner.model = _PoisonedModel(eng.runner.model, poison)
        bad = eng.submit([1, 2, poison, 3], GREEDY).result(timeout=60)
        assert bad.finish_reason == "error"
        assert "poisoned step" in bad.error
        good = eng.generate(PROMPTS[1], GREEDY, timeout=60)
        assert good.finish_reason == "length" and good.completion_tokens == 8
        wait_until(lambda: eng.stats()["kv_blocks_used"] == 0, what="blocks to be freed")
        stats = eng.stats()
        assert stats["step_errors"] == 1 and stats["requests_failed"] == 1


def test_stopping_aborts_what_is_in_flight(model):
    eng = make_engine(model).start()
    handle = eng.submit(PROMPTS[0], SamplingParams(max_tokens=1000, ignore_eos=True))
    next(iter(handle))
    eng.stop()
    last = handle.result(timeout=30)
    assert last.finish_reason == "abort"
    with pytest.raises(Exception):
        eng.submit("Hello", GREEDY)


def test_loading_runs_on_a_thread_of_its_own_and_its_errors_reach_the_caller(monkeypatch):
    # A PyTorch thread pool left on the caller's thread would slow the loop's steps (see
    # Engine.__init__), so the loading must not run there; what it raises still must.
    from workers.engine import loader

    seen = []

    def failing_load(*args, **kwargs):
        seen.append(threading.current_thread())
        raise loader.WeightsError("the weights are truncated")

    monkeypatch.setattr(loader, "load_model", failing_load)
    with pytest.raises(loader.WeightsError, match="truncated"):
        Engine("/nowhere/model.gguf", device="cpu", dtype="float32")
    assert seen and seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()
