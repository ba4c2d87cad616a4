"""The worker's engine host builds each deployment's engine from its spec."""

from __future__ import annotations

from workers.engine import SamplingParams
from workers.engine.loader import bundled_model_path
from workers.runtime import EngineHost


def test_a_deployment_with_fp8_weights_gets_an_fp8_engine():
    host = EngineHost()
    spec = {"id": 1, "name": "smol-fp8", "model": "smollm2", "weights": str(bundled_model_path()),
            "dtype": "float32", "quantization": "fp8", "batch_window_ms": 0, "max_batch_size": 2}
    engine = host.engine_for(spec)
    try:
        assert engine.stats()["quantization"] == "fp8" and engine.stats()["dtype"] == "float32"
        [output] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=4))
        assert output.completion_tokens > 0
    finally:
        host.unload("smol-fp8")
    assert "smol-fp8" not in host.loaded()
