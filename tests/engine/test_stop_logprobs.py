"""Token ids and logprob entries go out with their text: a token is returned iff at least one
character of its text is, in the output that carries the first such character. Text held back as
a possible stop string holds its tokens back; tokens of the stop string that ended a request are
dropped. First the rule on made-up pieces, then on the bundled model, streamed and whole."""

from __future__ import annotations

import pytest

from workers.engine import Engine, SamplingParams, TokenLogprob
from workers.engine.sequence import OutputGate

NEVER = "\x00"  # ends a stop string that never matches, so its start is only ever held back


def feed_tokens(gate: OutputGate, pieces: list[str]) -> list[tuple[str, list[int], str | None]]:
    """Token i has id i and text ``pieces[i]``; each release as (text, ids, stop)."""
    releases = []
    for token_id, piece in enumerate(pieces):
        gate.add(token_id, TokenLogprob(token_id, -1.0))
        out = gate.feed(piece)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        releases.append((out.text, out.token_ids, out.stop))
        if out.stop is not None:
            break
    return releases


def test_a_stop_string_over_several_tokens_drops_them_all():
    releases = feed_tokens(OutputGate([" can I"]), ["Hello", "!", " How", " can", " I", "?"])
    assert releases == [("Hello", [0], None), ("!", [1], None), (" How", [2], None),
                        ("", [], None), ("", [], " can I")]


def test_a_token_with_text_before_the_stop_string_is_kept():
    # "ab|cde|fg" with stop "defg": "c" of the second token is returned, so that token is.
    releases = feed_tokens(OutputGate(["defg"]), ["ab", "cde", "fg"])
    assert releases == [("ab", [0], None), ("c", [1], None), ("", [], "defg")]


def test_a_stop_string_at_a_token_start_drops_that_token():
    releases = feed_tokens(OutputGate([", apple"]), [" pear", ",", " pear", ",", " apple"])
    assert releases == [(" pear", [0], None), ("", [], None), (", pear", [1, 2], None),
                        ("", [], None), ("", [], ", apple")]


def test_held_tokens_go_out_with_their_text_when_the_stop_string_does_not_match():
    releases = feed_tokens(OutputGate([" END"]), ["the", " E", "nd", " of", " it"])
    assert releases == [("the", [0], None), ("", [], None), (" End", [1, 2], None),
                        (" of", [3], None), (" it", [4], None)]


def test_held_text_and_its_tokens_flush_together_at_the_end():
    gate = OutputGate([" END"])
    assert feed_tokens(gate, ["x", " E", "N"]) == [("x", [0], None), ("", [], None), ("", [], None)]
    end = gate.flush()
    assert (end.text, end.token_ids) == (" EN", [1, 2])
    assert [lp.token_id for lp in end.logprobs] == [1, 2]


def test_tokens_ending_mid_character_go_with_the_token_that_completes_it():
    gate = OutputGate([])
    assert feed_tokens(gate, ["a", "", "", "é"]) == [("a", [0], None), ("", [], None),
                                                     ("", [], None), ("é", [1, 2, 3], None)]


def test_a_token_that_never_got_text_is_still_reported_at_the_end():
    gate = OutputGate(["zz"])
    gate.add(7, None)  # e.g. its decoding failed: the request ends with an error
    end = gate.flush()
    assert (end.text, end.token_ids, end.logprobs) == ("", [7], [])


# -- on the bundled model ---------------------------------------------------------------------

PROMPT = "List of fruits: apple, banana,"
FREE = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)


@pytest.fixture(scope="module")
def engine(bundled_model_fp32):
    with Engine(bundled_model_fp32, max_batch_size=8, max_batched_tokens=256, num_kv_blocks=256,
                enable_prefix_caching=False) as eng:
        yield eng


@pytest.fixture(scope="module")
def free(engine, bundled_model_fp32):
    """The greedy run without stop strings: token ids, their texts, where each text starts."""
    result = engine.generate(PROMPT, FREE, timeout=60)
    decode = bundled_model_fp32.tokenizer.decode
    texts = [decode([t]) for t in result.token_ids]
    starts = [len(decode(result.token_ids[:i])) for i in range(len(result.token_ids))]
    assert "".join(texts) == result.text  # whole characters: each token's text is its own
    return result, texts, starts


def streamed_and_whole(engine, params):
    """The outputs of one streamed run, after checking that the whole result matches them."""
    outputs = list(engine.submit(PROMPT, params))
    whole = engine.generate(PROMPT, params, timeout=60)
    assert "".join(o.text for o in outputs) == whole.text
    assert [t for o in outputs for t in o.token_ids] == whole.token_ids
    assert [lp for o in outputs for lp in o.logprobs] == whole.logprobs
    return outputs, whole


