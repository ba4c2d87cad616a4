"""Shared engine fixtures: the bundled model, and small random Hugging Face models on disk.

- ``bundled_path``: the bundled SmolLM2-135M-Instruct GGUF file.
- ``bundled_model_fp32``: that model loaded once per session in float32 (a ``LoadedModel``).
- ``tiny_model_dir(arch)``: a folder with a random-initialised small model saved the way
  transformers saves one (config.json + model.safetensors + tokenizer.json +
  tokenizer_config.json with a ChatML template); ``arch`` is one of ``TINY_ARCHS``.
  Folders are built once per session and per arguments; treat them as read-only.
- ``paged_runner``: the ``PagedSequences`` class, a minimal stand-in for the scheduler that runs
  a model over a paged KV cache (``runner = paged_runner(model); s = runner.add();
  logits = runner.step({s: token_ids})[s]``).
"""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import pytest
import torch

from workers.engine.attention.base import AttentionMetadata
from workers.engine.loader import bundled_model_path, load_model

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Small configs that still exercise what differs between real models: grouped-query attention,
# untied vs tied embeddings, q/k/v biases, Llama 3 RoPE scaling, a model vocabulary larger than
# the tokenizer's (as Qwen2's is).
TINY_ARCHS = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False, rope_theta=10000.0),
    "llama3": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=1,
                   tie_word_embeddings=True, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=False, rope_theta=1000000.0),
}


@pytest.fixture(scope="session")
def paged_runner():
    return PagedSequences


class PagedSequences:
    """A minimal stand-in for the scheduler: sequences that own shuffled blocks of a paged cache."""

    def __init__(self, model, *, num_blocks: int = 256, block_size: int = 8, seed: int = 0) -> None:
        cfg = model.config
        dtype = model.embed.dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # NaN-filled: a read of a slot nobody wrote shows up in the logits.
        self.kv_caches = [(torch.full(shape, float("nan"), dtype=dtype),
                           torch.full(shape, float("nan"), dtype=dtype))
                          for _ in range(cfg.num_layers)]
        self.model = model
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []

    def add(self) -> int:
        self.tables.append([])
        self.lengths.append(0)
        return len(self.tables) - 1

    @torch.inference_mode()
    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one batch; returns each sequence's logits for its new tokens [n, vocab]."""
        seqs = list(new_tokens)
        ids, positions, slots, starts = [], [], [], [0]
        for s in seqs:
            tokens = new_tokens[s]
            for i, token in enumerate(tokens):
                pos = self.lengths[s] + i
                if pos // self.block_size >= len(self.tables[s]):
                    self.tables[s].append(self.free.pop())
                ids.append(token)
                positions.append(pos)
                slots.append(self.tables[s][pos // self.block_size] * self.block_size
                             + pos % self.block_size)
            self.lengths[s] += len(tokens)
            starts.append(starts[-1] + len(tokens))
        width = max(len(self.tables[s]) for s in seqs)
        tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        for row, s in enumerate(seqs):
            tables[row, : len(self.tables[s])] = torch.tensor(self.tables[s])
        context = [self.lengths[s] for s in seqs]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            context_lens=torch.tensor(context, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(len(new_tokens[s]) for s in seqs),
            max_context_len=max(context),
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv_caches)
        logits = self.model.compute_logits(hidden)
        return {s: logits[starts[row]:starts[row + 1]] for row, s in enumerate(seqs)}


@pytest.fixture(scope="session")
def bundled_path() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="session")
def bundled_model_fp32(bundled_path):
    return load_model(bundled_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_tokenizer_json(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer trained on a few sentences, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "def add(a, b):\n    return a + b\n",
        "Hello there! How are you today? I am fine, thank you.",
        "Numbers like 12345 and 3.14159 appear in text; so do émigrés and naïve cafés.",
    ] * 20
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    path = tmp_path_factory.mktemp("tiny-tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer_json):
    """Factory: ``tiny_model_dir(arch, **config_overrides) -> Path``."""
    built: dict[tuple, Path] = {}

    def build(arch: str, **overrides) -> Path:
        key = (arch, tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in overrides.items())))
        if key not in built:
            built[key] = _save_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch,
                                          tiny_tokenizer_json, overrides)
        return built[key]

    return build


def _save_tiny_model(folder: Path, arch: str, tokenizer_json: Path, overrides: dict) -> Path:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(TINY_ARCHS)}")
    settings = {**TINY_ARCHS[arch], **overrides}
    model_type = settings.pop("model_type")
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    eos_id = tokenizer.token_to_id("<|im_end|>")
    settings = {
        "vocab_size": tokenizer.get_vocab_size() + 16,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "bos_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "eos_token_id": eos_id,
        **settings,
    }
    config_class = Qwen2Config if model_type == "qwen2" else LlamaConfig
    config = config_class(**settings)
    torch.manual_seed(zlib.crc32(arch.encode()))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # The default init (std 0.02, unit norms, zero biases) gives near-uniform logits and leaves
    # norms and biases untested; spread every parameter out instead.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE,
    }))
    return folder
