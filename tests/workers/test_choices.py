"""How a request's answers add up to one request: its end, its tokens, its timings, its seeds."""

from __future__ import annotations

from types import SimpleNamespace

from workers import choices
from workers.engine import SamplingParams
from workers.engine.sequence import RequestTimings


def output(reason: str, completion: int, *, cached: int = 0, ttft: float = 0.5, latency: float = 2.0,
           error: str | None = None):
    timings = RequestTimings(arrival_time=0.0, queue_time=ttft / 2, time_to_first_token=ttft, e2e_latency=latency,
                             mean_batch_size=3.0)
    return SimpleNamespace(finish_reason=reason, prompt_tokens=10, cached_prompt_tokens=cached,
                           completion_tokens=completion, timings=timings, error=error, finished=True)


def test_one_answer_keeps_the_request_id():
    assert choices.engine_ids("chatcmpl-1", 1) == ["chatcmpl-1"]
    ids = choices.engine_ids("chatcmpl-1", 3)
    assert len(set(ids)) == 3 and all(i.startswith("chatcmpl-1") for i in ids)


def test_the_prompt_counts_once_and_the_answers_add_up():
    usage = choices.usage([output("stop", 4, cached=0), output("length", 7, cached=10)], n=2)
    assert usage == {"prompt_tokens": 10, "cached_prompt_tokens": 0, "completion_tokens": 11}
    # Cut short (a failure mid-stream): what each answer produced so far, one not started at all.
    assert choices.usage([output("stop", 4), None], n=2, prompt_tokens=10)["completion_tokens"] == 4


def test_a_failed_or_aborted_answer_decides_the_requests_end():
    assert choices.finish_reason([output("length", 1), output("stop", 1)]) == "length"
    assert choices.finish_reason([output("stop", 1), output("abort", 1)]) == "abort"
    failed = [output("abort", 1), output("error", 1, error="boom")]
    assert choices.finish_reason(failed) == "error" and choices.error(failed) == "boom"


def test_timings_run_from_the_first_token_of_any_answer_to_the_last_answer():
    timings = choices.timings([output("stop", 1, ttft=0.4, latency=1.0), output("stop", 1, ttft=0.2, latency=3.0)])
    assert (timings.time_to_first_token, timings.e2e_latency, timings.queue_time) == (0.2, 3.0, 0.1)


def test_each_answer_of_a_seeded_request_has_its_own_seed():
    params = SamplingParams(seed=41, temperature=0.7, max_tokens=9)
    seeds = [choices.params_for(params, i).seed for i in range(3)]
    assert seeds == [41, 42, 43]
    assert choices.params_for(params, 2).max_tokens == 9 and params.seed == 41
    unseeded = SamplingParams()
    assert choices.params_for(unseeded, 2).seed is None


def test_a_batch_of_prompts_counts_each_prompt_once():
    # Two prompts (10 and 10 tokens), two answers each: the second prompt's first answer read 4
    # tokens from the cache.
    outputs = [output("stop", 1), output("stop", 2), output("stop", 3, cached=4), output("length", 4, cached=8)]
    assert choices.usage(outputs, n=2) == {"prompt_tokens": 20, "cached_prompt_tokens": 4, "completion_tokens": 10}
    answers = choices.Choices([SimpleNamespace() for _ in range(4)], n=2)
    answers.handles = [SimpleNamespace(prompt_tokens=t) for t in (7, 7, 5, 5)]
    assert answers.prompt_tokens == 12


def test_an_answer_waiting_behind_its_siblings_has_not_stalled():
    """Answers queued in the engine behind the others of their request produce nothing for a
    while: the request stalls only when none of its answers progresses."""
    import threading
    import time

    import pytest

    from workers.relay import Stream

    def streams():
        return [Stream(None, "reply", lambda out: {}) for _ in range(2)]

    queued, busy = streams()
    # Waited on first: judged on its own progress (a minute ago), it would time out at once.
    answers = choices.Choices([queued, busy])
    queued.progressed -= 60
    done = threading.Event()

    def generate():  # the other answer makes progress and ends, then the queued one runs and ends
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            busy.progressed = time.monotonic()
            done.wait(0.02)  # the pace of a decoding engine's steps
        busy.end()
        queued.progressed = time.monotonic()
        queued.end()

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        answers.wait(1.0)
    finally:
        worker.join()
    silent = choices.Choices(streams())
    with pytest.raises(TimeoutError):
        silent.wait(0.05)


def test_a_prompt_computed_chunk_by_chunk_has_not_stalled_and_says_so():
    """A long prompt on a slow machine yields nothing for a while: its computed tokens growing
    is progress, reported (for the gateway's stall timer) while no output says it; once they
    stop growing, it stalls."""
    import threading
    import time

    import pytest

    from workers.relay import _PROGRESS, Stream

    class Relay:
        def __init__(self):
            self.items = []

        def put(self, stream, item):
            self.items.append(item)

    relay = Relay()
    stream = Stream(relay, "reply", lambda out: {})
    stream.handle = SimpleNamespace(computed_tokens=0)
    answers = choices.Choices([stream])
    answers.handles = [stream.handle]
    done = threading.Event()

    def prefill():  # a chunk every 20 ms for 0.3 s, then the first token ends it
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            stream.handle.computed_tokens += 32
            done.wait(0.02)
        stream.progressed = time.monotonic()
        stream.end()

    worker = threading.Thread(target=prefill)
    worker.start()
    try:
        answers.wait(0.1, report_every=0.02)  # a stall timeout shorter than the prefill
    finally:
        worker.join()
    assert relay.items.count(_PROGRESS) >= 3

    stuck = Stream(relay, "reply", lambda out: {})
    stuck.handle = SimpleNamespace(computed_tokens=64)  # part of its prompt, then nothing
    with pytest.raises(TimeoutError):
        choices.Choices([stuck]).wait(0.1, report_every=0.02)