def assert_tokens_go_out_with_their_first_character(outputs, tokenizer):
    """Each output's tokens are those whose text starts in that output's text."""
    returned, sent = 0, []
    for out in outputs:
        assert out.token_ids == [lp.token_id for lp in out.logprobs]
        end = returned + len(out.text)
        for token in out.token_ids:
            start = len(tokenizer.decode(sent))
            assert returned <= start < end, f"token {token} is not in {out.text!r}"
            sent.append(token)
        returned = end


def output_of_each_token(outputs) -> list[int]:
    return [n for n, out in enumerate(outputs) for _ in out.token_ids]


def alone_in_its_stretch(texts, i) -> bool:
    """Token i shares no character with its neighbours, so holding back its text holds back
    no more than it."""
    return texts[i][0] not in texts[i - 1] and texts[i][0] not in texts[i + 1]


def test_a_stop_string_over_several_tokens_returns_only_the_tokens_before_it(engine, free,
                                                                             bundled_model_fp32):
    result, texts, starts = free
    k = next(i for i in range(1, len(texts) - 3)
             if result.text.index("".join(texts[i:i + 3])) == starts[i])
    stop = "".join(texts[k:k + 3])
    outputs, whole = streamed_and_whole(engine, SamplingParams(**{**vars(FREE), "stop": [stop]}))
    assert whole.finish_reason == "stop" and whole.text == result.text[:starts[k]]
    assert whole.token_ids == result.token_ids[:k]
    assert whole.logprobs == result.logprobs[:k]
    assert "".join(texts[:k]) == whole.text
    assert whole.completion_tokens == k + 3  # billed as generated, stop string included
    assert_tokens_go_out_with_their_first_character(outputs, bundled_model_fp32.tokenizer)


def test_a_stop_string_from_inside_a_token_keeps_that_token(engine, free, bundled_model_fp32):
    result, texts, starts = free
    k = next(i for i in range(1, len(texts) - 2) if len(texts[i]) >= 3
             and result.text.index(texts[i][1:] + texts[i + 1]) == starts[i] + 1)
    stop = texts[k][1:] + texts[k + 1]
    outputs, whole = streamed_and_whole(engine, SamplingParams(**{**vars(FREE), "stop": [stop]}))
    assert whole.finish_reason == "stop" and whole.text == result.text[:starts[k] + 1]
    assert whole.token_ids == result.token_ids[:k + 1]
    assert whole.logprobs == result.logprobs[:k + 1]
    assert_tokens_go_out_with_their_first_character(outputs, bundled_model_fp32.tokenizer)


def test_a_token_held_back_goes_out_with_its_text_once_the_stop_string_fails(engine, free,
                                                                             bundled_model_fp32):
    result, texts, _ = free
    # A token whose whole text starts the stop string is held back with it; the next token
    # lets both out together.
    k = next(i for i in range(1, len(texts) - 1) if alone_in_its_stretch(texts, i))
    params = SamplingParams(**{**vars(FREE), "stop": [texts[k] + NEVER]})
    outputs, whole = streamed_and_whole(engine, params)
    assert (whole.text, whole.token_ids, whole.logprobs) == (result.text, result.token_ids,
                                                             result.logprobs)
    where = output_of_each_token(outputs)
    assert where[k] == where[k + 1] and outputs[where[k]].text.startswith(texts[k] + texts[k + 1])
    assert_tokens_go_out_with_their_first_character(outputs, bundled_model_fp32.tokenizer)


def test_held_text_and_its_tokens_flush_when_the_length_limit_ends_the_request(engine, free,
                                                                               bundled_model_fp32):
    result, texts, _ = free
    k = next(i for i in range(3, len(texts) - 1) if alone_in_its_stretch(texts, i))
    params = SamplingParams(**{**vars(FREE), "max_tokens": k + 1, "stop": [texts[k] + NEVER]})
    outputs, whole = streamed_and_whole(engine, params)
    assert whole.finish_reason == "length"
    assert outputs[-1].text == texts[k] and outputs[-1].token_ids == [result.token_ids[k]]
    assert whole.token_ids == result.token_ids[:k + 1]
    assert whole.logprobs == result.logprobs[:k + 1]
    assert_tokens_go_out_with_their_first_character(outputs, bundled_model_fp32.tokenizer)
