"""Reading weights: GGUF (every quantization type we claim), safetensors folders, bad files."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from workers.engine.config import ModelConfig, UnsupportedModelError, WeightsError
from workers.engine.loader import load_model
from workers.engine.weights import read_gguf, read_safetensors_folder

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

LLAMA_METADATA = dict(block_count=1, context_length=128, embedding_length=256,
                      feed_forward_length=256, head_count=4, head_count_kv=4)


def write_gguf(path, arch, tensors, *, metadata=LLAMA_METADATA, tokens=None):
    """A GGUF file: ``tensors`` is [(gguf_name, array, qtype)], arrays already in qtype's bytes."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(metadata["block_count"])
    writer.add_context_length(metadata["context_length"])
    writer.add_embedding_length(metadata["embedding_length"])
    writer.add_feed_forward_length(metadata["feed_forward_length"])
    writer.add_head_count(metadata["head_count"])
    writer.add_head_count_kv(metadata["head_count_kv"])
    writer.add_layer_norm_rms_eps(metadata.get("rms_norm_eps", 1e-5))
    writer.add_rope_freq_base(metadata.get("rope_theta", 10000.0))
    if "vocab_size" in metadata:
        writer.add_vocab_size(metadata["vocab_size"])
    if tokens is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens["tokens"])
        writer.add_token_merges(tokens["merges"])
        writer.add_token_types(tokens["types"])
        writer.add_eos_token_id(tokens["eos"])
        writer.add_chat_template(tokens["chat_template"])
    for name, array, qtype in tensors:
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def raw_k_quant_blocks(qtype, rows, cols, rng):
    """Random K-quant bytes with sane f16 scales (the gguf package cannot quantize to these)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin, then scales and quants
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = scale
    else:  # Q6_K: quants, high bits, int8 scales, then d
        blocks[..., -2:] = scale
    return blocks.reshape(rows, -1)


def test_every_supported_gguf_type_dequantizes_in_the_right_layout(tmp_path):
    rng = np.random.default_rng(0)
    rows, cols = 8, 256
    original = rng.standard_normal((rows, cols)).astype(np.float32)
    cases = {}
    for qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
        cases[qtype] = gguf.quants.quantize(original, qtype)
    for qtype in (Q.Q4_K, Q.Q6_K):
        cases[qtype] = raw_k_quant_blocks(qtype, rows, cols, rng)
    # One layer tensor name per type, so all of them travel through the normal loading path.
    names = ["ffn_up", "ffn_gate", "ffn_down", "attn_v", "attn_output", "attn_norm", "ffn_norm",
             "attn_q"]
    tensors = [(f"blk.{i}.{name}.weight", data, qtype)
               for i, (name, (qtype, data)) in enumerate(zip(names, cases.items()))]
    path = write_gguf(tmp_path / "types.gguf", "qwen2", tensors)

    read = read_gguf(path).tensors
    for (gguf_name, data, qtype), name in zip(tensors, names):
        hf_name = next(k for k in read if k.startswith(f"model.layers.{gguf_name.split('.')[1]}."))
        got = read[hf_name]
        assert got.shape == (rows, cols), qtype.name
        assert got.dtype == torch.float32
        expected = gguf.quants.dequantize(data, qtype).reshape(rows, cols)
        assert torch.equal(got, torch.from_numpy(expected)), qtype.name
        assert torch.isfinite(got).all()
        if qtype not in (Q.Q4_K, Q.Q6_K):
            # Real quantization of `original`: close to it, which a transposed read would not be.
            tolerance = {Q.Q4_0: 0.5, Q.Q4_1: 0.5, Q.Q8_0: 0.05, Q.BF16: 0.02}.get(qtype, 1e-3)
            assert np.abs(got.numpy() - original).max() < tolerance, qtype.name


def test_gguf_tensors_convert_to_the_requested_dtype(tmp_path):
    data = np.arange(256 * 4, dtype=np.float32).reshape(4, 256) / 100
    path = write_gguf(tmp_path / "one.gguf", "qwen2", [("blk.0.ffn_up.weight", data, Q.F32)])
    tensor = read_gguf(path, dtype=torch.bfloat16).tensors["model.layers.0.mlp.up_proj.weight"]
    assert tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, torch.from_numpy(data).to(torch.bfloat16))


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama Q/K rows (pairs dimension i with i + 1)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama3_rope_factors(scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor for a Llama 3 config (divisors of the frequencies)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_from_hf_folder(folder, path):
    """Convert a small Hugging Face folder to GGUF the way llama.cpp's converter lays it out."""
    config = json.loads((folder / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = read_safetensors_folder(folder)
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    out = []
    for name, tensor in tensors.items():
        array = tensor.numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            gguf_name = f"blk.{layer}.{layer_names[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                array = llama_cpp_permute(array, heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                array = llama_cpp_permute(array, kv_heads)
        out.append((gguf_name, np.ascontiguousarray(array), Q.F32))
    rope = config.get("rope_parameters") or {}
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if rope.get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", llama3_rope_factors(rope, head_dim, theta), Q.F32))

    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    token_list = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    metadata = dict(block_count=config["num_hidden_layers"],
                    context_length=config["max_position_embeddings"],
                    embedding_length=config["hidden_size"],
                    feed_forward_length=config["intermediate_size"],
                    head_count=heads, head_count_kv=kv_heads, rms_norm_eps=config["rms_norm_eps"],
                    rope_theta=theta, vocab_size=config["vocab_size"])
    tokens = dict(tokens=token_list, merges=merges,
                  types=[3 if t in special else 1 for t in token_list], eos=vocab["<|im_end|>"],
                  chat_template=json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])
    return write_gguf(path, arch, out, metadata=metadata, tokens=tokens)


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])
def test_gguf_conversion_of_a_model_runs_the_same_math_as_its_safetensors(
        tiny_model_dir, paged_runner, arch, tmp_path):
    """Q/K un-permuted for Llama (not Qwen2), biases kept, Llama 3 frequencies from rope_freqs."""
    folder = tiny_model_dir(arch)
    from_folder = load_model(folder)
    from_gguf = load_model(gguf_from_hf_folder(folder, tmp_path / f"{arch}.gguf"))
    assert from_gguf.config.tie_word_embeddings == from_folder.config.tie_word_embeddings
    assert from_gguf.config.attention_bias == from_folder.config.attention_bias
    text = "Hello there! The quick brown fox."
    assert from_gguf.tokenizer.encode(text) == from_folder.tokenizer.encode(text)
    tokens = from_folder.tokenizer.encode(text * 3)
    logits = []
    for loaded in (from_folder, from_gguf):
        runner = paged_runner(loaded.model)
        s = runner.add()
        logits.append(runner.step({s: tokens})[s])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_bundled_gguf_config(bundled_model_fp32):
    cfg = bundled_model_fp32.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size) == ("llama", 30, 576, 9, 3, 64, 49152)
    assert cfg.rope_theta == 100000.0
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert 2 in cfg.eos_token_ids  # <|im_end|>


