"""Guided sampling: the sampler picks the best token the grammar allows, and only for the rows
that ask for it; the draw is the same race, restricted."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from workers.engine.guided import CANDIDATES, Guide, VocabBytes
from workers.engine.json_grammar import JsonGrammar
from workers.engine.sampling import Sampler, SamplingBatch
from workers.engine.sequence import SamplingParams

PIECES = [bytes([b]) for b in range(32, 127)] + [b"\n", b"  ", b'{"', b'":', b'true', b'}\n', b'", "', b"\xc3", b"\xa9"]
EOS = len(PIECES)
CONTROL = EOS + 1
VOCAB = VocabBytes(PIECES + [None, None], len(PIECES) + 2)
JSON_OBJECT = {"type": "json_object"}


def token(piece: bytes) -> int:
    return PIECES.index(piece)


def guide(prefix: bytes = b"") -> Guide:
    g = Guide(JsonGrammar.from_response_format(JSON_OBJECT).matcher(), frozenset({EOS}))
    g.matcher.advance(prefix)
    return g


def sample(logits, params, guides, sampler=None):
    batch = SamplingBatch.build(params, [[0]] * len(params), [1] * len(params), vocab_size=logits.shape[1],
                                guides=guides, vocab=VOCAB)
    return (sampler or Sampler(seed=0))(logits.clone(), batch).token_ids.tolist()


def test_random_logits_only_ever_produce_json_and_end_when_it_is_whole():
    torch.manual_seed(0)
    sampler = Sampler(seed=1)
    for run in range(6):
        g, text = guide(), b""
        for _ in range(300):
            logits = torch.randn(1, VOCAB.first_byte(torch.device("cpu")).shape[0]) * 4
            logits[0, EOS] += 3 * (run % 2)  # some runs keen to end early
            logits[0, CONTROL] = 100  # a control token is never JSON
            (chosen,) = sample(logits, [SamplingParams(temperature=run / 5)], [g], sampler)
            assert chosen != CONTROL and not g.matcher.failed
            if chosen == EOS:
                assert isinstance(json.loads(text.decode()), dict)
                break
            g.advance(chosen, VOCAB)
            text += PIECES[chosen]
        assert g.matcher.states, text


def test_a_guided_draw_is_the_distribution_restricted_to_what_the_grammar_allows():
    logits = torch.zeros(1, len(PIECES) + 2)
    allowed = {token(b'"'): 1.0, token(b"}"): 0.0, token(b" "): -1.0, token(b"\n"): 0.5}  # after "{"
    for t, value in allowed.items():
        logits[0, t] = value
    logits[0, token(b"a")] = 3.0  # the likeliest token is not allowed
    rows = 4000
    picks = sample(logits.expand(rows, -1), [SamplingParams(temperature=1.0)] * rows,
                   [guide(b"{") for _ in range(rows)])
    counts = Counter(picks)
    may = [t for t in range(len(PIECES)) if guide(b"{").allows(t, VOCAB)]  # a key, "}", blanks
    assert set(counts) <= set(may) and len(may) > len(allowed)
    expected = logits[0, may].softmax(-1)
    for t, p in zip(may, expected.tolist()):
        assert abs(counts[t] / rows - p) < 0.03, (PIECES[t], counts[t], p)


def test_only_guided_rows_change_and_greedy_ones_take_the_best_allowed():
    torch.manual_seed(3)
    logits = torch.randn(3, len(PIECES) + 2)
    logits[:, token(b"x")] = 50  # everyone's favourite; not JSON at the start
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=5), SamplingParams(temperature=0)]
    free = sample(logits, params, [None, None, None])
    picks = sample(logits, params, [guide(), None, guide()])
    assert free[0] == free[2] == token(b"x")
    assert picks[1] == free[1]  # the unguided row draws as it would have
    starts = [t for t in range(len(PIECES)) if guide().allows(t, VOCAB)]
    assert picks[0] == max(starts, key=lambda t: logits[0, t].item())
    assert picks[2] == max(starts, key=lambda t: logits[2, t].item())


def test_a_filter_that_drops_every_allowed_token_leaves_the_likeliest_allowed_one():
    logits = torch.full((1, len(PIECES) + 2), -5.0)
    letters = [token(bytes([b])) for b in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"]
    assert len(letters) > CANDIDATES
    logits[0, letters] = torch.linspace(10, 9, len(letters))  # many likely tokens, none JSON
    logits[0, token(b"{")] = -1.0
    logits[0, token(b'{"')] = -2.0
    (chosen,) = sample(logits, [SamplingParams(temperature=1.0, top_k=5)], [guide()])
    assert chosen == token(b"{")


def test_a_whole_object_ends_with_the_end_token_even_when_the_model_would_go_on():
    logits = torch.zeros(1, len(PIECES) + 2)
    logits[0, token(b",")] = 9
    logits[0, EOS] = -9
    (chosen,) = sample(logits, [SamplingParams(temperature=0)], [guide(b'{"a": 1}')])
    assert chosen == EOS


def test_a_character_split_over_tokens_is_allowed_only_whole():
    g = guide(b'{"k": "')
    assert g.allows(token(b"\xc3"), VOCAB) and not g.allows(token(b"\xa9"), VOCAB)
    g.advance(token(b"\xc3"), VOCAB)
    assert g.allows(token(b"\xa9"), VOCAB) and not g.allows(token(b'"'), VOCAB)


@pytest.mark.parametrize("bad", [CONTROL, EOS])
def test_control_and_early_end_tokens_are_refused(bad):
    assert not guide(b"{").allows(bad, VOCAB)


def test_a_drawn_token_the_grammar_allows_is_kept_ties_and_all():
    """Guiding changes a row's token only where the grammar refuses it: a greedy row keeps the
    argmax, the lowest id among equal logits, as an unguided row would."""
    logits = torch.full((1, len(PIECES) + 2), -5.0)
    inside = guide(b'{"ab')  # inside a key: any letter may follow
    logits[0, token(b"x")] = logits[0, token(b"c")] = 2.0
    assert sample(logits, [SamplingParams(temperature=0)], [inside]) == [min(token(b"x"), token(b"c"))]
    logits[0, token(b"\n")] = 9.0  # the argmax, refused inside a key: the best allowed instead
    logits[0, token(b"c")] = 1.5
    assert sample(logits, [SamplingParams(temperature=0)], [guide(b'{"ab')]) == [token(b"x")]
