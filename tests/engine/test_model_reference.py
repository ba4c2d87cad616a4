"""Our model against Hugging Face transformers, the reference implementation.

Same weights must give the same logits (float32, within float tolerance) and the same greedy
tokens. Sequences run the way the engine runs them: flattened batches over a paged KV cache, with
prefill, chunked prefill and decode steps mixed in one batch.
"""

from __future__ import annotations

import pytest
import torch

from workers.engine.loader import load_model

transformers = pytest.importorskip("transformers")


def greedy(paged_runner, model, prompts: list[list[int]], max_new_tokens: int, eos: frozenset[int]):
    """Greedy continuations of all prompts, batched: one prefill step, then decode steps."""
    runner = paged_runner(model)
    seqs = [runner.add() for _ in prompts]
    logits = runner.step(dict(zip(seqs, prompts)))
    outputs = {s: [int(logits[s][-1].argmax())] for s in seqs}
    for _ in range(max_new_tokens - 1):
        active = [s for s in seqs if outputs[s][-1] not in eos]
        if not active:
            break
        logits = runner.step({s: [outputs[s][-1]] for s in active})
        for s in active:
            outputs[s].append(int(logits[s][-1].argmax()))
    return [outputs[s] for s in seqs]


@pytest.fixture(scope="module")
def hf_bundled(bundled_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        bundled_path.parent, gguf_file=bundled_path.name, dtype=torch.float32)
    return model.eval()


def bundled_prompts(tokenizer) -> list[list[int]]:
    chat = [{"role": "user", "content": "Write a short poem about the sea."}]
    code = [{"role": "system", "content": "You are a Python expert."},
            {"role": "user", "content": "How do I reverse a list in Python?"}]
    return [
        tokenizer.encode(tokenizer.apply_chat_template(chat)),
        tokenizer.encode(tokenizer.apply_chat_template(code)),
        tokenizer.encode("The capital of France is"),
        tokenizer.encode("def fibonacci(n):\n"),
    ]


NEW_TOKENS = 64


@pytest.fixture(scope="module")
def bundled_greedy(paged_runner, bundled_model_fp32):
    """Our greedy continuations of ``bundled_prompts``, all decoded together in one batch."""
    tokenizer = bundled_model_fp32.tokenizer
    prompts = bundled_prompts(tokenizer)
    return prompts, greedy(paged_runner, bundled_model_fp32.model, prompts, NEW_TOKENS,
                           tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def hf_logits_of_continuations(bundled_greedy, hf_bundled):
    """transformers' logits over each prompt followed by our continuation (one forward each)."""
    prompts, continuations = bundled_greedy
    with torch.no_grad():
        return [hf_bundled(torch.tensor([p + c])).logits[0].float()
                for p, c in zip(prompts, continuations)]


def test_bundled_logits_match_transformers(paged_runner, bundled_model_fp32, bundled_greedy,
                                           hf_logits_of_continuations):
    prompts, continuations = bundled_greedy
    runner = paged_runner(bundled_model_fp32.model)
    seqs = [runner.add() for _ in prompts]
    # Every full sequence in one ragged prefill batch.
    ours = runner.step({s: p + c for s, p, c in zip(seqs, prompts, continuations)})
    for s, reference in zip(seqs, hf_logits_of_continuations):
        torch.testing.assert_close(ours[s], reference, atol=2e-3, rtol=1e-4)


def test_bundled_greedy_tokens_are_transformers_argmax(bundled_model_fp32, bundled_greedy,
                                                        hf_logits_of_continuations):
    """Each token we chose while decoding is the reference's argmax given the same prefix, so
    transformers' greedy search would produce exactly these continuations."""
    prompts, continuations = bundled_greedy
    eos = bundled_model_fp32.tokenizer.eos_token_ids
    for prompt, continuation, logits in zip(prompts, continuations, hf_logits_of_continuations):
        chosen = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        assert continuation == chosen
        assert len(continuation) == NEW_TOKENS or continuation[-1] in eos
    assert sum(len(c) == NEW_TOKENS for c in continuations) >= 2  # most ran the full length


def test_bundled_greedy_matches_transformers_generate(bundled_model_fp32, bundled_greedy,
                                                      hf_bundled):
    # generate() itself, for one prompt: its loop (KV cache, stopping) is the reference too.
    prompts, continuations = bundled_greedy
    eos = sorted(bundled_model_fp32.tokenizer.eos_token_ids)
    with torch.no_grad():
        generated = hf_bundled.generate(
            torch.tensor([prompts[0]]), attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    assert generated[0, len(prompts[0]):].tolist() == continuations[0]


def test_chunked_prefill_and_mixed_batches_give_the_same_logits(paged_runner, bundled_model_fp32):
    """Prefill in chunks while another sequence decodes == the whole prompt at once."""
    model = bundled_model_fp32.model
    tokenizer = bundled_model_fp32.tokenizer
    prompt = tokenizer.encode("Once upon a time, in a small village by the sea, there lived an old "
                              "fisherman who had never caught a single fish.")
    other = tokenizer.encode("Hello")

    whole = paged_runner(model, seed=1)
    expected = whole.step({whole.add(): prompt})[0]

    mixed = paged_runner(model, seed=2)
    a, b = mixed.add(), mixed.add()
    first = mixed.step({b: other})[b]
    cuts = [0, 5, 6, 17, len(prompt)]  # chunk of 5, a single-token chunk, then the rest
    chunks = []
    for lo, hi in zip(cuts, cuts[1:]):
        out = mixed.step({a: prompt[lo:hi], b: [int(first[-1].argmax())]})
        chunks.append(out[a])
        first = out[b]
    torch.testing.assert_close(torch.cat(chunks), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])
def test_tiny_models_match_transformers(paged_runner, tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    loaded = load_model(folder, dtype=torch.float32)
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert loaded.config.vocab_size == reference_model.config.vocab_size

    g = torch.Generator().manual_seed(0)
    lengths = [37, 9, 120]  # 120 reaches past the Llama 3 config's original context of 64
    sequences = [torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist()
                 for n in lengths]
    runner = paged_runner(loaded.model)
    seqs = [runner.add() for _ in sequences]
    # Prefill all but the last 3 tokens of each (the middle one in two chunks), then decode 3.
    ours = {s: [] for s in seqs}
    plan = [{seqs[0]: sequences[0][:-3], seqs[1]: sequences[1][:2], seqs[2]: sequences[2][:-3]},
            {seqs[1]: sequences[1][2:-3]}]
    plan += [{s: [seq[-k]] for s, seq in zip(seqs, sequences)} for k in (3, 2, 1)]
    for step in plan:
        for s, logits in runner.step(step).items():
            ours[s].append(logits)
    for s, seq in zip(seqs, sequences):
        with torch.no_grad():
            reference = reference_model(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(torch.cat(ours[s]), reference, atol=1e-4, rtol=1e-4)


def test_tiny_model_bfloat16_tracks_float32(paged_runner, tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    fp32 = load_model(folder, dtype=torch.float32)
    bf16 = load_model(folder, dtype=torch.bfloat16)
    assert bf16.model.embed.dtype == torch.bfloat16
    tokens = torch.randint(0, fp32.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    results = []
    for loaded in (fp32, bf16):
        runner = paged_runner(loaded.model)
        s = runner.add()
        results.append(runner.step({s: tokens.tolist()})[s])
    assert results[1].dtype == torch.float32  # logits always come out in float32
    scale = results[0].abs().max()
    assert (results[1] - results[0]).abs().max() < 0.05 * scale
    agreement = (results[1].argmax(-1) == results[0].argmax(-1)).float().mean()
    assert agreement > 0.9
