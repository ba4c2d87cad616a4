"""Many concurrent streaming clients through the whole stack are batched by the engine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import DEPLOYMENT
from .stats import engine_stats

pytestmark = pytest.mark.slow


def test_32_concurrent_streams_complete_and_are_batched(openai_client, inference_worker, reference_engine):
    from workers.engine import SamplingParams

    prompts = [f"Say the number {i} in words." for i in range(32)]

    def stream(prompt):
        chunks = list(openai_client.completions.create(model=DEPLOYMENT, prompt=prompt, temperature=0, max_tokens=8,
                                                       stream=True))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(stream, prompts))

    # Each matches what the engine gives that prompt on its own.
    for prompt, (text, reason) in zip(prompts[:4], results[:4]):
        direct = reference_engine.submit(prompt, SamplingParams(temperature=0, max_tokens=8)).result(timeout=120)
        assert text == direct.text
    assert all(reason in ("stop", "length") for _, reason in results)
    assert engine_stats(inference_worker, DEPLOYMENT)["batch_size_max"] > 1
