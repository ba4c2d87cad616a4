"""The Llama / Qwen2 decoder over a flattened batch of variable-length sequences.

One forward call runs every sequence's new tokens at once (no padding): each layer projects them,
writes their K/V into the paged cache and attends over it through the attention backend. The
projections are fused at load time (q/k/v into one matmul, gate/up into another) and the RoPE
tables precomputed, so a decode step is a short, fixed list of large operations.

Two choices are made once, when the model is built, never per call:
- ``ops``: the elementwise ops (RMSNorm, residual add + RMSNorm, RoPE, SiLU-and-multiply).
  ``TorchOps`` below is plain PyTorch and matches transformers exactly (the float32 CPU path);
  ``fused_kernels`` has the same functions as Triton kernels (the CUDA path) and ``cpu_ops`` as
  C ones (a bfloat16 model on the CPU; see ``ops_for``).
- ``linear``: ``F.linear``, or an FP8 matmul once ``quantize_weights`` has stored the layers'
  weights in FP8 (see ``fp8.py``), or oneDNN's once ``pack_for_cpu`` has packed them (bfloat16
  on the CPU; see ``onednn.py``), or, on a GPU once ``tune_small_batch_linear`` has measured
  where it wins, a Triton kernel for decode steps' few rows (see ``small_batch_linear.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8, onednn, small_batch_linear
from .attention import get_backend
from .attention.base import AttentionBackend, AttentionMetadata
from .config import ModelConfig, WeightsError

# The decoder layers' matmul weights: what FP8 mode quantizes (embeddings and the LM head stay).
LINEAR_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim / 2], float32, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if freq_factors is not None:  # llama.cpp stores Llama 3's scaling precomputed, as divisors
        return inv_freq / freq_factors.float()
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # "llama3": long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > original / low, inv_freq / factor,
                       torch.where(wavelen < original / high, inv_freq, blended))


def rope_tables(inv_freq: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [num_positions, head_dim] for every position up front, in float32 like
    transformers; each row holds its angles twice ([a, a]), the "rotate half" layout."""
    positions = torch.arange(num_positions, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.q_size = config.num_heads * d
        self.kv_size = config.num_kv_heads * d
        qkv_size = self.q_size + 2 * self.kv_size
        self.input_norm = _weight(dtype, h)
        self.qkv_proj = _weight(dtype, qkv_size, h)
        self.qkv_bias = _weight(dtype, qkv_size) if config.attention_bias else None
        self.o_proj = _weight(dtype, h, self.q_size)
        self.o_bias: nn.Parameter | None = None  # only Llama configs with attention_bias have it
        self.post_norm = _weight(dtype, h)
        self.gate_up_proj = _weight(dtype, 2 * config.intermediate_size, h)
        self.down_proj = _weight(dtype, h, config.intermediate_size)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None, *,
                 dtype: torch.dtype = torch.float32,
                 ops: type[TorchOps] | ModuleType | None = None) -> None:
        super().__init__()
        self.config = config
        self.backend = backend if backend is not None else get_backend("cpu")
        self.ops = ops if ops is not None else TorchOps
        self.linear: Callable[..., torch.Tensor] = F.linear
        self.quantization: str | None = None
        self.embed = _weight(dtype, config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = _weight(dtype, config.hidden_size)
        self.lm_head = (self.embed if config.tie_word_embeddings
                        else _weight(dtype, config.vocab_size, config.hidden_size))
        self.scale = config.head_dim ** -0.5
        self._set_rope_tables(rope_inv_freq(config))

    # -- loading -------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up. Raises WeightsError
        naming any tensor that is missing or has the wrong shape."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise WeightsError(f"the weights lack tensor {name}")
            return tensors[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise WeightsError(f"tensor {name} has shape {tuple(value.shape)}, "
                                   f"expected {tuple(param.shape)} for this config")
            param.copy_(value)

        put(self.embed, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(self.norm, take("model.norm.weight"), "model.norm.weight")
        if not cfg.tie_word_embeddings:
            put(self.lm_head, take("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(layer.input_norm, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            put(layer.post_norm, take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm.weight")
            qkv = [take(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
            put(layer.qkv_proj, torch.cat(qkv), p + "self_attn.{q,k,v}_proj.weight")
            if layer.qkv_bias is not None:
                bias = [take(f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
                put(layer.qkv_bias, torch.cat(bias), p + "self_attn.{q,k,v}_proj.bias")
            put(layer.o_proj, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            if p + "self_attn.o_proj.bias" in tensors:
                layer.o_bias = nn.Parameter(tensors[p + "self_attn.o_proj.bias"].clone(),
                                            requires_grad=False)
            gate_up = [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
            put(layer.gate_up_proj, torch.cat(gate_up), p + "mlp.{gate,up}_proj.weight")
            put(layer.down_proj, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
        if "rope_freqs" in tensors:
            self._set_rope_tables(rope_inv_freq(cfg, tensors["rope_freqs"]))

    @torch.no_grad()
    def quantize_weights(self, scheme: str, device: torch.device | str = "cpu") -> None:
        """Store the layers' linear weights in FP8 (``scheme``: one of ``fp8.SCHEMES``) and run
        their matmuls in FP8 from now on, the way ``device`` (where the model will run) does them.
        Call after ``load_weights``."""
        if self.quantization is not None:
            raise ValueError(f"the weights are already quantized ({self.quantization})")
        per_channel = fp8.per_channel_scales(scheme)
        if torch.device(device).type == "cuda":  # every layer has the same shapes
            for name in LINEAR_WEIGHTS:
                fp8.check_gpu_shape(name, getattr(self.layers[0], name).shape)
        for layer in self.layers:
            for name in LINEAR_WEIGHTS:
                weight = getattr(layer, name)
                delattr(layer, name)  # a parameter's name cannot take a module directly
                setattr(layer, name, fp8.quantize_weight(weight, per_channel=per_channel))
        self.linear = fp8.linear_for(device)
        self.quantization = scheme

    @torch.no_grad()
    def pack_for_cpu(self) -> bool:
        """On the CPU in bfloat16, store the layers' linear weights packed for oneDNN and
        multiply through it from now on (see ``onednn.py``). Call last: packed weights no longer
        move with ``.to()``. Returns whether it packed."""
        if self.embed.device.type != "cpu" or self.embed.dtype != torch.bfloat16 \
                or self.quantization is not None or self.linear is onednn.linear \
                or not onednn.available():
            return False
        for layer in self.layers:
            for name in LINEAR_WEIGHTS:
                weight = getattr(layer, name)
                delattr(layer, name)
                setattr(layer, name, onednn.pack(weight))
        self.linear = onednn.linear
        return True

    @torch.no_grad()
    def tune_small_batch_linear(self) -> dict | None:
        """On a CUDA GPU in bfloat16 or float16 (FP8 weights too): time the small-batch matmul
        kernel against the model's matmul on the layers' weights and route decode steps'
        matmuls to it where it wins. Call after the move to the GPU and before CUDA graphs are
        captured. Returns what it decided (None where it does not apply)."""
        if self.embed.device.type != "cuda" \
                or self.embed.dtype not in small_batch_linear.SUPPORTED_DTYPES:
            return None
        if isinstance(self.linear, small_batch_linear.SmallBatchLinear):
            return self.linear.report()  # tuned already
        linear = small_batch_linear.SmallBatchLinear(fallback=self.linear)
        linear.tune([[(layer.qkv_proj, layer.qkv_bias), (layer.o_proj, layer.o_bias),
                      (layer.gate_up_proj, None), (layer.down_proj, None)]
                     for layer in self.layers], activation_dtype=self.embed.dtype)
        self.linear = linear
        return linear.report()

    def _set_rope_tables(self, inv_freq: torch.Tensor) -> None:
        # Stored in the model's dtype; they follow .to().
        cos, sin = rope_tables(inv_freq, self.config.max_position_embeddings)
        dtype = self.embed.dtype
        device = self.embed.device
        self.register_buffer("rope_cos", cos.to(device, dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device, dtype), persistent=False)

    # -- running -------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Final-normed hidden states [num_tokens, hidden] of a flattened batch."""
        cfg = self.config
        num_tokens = input_ids.shape[0]
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        ops, linear, backend = self.ops, self.linear, self.backend
        cos = self.rope_cos[positions]  # [T, D], shared by every layer
        sin = self.rope_sin[positions]
        # Each residual add is done by the norm that follows it: the post-attention norm, then
        # the next layer's input norm (the final norm after the last layer).
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]

        residual = F.embedding(input_ids, self.embed)
        x = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        for layer, next_norm, (k_cache, v_cache) in zip(self.layers, next_norms, kv_caches):
            qkv = linear(x, layer.qkv_proj, layer.qkv_bias).view(num_tokens, -1, head_dim)
            # q and k sit next to each other, so one rotation covers both.
            qk = ops.apply_rope(qkv[:, : heads + kv_heads], cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, heads + kv_heads:]
            backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = backend.attend(q, k_cache, v_cache, meta, self.scale)
            out = linear(attn.reshape(num_tokens, heads * head_dim), layer.o_proj, layer.o_bias)
            x, residual = ops.add_rms_norm(out, residual, layer.post_norm, eps)
            out = linear(ops.silu_and_mul(linear(x, layer.gate_up_proj)), layer.down_proj)
            x, residual = ops.add_rms_norm(out, residual, next_norm, eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits [N, vocab] in float32 for (already normed) hidden states [N, hidden]."""
        return F.linear(hidden, self.lm_head).float()


class TorchOps:
    """The decoder's elementwise ops in plain PyTorch: the reference the fused kernels match."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of residual + x, residual + x)."""
        residual = residual + x
        return _rms_norm(residual, weight, eps), residual

    @staticmethod
    def apply_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q and k heads [T, heads, D] rotated by each token's cos/sin rows [T, D] (a new tensor;
        the fused kernel rotates in place)."""
        return _rotate(qk, cos.unsqueeze(1), sin.unsqueeze(1))

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def ops_for(device: torch.device | str) -> type[TorchOps] | ModuleType:
    """The elementwise ops for a model that runs on ``device``: fused Triton kernels on CUDA, C
    ones on the CPU for bfloat16 (float32 keeps plain PyTorch, the path checked against
    transformers), plain PyTorch elsewhere."""
    kind = torch.device(device).type
    if kind == "cuda":
        from . import fused_kernels

        return fused_kernels
    if kind == "cpu":
        from .cpu_ops import CpuOps

        return CpuOps
    return TorchOps


def _weight(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In float32 whatever the model dtype, then scaled in the model dtype, as transformers does.
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the "rotate half" layout: dimension i pairs with i + head_dim / 2."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
