"""Weights on disk → named torch tensors, in Hugging Face naming and layout.

Two sources: a GGUF file (quantized blocks dequantized on load with the ``gguf`` package) and a
Hugging Face folder of ``*.safetensors``. Both come out as ``{hf_name: tensor}`` in the layout
transformers uses, so the model has one loading path.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import UnsupportedModelError, WeightsError


@dataclass
class GGUFContents:
    path: Path
    metadata: dict[str, Any]  # llama.cpp key → value (strings, numbers, lists)
    tensors: dict[str, torch.Tensor]  # Hugging Face names, transformers layout


# GGUF tensor names (llama.cpp) → Hugging Face names; "{}" is the layer index.
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # Llama 3 RoPE frequency factors, precomputed by llama.cpp
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name_for_gguf(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors the model does not use."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_LAYER_PATTERN.fullmatch(name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    return None


def _gguf_reader(path: Path):
    """The file's reader and its key/value metadata; WeightsError for a file that is no GGUF."""
    import gguf

    if not path.is_file():
        raise WeightsError(f"no GGUF file at {path}")
    try:
        reader = gguf.GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items()
                    if not name.startswith("GGUF.")}
    except Exception as exc:  # the reader raises bare ValueErrors, IndexErrors, struct errors...
        raise WeightsError(f"{path.name} is not a readable GGUF file (truncated or corrupt?): {exc}"
                           ) from exc
    return reader, metadata


def read_gguf_metadata(path: str | os.PathLike) -> tuple[dict, list[str]]:
    """A GGUF file's metadata and the Hugging Face names of its tensors, without reading them."""
    reader, metadata = _gguf_reader(Path(path))
    return metadata, [name for t in reader.tensors if (name := hf_name_for_gguf(t.name)) is not None]


def read_gguf(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> GGUFContents:
    """Read a GGUF file: its metadata and its tensors dequantized to ``dtype``.

    llama.cpp's converter permutes the rows of Llama-architecture Q/K projections for its own RoPE
    layout; they are permuted back here so the math is the one transformers runs.
    """
    import gguf

    path = Path(path)
    reader, metadata = _gguf_reader(path)
    arch = metadata.get("general.architecture")
    if arch not in ("llama", "mistral", "qwen2"):
        raise UnsupportedModelError(f"{path.name}: unsupported GGUF architecture {arch!r}")
    num_heads = metadata.get(f"{arch}.attention.head_count")
    num_kv_heads = metadata.get(f"{arch}.attention.head_count_kv", num_heads)

    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name_for_gguf(tensor.name)
        if name is None:
            continue
        try:
            array = _dequantize(tensor, gguf)
        except Exception as exc:
            raise WeightsError(f"{path.name}: cannot read tensor {tensor.name} "
                               f"({tensor.tensor_type.name}): {exc}") from exc
        if arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = _unpermute_rope_rows(array, int(num_heads))
        elif arch in ("llama", "mistral") and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = _unpermute_rope_rows(array, int(num_kv_heads))
        tensors[name] = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    return GGUFContents(path=path, metadata=metadata, tensors=tensors)


def _dequantize(tensor: Any, gguf: Any) -> np.ndarray:
    """A GGUF tensor as a float32 array in numpy (row-major, [out_features, in_features]) order."""
    # GGUF lists dimensions innermost first; numpy wants them outermost first.
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    qtype = tensor.tensor_type
    expected_bytes = int(tensor.n_bytes)
    if tensor.data.nbytes != expected_bytes:
        raise WeightsError(f"holds {tensor.data.nbytes} bytes, expected {expected_bytes}")
    if qtype == gguf.GGMLQuantizationType.F32:
        array = np.array(tensor.data, dtype=np.float32)  # a copy: the file stays closable
    elif qtype == gguf.GGMLQuantizationType.F16:
        array = np.asarray(tensor.data, dtype=np.float16).astype(np.float32)
    else:
        array = gguf.quants.dequantize(np.asarray(tensor.data), qtype)
    return array.reshape(shape).astype(np.float32, copy=False)


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K (its RoPE pairs adjacent dimensions)."""
    half = weight.shape[0] // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def safetensors_files(folder: Path) -> list[Path]:
    """A Hugging Face folder's weight files: every shard its index names (each must be there), or
    its ``*.safetensors``."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {folder}")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightsError(f"{index.name} is not a shard index: {exc}") from exc
        missing = sorted(wanted - {f.name for f in files})
        if missing:
            raise WeightsError(f"{folder}: shards named in {index.name} are missing: {missing}")
        files = [folder / name for name in sorted(wanted)]
    return files


MAX_SAFETENSORS_HEADER = 100 * 2**20  # bytes: the format's own limit


def check_safetensors_file(path: Path) -> None:
    """WeightsError unless the file is a safetensors file holding every byte its header promises
    (a copy cut short fails here, not when a worker loads it)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            (header_size,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if header_size is None or not 0 < header_size <= min(size - 8, MAX_SAFETENSORS_HEADER):
                raise WeightsError(f"{path.name} is not a safetensors file (its header size is {header_size})")
            header = json.loads(handle.read(header_size))
    except WeightsError:
        raise
    except OSError as exc:
        raise WeightsError(f"{path.name} cannot be read: {exc}") from exc
    except ValueError as exc:  # not JSON, or not UTF-8
        raise WeightsError(f"{path.name} is not a safetensors file: its header is not JSON") from exc
    if not isinstance(header, dict):
        raise WeightsError(f"{path.name} is not a safetensors file: its header is not an object")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise WeightsError(f"{path.name}: tensor {name!r} has malformed data_offsets")
        end = max(end, offsets[1])
    needed = 8 + header_size + end
    if size < needed:
        raise WeightsError(f"{path.name} is cut short: {size:,} bytes of the {needed:,} its header describes")


def read_safetensors_folder(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32
                            ) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's ``*.safetensors`` files, converted to ``dtype``."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(Path(path)):
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name).to(dtype)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise WeightsError(f"{file.name} is not a readable safetensors file "
                               f"(truncated or corrupt?): {exc}") from exc
    return tensors
