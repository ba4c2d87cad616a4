"""What a model is, read from a GGUF file's metadata or a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping


class UnsupportedModelError(ValueError):
    """The weights describe a model this engine cannot run (architecture, activation, RoPE kind)."""


class WeightsError(ValueError):
    """The weights cannot be read: missing, truncated or corrupt file, missing tensors."""


# Hugging Face model types (and GGUF architectures) this engine runs, mapped to the forward pass
# that runs them. Mistral is a Llama with a sliding window, which llama.cpp also files as "llama".
_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_HF_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
_ROPE_TYPES = {"default", "linear", "llama3"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}; None = plain
    max_position_embeddings: int  # the context length
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.architecture not in ("llama", "qwen2"):
            raise UnsupportedModelError(f"unsupported architecture {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise UnsupportedModelError(f"model config: {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"model config: {self.num_heads} attention heads are not a multiple of "
                f"{self.num_kv_heads} key/value heads")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"model config: head_dim {self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in _ROPE_TYPES:
                raise UnsupportedModelError(f"unsupported RoPE scaling {kind!r}")

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, generation_config: Mapping[str, Any] | None = None
                       ) -> "ModelConfig":
        """From a Hugging Face ``config.json`` (transformers 4 or 5 layout)."""
        architecture = _hf_architecture(hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported activation {hf.get('hidden_act')!r}")
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("MLP biases (mlp_bias) are not supported")
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        # transformers 5 moved rope_theta and the scaling into "rope_parameters".
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        max_positions = int(hf.get("max_position_embeddings", 2048))
        window = hf.get("sliding_window")
        if window and (architecture == "llama" or hf.get("use_sliding_window")):
            # Sliding-window attention is not implemented; cap the context so it never matters.
            max_positions = min(max_positions, int(window))
        eos = _ids(hf.get("eos_token_id"))
        if generation_config:
            eos = eos + [i for i in _ids(generation_config.get("eos_token_id")) if i not in eos]
        return cls(
            architecture=architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(rope),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=architecture == "qwen2" or bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], tensor_names: Iterable[str]
                           ) -> "ModelConfig":
        """From a GGUF file's key/value metadata (llama.cpp key names) and the Hugging Face names
        of its tensors (which tell tied embeddings and q/k/v biases)."""
        tensor_names = set(tensor_names)
        arch = metadata.get("general.architecture")
        if arch not in _ARCHITECTURES:
            raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}")

        def key(name: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{name}", default)
            if value is None:
                raise WeightsError(f"GGUF metadata lacks {arch}.{name}")
            return value

        num_heads = int(key("attention.head_count"))
        hidden_size = int(key("embedding_length"))
        num_kv_heads = int(key("attention.head_count_kv", num_heads))
        head_dim = int(metadata.get(f"{arch}.attention.key_length")
                       or metadata.get(f"{arch}.rope.dimension_count")
                       or hidden_size // num_heads)
        vocab_size = metadata.get(f"{arch}.vocab_size")
        if vocab_size is None:
            vocab_size = len(metadata.get("tokenizer.ggml.tokens") or ())
        rope_scaling = None
        scaling_type = metadata.get(f"{arch}.rope.scaling.type")
        if scaling_type not in (None, "none"):
            rope_scaling = _rope_scaling({"rope_type": scaling_type,
                                          "factor": metadata.get(f"{arch}.rope.scaling.factor")})
        eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id") if k in metadata]
        return cls(
            architecture=_ARCHITECTURES[arch],
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings="lm_head.weight" not in tensor_names,
            attention_bias="model.layers.0.self_attn.q_proj.bias" in tensor_names,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos)),
        )


def _hf_architecture(hf: Mapping[str, Any]) -> str:
    model_type = hf.get("model_type")
    if model_type in _ARCHITECTURES:
        return _ARCHITECTURES[model_type]
    for name in hf.get("architectures") or ():
        if name in _HF_CLASSES:
            return _HF_CLASSES[name]
    named = model_type or ", ".join(hf.get("architectures") or ()) or "unknown"
    raise UnsupportedModelError(
        f"unsupported model architecture {named!r} (supported: Llama, Mistral, Qwen2)")


def _rope_scaling(rope: Mapping[str, Any]) -> dict | None:
    """The RoPE scaling dict in one spelling ("rope_type"), or None for plain RoPE."""
    if not rope:
        return None
    rope = dict(rope)
    kind = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if kind == "default":
        return None
    if kind not in _ROPE_TYPES:
        raise UnsupportedModelError(f"unsupported RoPE scaling {kind!r}")
    if rope.get("factor") is None:
        raise UnsupportedModelError(f"RoPE scaling {kind!r} without a factor")
    return {"rope_type": kind, **rope}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
