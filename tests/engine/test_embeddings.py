"""Embedding requests (``SamplingParams(embed=True)``): the final hidden state of the prompt's last
token, L2-normalized, as Hugging Face computes it; the same alone, batched, prefix-cached or beside
requests that generate, which they leave as they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.engine import Engine, InvalidRequestError, SamplingParams

transformers = pytest.importorskip("transformers")
TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b\n", "Bonjour", "A"]


@pytest.fixture(scope="module")
def engine(bundled_model_fp32):
    with Engine(bundled_model_fp32, max_batch_size=8, max_batched_tokens=64, num_kv_blocks=128) as eng:
        yield eng


def embed(engine, prompts) -> list:
    handles = [engine.submit(p, SamplingParams(embed=True)) for p in prompts]
    return [h.result(timeout=120) for h in handles]


def test_an_embedding_is_the_last_tokens_normalized_final_hidden_state(engine, bundled_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(bundled_path.parent, gguf_file=bundled_path.name,
                                                           dtype=torch.float32).eval()
    for text, out in zip(TEXTS, embed(engine, TEXTS)):
        ids = engine.tokenizer.encode(text, add_special_tokens=True)
        with torch.no_grad():
            last = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(last, dim=-1).numpy()
        assert out.embedding.dtype == np.float32 and out.embedding.shape == expected.shape
        assert float(out.embedding @ expected) > 0.9999 and abs(np.linalg.norm(out.embedding) - 1) < 1e-5
        assert (out.finished, out.prompt_tokens, out.completion_tokens, out.text, out.token_ids) == \
            (True, len(ids), 0, "", [])


def test_batched_cached_or_beside_generation_an_embedding_is_the_same(engine):
    alone = [embed(engine, [text])[0].embedding for text in TEXTS]
    long_prompt = "Tell me about the sea. " * 12  # chunked over several steps (64 tokens a step)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    generated_alone = engine.submit(long_prompt, greedy).result(timeout=120)
    generating = engine.submit(long_prompt, greedy)
    together = embed(engine, TEXTS + [long_prompt])
    assert generating.result(timeout=120).token_ids == generated_alone.token_ids  # undisturbed
    for vector, out in zip(alone, together):
        assert np.abs(vector - out.embedding).max() < 1e-4
    again = embed(engine, [long_prompt])[0]  # its blocks are in the prefix cache now
    assert again.cached_prompt_tokens > 0 and np.abs(again.embedding - together[-1].embedding).max() < 1e-4


def test_embedding_params_are_checked(engine):
    for kwargs, param in [({"max_tokens": 5}, "max_tokens"), ({"response_format": {"type": "json_object"}}, "embed"),
                          ({"prompt_logprobs": 1}, "embed")]:
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(embed=True, **kwargs)
        assert caught.value.param == param
    with pytest.raises(InvalidRequestError, match="more than this model's context"):
        engine.submit([1] * (engine.max_model_len + 1), SamplingParams(embed=True))


def test_an_embedding_may_fill_the_whole_context(bundled_model_fp32):
    """It generates nothing, so its input may be as long as the context (a generation needs one
    place left): the same vector as from an engine with room to spare."""
    ids = list(range(100, 132))
    with Engine(bundled_model_fp32, max_batch_size=2, max_batched_tokens=32, num_kv_blocks=16, max_model_len=32) as small:
        full = small.submit(ids, SamplingParams(embed=True)).result(timeout=120)
        with pytest.raises(InvalidRequestError, match=r"more than this model's context takes \(32\)"):
            small.submit(ids + [7], SamplingParams(embed=True))
        with pytest.raises(InvalidRequestError, match="leave no room to generate"):
            small.submit(ids, SamplingParams(max_tokens=1))
    with Engine(bundled_model_fp32, max_batch_size=2, max_batched_tokens=64, num_kv_blocks=16) as roomy:
        assert np.abs(roomy.submit(ids, SamplingParams(embed=True)).result(timeout=120).embedding
                      - full.embedding).max() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")
def test_on_a_gpu_embeddings_match_the_float32_ones_and_come_through_the_async_copy(engine, bundled_path):
    """bfloat16 weights, CUDA decode graphs captured: embedding steps go eager, and their vectors
    reach the host through the step's one wait (pinned memory, no synchronization of their own)."""
    expected = [out.embedding for out in embed(engine, TEXTS)]
    with Engine(bundled_path, device="cuda", max_batch_size=8, cuda_graphs=True) as gpu:
        generating = gpu.submit("Tell me about the sea.", SamplingParams(max_tokens=16, temperature=0))
        got = embed(gpu, TEXTS)
        assert generating.result(timeout=120).completion_tokens == 16
    for vector, out in zip(expected, got):
        assert out.embedding.dtype == np.float32 and float(out.embedding @ vector) > 0.995
