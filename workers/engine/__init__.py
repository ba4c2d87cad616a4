"""Our inference engine: paged KV cache, continuous batching, vectorized sampling.

No Django here. The public names are loaded on first use, so that importing this package (say,
for ``InvalidRequestError``) does not pull in torch.

    from workers.engine import Engine, SamplingParams
    with Engine(bundled_model_path()) as engine:
        print(engine.generate("Hello", SamplingParams(max_tokens=16)).text)
"""

import os
from importlib import import_module

# Triton fuses multiply-adds unless told otherwise, and its 3.10 turns that default off. The
# kernels here were validated with fusion on: pin it, so a Triton upgrade cannot change their
# numerics silently (an explicit setting in the environment still wins).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

_EXPORTS = {
    "Engine": ".engine",
    "EngineError": ".engine",
    "RequestHandle": ".engine",
    "SamplingParams": ".sequence",
    "RequestOutput": ".sequence",
    "RequestTimings": ".sequence",
    "TokenLogprob": ".sequence",
    "FinishReason": ".sequence",
    "InvalidRequestError": ".sequence",
    "LoadedModel": ".loader",
    "load_model": ".loader",
    "bundled_model_path": ".loader",
    "ModelConfig": ".config",
    "UnsupportedModelError": ".config",
    "WeightsError": ".config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
