"""The bundled model in bfloat16 on the CPU: the path a worker takes where the CPU multiplies
bfloat16 natively (the C prefill attention and elementwise ops where they are available).
The float32 tests elsewhere hold the engine to transformers; these hold bfloat16 to float32 and
to itself."""

from __future__ import annotations

import pytest
import torch

from workers.engine import Engine, SamplingParams
from workers.engine.attention import cpu_native
from workers.engine.loader import load_model
from workers.engine.model import TorchOps

# Prompts of 9 to 160 words: some fit one step's token budget, some are chunked.
PROMPTS = [f"Note {i}: " + " ".join(["river", "copper", "morning", "garden", "silent"][(i * j) % 5]
                                     for j in range(9 + i * 14)) for i in range(12)]
pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs a C compiler")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def bundled_model_bf16(bundled_path):
    return load_model(bundled_path, dtype=torch.bfloat16)


def test_bfloat16_logits_track_float32_as_closely_as_plain_pytorch(
        paged_runner, bundled_model_bf16, bundled_model_fp32, monkeypatch):
    tokens = torch.randint(0, 49152, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    # A prompt in two chunks, the second over the first's cached blocks, then two decodes.
    steps = [tokens[:100], tokens[100:148], tokens[148:149], tokens[149:]]

    def logits(model):
        runner = paged_runner(model, block_size=16)  # a block size the prefill kernel takes
        s = runner.add()
        return torch.cat([runner.step({s: chunk})[s] for chunk in steps])

    full = logits(bundled_model_fp32.model)
    half = logits(bundled_model_bf16.model)
    # The same bfloat16 model through PyTorch's own ops and attention.
    monkeypatch.setattr(bundled_model_bf16.model, "ops", TorchOps)
    monkeypatch.setattr(cpu_native, "prefill_available", lambda: False)
    plain = logits(bundled_model_bf16.model)

    assert not torch.equal(half, plain)  # the C path did run
    error, plain_error = (half - full).abs().mean(), (plain - full).abs().mean()
    assert error <= 1.25 * plain_error, (float(error), float(plain_error))
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() > 0.85


def test_bfloat16_greedy_output_is_the_same_alone_and_in_a_batch(bundled_model_bf16):
    settings = dict(max_batch_size=16, max_batched_tokens=128, num_kv_blocks=512,
                    enable_prefix_caching=False)
    prompts = PROMPTS
    with Engine(bundled_model_bf16, **settings) as eng:
        assert eng.dtype == torch.bfloat16
        batched = [r.token_ids for r in eng.generate(prompts, GREEDY, timeout=300)]
        for index in (0, 7, 11):
            assert eng.generate(prompts[index], GREEDY, timeout=120).token_ids == batched[index]