def test_truncated_gguf_is_a_weights_error_naming_the_file(bundled_path, tmp_path):
    # Cut inside the header, and inside the tensor data (past the 1-2 MB of metadata).
    for size in (64, 3_000_000):
        broken = tmp_path / f"cut-{size}.gguf"
        with open(bundled_path, "rb") as whole:
            broken.write_bytes(whole.read(size))
        with pytest.raises(WeightsError, match=broken.name):
            load_model(broken)


def test_garbage_file_is_a_weights_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not a model " * 50)
    with pytest.raises(WeightsError, match="junk.gguf"):
        load_model(junk)


def test_unknown_gguf_architecture_is_unsupported(tmp_path):
    path = write_gguf(tmp_path / "mamba.gguf", "mamba",
                      [("token_embd.weight", np.zeros((4, 256), np.float32), Q.F32)])
    with pytest.raises(UnsupportedModelError, match="mamba"):
        load_model(path)


def test_unknown_hf_architecture_is_unsupported(tiny_model_dir, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(folder)


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "missing"
    shutil.copytree(tiny_model_dir("llama"), folder)
    tensors = read_safetensors_folder(folder)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    (folder / "model.safetensors").unlink()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(folder)


def test_truncated_safetensors_is_a_weights_error(tiny_model_dir, tmp_path):
    folder = tmp_path / "cut"
    shutil.copytree(tiny_model_dir("qwen2"), folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="model.safetensors"):
        load_model(folder)


def test_missing_path_and_non_model_file(tmp_path):
    with pytest.raises(WeightsError, match="no model"):
        load_model(tmp_path / "nothing-here")
    text = tmp_path / "notes.txt"
    text.write_text("hi")
    with pytest.raises(WeightsError, match="notes.txt"):
        load_model(text)


def test_hf_config_variants():
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    # transformers 4 layout: rope_theta and rope_scaling at the top level.
    v4 = ModelConfig.from_hf_config({**base, "model_type": "llama", "rope_theta": 500000.0,
                                     "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert v4.rope_theta == 500000.0 and v4.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # Mistral: a Llama whose sliding window caps the context we serve.
    mistral = ModelConfig.from_hf_config({**base, "model_type": "mistral", "sliding_window": 64,
                                          "max_position_embeddings": 4096})
    assert mistral.architecture == "llama" and mistral.max_position_embeddings == 64
    qwen = ModelConfig.from_hf_config({**base, "model_type": "qwen2"},
                                      generation_config={"eos_token_id": [5, 6]})
    assert qwen.attention_bias and qwen.eos_token_ids == (5, 6)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_config({**base, "model_type": "llama",
                                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="gelu"):
        ModelConfig.from_hf_config({**base, "model_type": "llama", "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="multiple"):
        ModelConfig.from_hf_config({**base, "model_type": "llama", "num_key_value_heads": 3})
