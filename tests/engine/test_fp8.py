"""FP8 weights: the quantization against bounds that follow from the e4m3 format, the FP8 matmul
against its dequantized reference and against the exact one, the model in FP8 against itself in
float32 (tiny models and the bundled one), and clear errors where FP8 cannot run.

e4m3 keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself (relatively); below
the smallest normal (2^-6) the spacing is 2^-9, so a value there rounds to within 2^-10. Values
are divided by their scale before rounding, so in original units an element ``v`` with scale
``s`` comes back within ``max(2^-4 |v|, 2^-10 s)``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from workers.engine import fp8
from workers.engine.accuracy import compare_logits, measure_fp8_accuracy, sequence_logits
from workers.engine.fp8 import Fp8Error, Fp8Weight
from workers.engine.loader import load_model
from workers.engine.model import LINEAR_WEIGHTS

HAS_CUDA = torch.cuda.is_available()
CPU_SCALED_MM = fp8._cpu_scaled_mm_works()
needs_cpu_scaled_mm = pytest.mark.skipif(
    not CPU_SCALED_MM, reason="this PyTorch has no torch._scaled_mm on CPU")


def rounding_bound(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per element, how far e4m3 rounding after dividing by ``scale`` may move ``values``."""
    return torch.maximum(2.0 ** -4 * values.abs(), 2.0 ** -10 * scale)


def spread_weight(out_features=48, in_features=80, seed=0) -> torch.Tensor:
    """Rows whose magnitudes span six orders, a zero row, and one large outlier."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    w *= torch.logspace(-3, 3, out_features)[:, None]
    w[5] = 0.0
    w[7, 3] = 1e4
    return w


# ------------------------------------------------------------------------------------------------
# Quantization
# ------------------------------------------------------------------------------------------------


def test_per_channel_quantization_is_within_the_format_bound_in_every_row():
    w = spread_weight()
    q = fp8.quantize_weight(w, per_channel=True)
    assert q.qweight.dtype == torch.float8_e4m3fn and q.qweight.shape == w.shape
    assert q.scale.dtype == torch.float32 and q.scale.shape == (w.shape[0],)
    assert q.per_channel

    magnitudes = q.qweight.float().abs().amax(dim=1)
    nonzero = w.abs().amax(dim=1) > 0
    # Each row's largest magnitude lands on e4m3's largest finite value, so the scale is that
    # row's own: rows a million times apart keep their relative precision.
    assert torch.all(magnitudes[nonzero] == fp8.FP8_MAX)
    torch.testing.assert_close(q.scale[nonzero], w.abs().amax(dim=1)[nonzero] / fp8.FP8_MAX)
    error = (q.dequantize() - w).abs()
    assert torch.all(error <= rounding_bound(w, q.scale[:, None]))
    small_row = 0  # magnitudes ~1e-3: still within 2^-4 relative
    assert torch.all(error[small_row] <= 2.0 ** -4 * w[small_row].abs() + 1e-12)


def test_zero_rows_quantize_to_zero_without_nan():
    q = fp8.quantize_weight(spread_weight(), per_channel=True)
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    assert torch.all(q.dequantize()[5] == 0)
    tensor_wise = fp8.quantize_weight(torch.zeros(16, 16), per_channel=False)
    assert torch.all(tensor_wise.dequantize() == 0)


def test_per_tensor_quantization_has_one_scale_and_the_same_bound():
    w = spread_weight()
    q = fp8.quantize_weight(w, per_channel=False)
    assert q.scale.shape == () and not q.per_channel
    assert q.scale == w.abs().max() / fp8.FP8_MAX
    assert q.qweight.float().abs().max() == fp8.FP8_MAX
    error = (q.dequantize() - w).abs()
    assert torch.all(error <= rounding_bound(w, q.scale))
    # With one scale for all, the smallest rows fall below e4m3's range (per-channel scales exist
    # for them): rows 0-4 lose far more than with their own scales.
    per_channel_error = (fp8.quantize_weight(w).dequantize() - w).abs()
    assert error[:5].sum() > 10 * per_channel_error[:5].sum()


def test_activations_are_scaled_per_token_or_per_tensor():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 40, generator=g) * torch.tensor([1e-2, 1, 3, 1e2, 0, 7])[:, None]
    q, scale = fp8.quantize_activation(x, per_token=True)
    assert scale.shape == (6, 1) and q.dtype == torch.float8_e4m3fn
    rows = q.float().abs().amax(dim=1)
    assert torch.all(rows[[0, 1, 2, 3, 5]] == fp8.FP8_MAX) and rows[4] == 0
    assert torch.all((q.float() * scale - x).abs() <= rounding_bound(x, scale))
    q, scale = fp8.quantize_activation(x, per_token=False)
    assert scale.shape == () and q.float().abs().max() == fp8.FP8_MAX
    assert torch.all((q.float() * scale - x).abs() <= rounding_bound(x, scale))


def test_quantize_weight_refuses_what_is_not_a_float_matrix():
    with pytest.raises(Fp8Error, match=r"must be \[out, in\]"):
        fp8.quantize_weight(torch.ones(4))
    with pytest.raises(Fp8Error, match="floating point"):
        fp8.quantize_weight(torch.ones(4, 4, dtype=torch.int32))


def test_fp8_weight_moves_with_its_module():
    holder = torch.nn.Module()
    holder.w = fp8.quantize_weight(spread_weight())
    assert set(dict(holder.named_buffers())) == {"w.qweight", "w.scale"}
    holder.to("meta")
    assert holder.w.qweight.device.type == holder.w.scale.device.type == "meta"
    assert holder.w.qweight.dtype == torch.float8_e4m3fn and holder.w.scale.dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# The FP8 matmul
# ------------------------------------------------------------------------------------------------


def exact_error_bound(x, w, weight: Fp8Weight):
    """|fp8 result - exact result| per output, from the rounding bounds ex, ew of each element
    of both operands: x'w' - xw = (x' - x)w' + x(w' - w), so sum_i ex(|w| + ew) + |x|ew; plus
    float32 slack for the division by the scale and the accumulation."""
    x_scale = (x.abs().amax(dim=1, keepdim=True) if weight.per_channel else x.abs().max())
    x_scale = x_scale / fp8.FP8_MAX
    w_scale = weight.scale[:, None] if weight.per_channel else weight.scale
    ex = rounding_bound(x, x_scale)
    ew = rounding_bound(w, w_scale)
    bound = ex @ (w.abs() + ew).T + x.abs() @ ew.T
    return bound + 1e-5 * (x.abs() @ w.abs().T)


@needs_cpu_scaled_mm
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_scaled_mm_linear_matches_the_dequantized_reference(per_channel, dtype, with_bias):
    g = torch.Generator().manual_seed(2)
    weight = fp8.quantize_weight(torch.randn(96, 64, generator=g), per_channel=per_channel)
    x = (torch.randn(13, 64, generator=g) * 3).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype) if with_bias else None
    actual = fp8.fp8_linear(x, weight, bias)
    expected = fp8.dequantized_linear(x, weight, bias)
    assert actual.dtype == dtype and actual.shape == (13, 96)
    # The same products; only the accumulation order (and the output rounding) may differ.
    tol = 1e-4 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
def test_fp8_linear_is_within_the_format_bound_of_the_exact_matmul(per_channel):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(80, 48, generator=g) * torch.logspace(-1, 1, 80)[:, None]
    x = torch.randn(9, 48, generator=g) * torch.logspace(-2, 2, 9)[:, None]
    weight = fp8.quantize_weight(w, per_channel=per_channel)
    linear = fp8.linear_for("cpu")
    error = (linear(x, weight) - F.linear(x, w)).abs()
    assert torch.all(error <= exact_error_bound(x, w, weight))
    assert error.max() > 0  # it did quantize


def test_fp8_linear_keeps_leading_dimensions_and_handles_no_rows():
    weight = fp8.quantize_weight(torch.randn(32, 16))
    linear = fp8.linear_for("cpu")
    assert linear(torch.randn(2, 3, 16), weight).shape == (2, 3, 32)
    assert linear(torch.randn(0, 16), weight).shape == (0, 32)
    with pytest.raises(Fp8Error, match="input has 15 features; the weight takes 16"):
        linear(torch.randn(2, 15), weight)


# ------------------------------------------------------------------------------------------------
# Where FP8 can run
# ------------------------------------------------------------------------------------------------


def test_support_rules():
    assert fp8.fp8_support_problem("cuda", torch.bfloat16, (9, 0)) is None  # Hopper
    assert fp8.fp8_support_problem("cuda", torch.bfloat16, (8, 9)) is None  # Ada
    assert fp8.fp8_support_problem("cpu", torch.float32) is None
    assert fp8.fp8_support_problem("cpu", torch.bfloat16) is None
    old = fp8.fp8_support_problem("cuda", torch.bfloat16, (8, 0), "NVIDIA A100")
    assert "compute capability 8.9" in old and "NVIDIA A100 is 8.0" in old
    assert "dtype=bfloat16, not float32" in fp8.fp8_support_problem("cuda", torch.float32, (9, 0))
    assert "no CUDA device" in fp8.fp8_support_problem("cuda", torch.bfloat16, None)
    assert "'mps'" in fp8.fp8_support_problem("mps", torch.float32)
    assert "float32, bfloat16 or float16" in fp8.fp8_support_problem("cpu", torch.float64)


def test_load_refuses_fp8_where_it_cannot_run_before_reading_weights(tmp_path):
    missing = tmp_path / "not-read"  # never read: the check comes first
    with pytest.raises(Fp8Error, match="choose one of fp8, fp8-per-tensor"):
        load_model(missing, quantization="int4")
    with pytest.raises(Fp8Error, match="float32, bfloat16 or float16"):
        load_model(missing, dtype=torch.float64, quantization="fp8")
    if not HAS_CUDA:
        with pytest.raises(Fp8Error, match="no CUDA device is available"):
            load_model(missing, dtype=torch.bfloat16, device="cuda", quantization="fp8")
    with pytest.raises(Fp8Error, match="bfloat16|compute capability|no CUDA"):
        load_model(missing, dtype=torch.float32, device="cuda", quantization="fp8")


def test_gpu_shapes_must_be_multiples_of_16():
    fp8.check_gpu_shape("w", (4096, 14336))
    with pytest.raises(Fp8Error, match=r"w has shape \(96, 40\); .* multiples of 16"):
        fp8.check_gpu_shape("w", (96, 40))


# ------------------------------------------------------------------------------------------------
# The model in FP8
# ------------------------------------------------------------------------------------------------


def tokens_for(config, n=48, seed=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the q/k/v bias beside FP8
@pytest.mark.parametrize("scheme", ["fp8", "fp8-per-tensor"])
def test_tiny_model_in_fp8_tracks_float32(tiny_model_dir, arch, scheme):
    folder = tiny_model_dir(arch)
    reference = load_model(folder)
    quantized = load_model(folder, quantization=scheme)
    model = quantized.model
    assert model.quantization == scheme
    for layer in model.layers:
        for name in LINEAR_WEIGHTS:
            weight = getattr(layer, name)
            assert isinstance(weight, Fp8Weight) and weight.qweight.dtype == torch.float8_e4m3fn
            assert weight.per_channel == (scheme == "fp8")
    # Embeddings, LM head and norms stay in the model dtype, which is what the engine reads.
    assert model.embed.dtype == model.lm_head.dtype == model.norm.dtype == torch.float32
    assert next(model.parameters()).dtype == torch.float32

    tokens = tokens_for(quantized.config)
    expected = sequence_logits(reference.model, tokens)
    actual = sequence_logits(model, tokens)
    bf16 = sequence_logits(load_model(folder, dtype=torch.bfloat16).model, tokens)
    # e4m3 keeps 3 mantissa bits to bfloat16's 7: rounding errors up to 2^4 times larger.
    fp8_error = (actual - expected).abs().mean()
    assert 0 < fp8_error < 2 ** 4 * (bf16 - expected).abs().mean()


def test_model_fp8_matmuls_equal_the_dequantized_reference(tiny_model_dir):
    quantized = load_model(tiny_model_dir("qwen2"), quantization="fp8")
    tokens = tokens_for(quantized.config)
    actual = sequence_logits(quantized.model, tokens)
    quantized.model.linear = fp8.dequantized_linear
    expected = sequence_logits(quantized.model, tokens)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_quantizing_twice_is_refused(tiny_model_dir):
    model = load_model(tiny_model_dir("llama"), quantization="fp8").model
    with pytest.raises(ValueError, match="already quantized"):
        model.quantize_weights("fp8")


def test_measure_fp8_accuracy_reports_the_comparison(tiny_model_dir):
    report = measure_fp8_accuracy(tiny_model_dir("llama"), scheme="fp8-per-tensor")
    assert report["scheme"] == "fp8-per-tensor"
    assert report["reference_dtype"] == "float32" and report["device"] == "cpu"
    assert report["num_tokens"] > 50
    assert 0 < report["mean_abs_logit_error"] <= report["max_abs_logit_error"]
    assert 0 <= report["top1_agreement"] <= 1
    assert report["perplexity_reference"] > 1 and report["perplexity_variant"] > 1


def test_perplexity_of_a_certain_model_is_one_and_of_a_uniform_one_is_the_vocabulary():
    tokens = [3, 1, 4, 1, 5]
    certain = torch.full((5, 8), -1e4)
    certain[torch.arange(4), torch.tensor(tokens[1:])] = 0.0
    comparison = compare_logits(certain, torch.zeros(5, 8), tokens)
    assert comparison.perplexity_reference == pytest.approx(1.0)
    assert comparison.perplexity_variant == pytest.approx(8.0)
    assert comparison.top1_agreement == pytest.approx(0.2, abs=0.2)


@pytest.fixture(scope="module")
def bundled_text_tokens(bundled_model_fp32):
    from workers.engine.accuracy import FIXED_TEXT

    return bundled_model_fp32.tokenizer.encode(FIXED_TEXT)


def test_bundled_model_in_fp8_stays_close_to_float32(bundled_path, bundled_model_fp32,
                                                    bundled_text_tokens):
    """FP8 keeps 3 mantissa bits to bfloat16's 7, so its rounding errors are up to 2^4 times
    bfloat16's: its logit error against float32 must stay within 2^4 times the bfloat16 model's,
    measured here on the same text."""
    tokens = bundled_text_tokens
    reference = sequence_logits(bundled_model_fp32.model, tokens)
    bf16 = sequence_logits(load_model(bundled_path, dtype=torch.bfloat16).model, tokens)
    fp8_model = load_model(bundled_path, quantization="fp8").model
    quantized = sequence_logits(fp8_model, tokens)

    bf16_error = compare_logits(reference, bf16, tokens)
    fp8_error = compare_logits(reference, quantized, tokens)
    assert 0 < fp8_error.mean_abs_logit_error < 2 ** 4 * bf16_error.mean_abs_logit_error
    # The text stays about as predictable: within 10% perplexity, most top tokens the same.
    ratio = fp8_error.perplexity_variant / fp8_error.perplexity_reference
    assert math.isfinite(ratio) and abs(ratio - 1) < 0.10
    assert fp8_error.top1_agreement > 0.8


# ------------------------------------------------------------------------------------------------
# On a GPU that has FP8 (compute capability 8.9+)
# ------------------------------------------------------------------------------------------------

HAS_FP8_GPU = HAS_CUDA and torch.cuda.get_device_capability() >= fp8.MIN_CUDA_CAPABILITY
needs_fp8_gpu = pytest.mark.skipif(not HAS_FP8_GPU,
                                   reason="needs an NVIDIA GPU of compute capability 8.9+")


@needs_fp8_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
# One row, a decode batch (both take the few-rows path), and more rows than it takes.
@pytest.mark.parametrize("rows", [1, 37, fp8.FEW_ROWS + 1])
def test_gpu_scaled_mm_matches_the_dequantized_reference(per_channel, rows):
    g = torch.Generator().manual_seed(5 + rows)
    weight = fp8.quantize_weight(torch.randn(256, 512, generator=g), per_channel=per_channel).cuda()
    x = torch.randn(rows, 512, generator=g).to(torch.bfloat16).cuda()
    bias = torch.randn(256, generator=g).to(torch.bfloat16).cuda()
    actual = fp8.fp8_linear(x, weight, bias).float()
    expected = fp8.dequantized_linear(x, weight, bias).float()
    # Both round a float32 sum to bfloat16 (2^-8 relative at most) after adding in a different
    # order; where terms cancel, that order moves the result by a small fraction of the terms'
    # size, which the output's RMS stands for.
    rms = expected.pow(2).mean().sqrt().item()
    torch.testing.assert_close(actual, expected, rtol=2.0 ** -7, atol=2.0 ** -7 * rms)


@needs_fp8_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("per_token", [True, False], ids=["per-token", "per-tensor"])
@pytest.mark.parametrize("rows,width", [(1, 4096), (37, 512), (6, 14336)])
def test_gpu_fused_activation_quantization_equals_the_pytorch_ops(per_token, rows, width):
    g = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    if rows > 2:
        x[1] = 0.0
    x = x.to(torch.bfloat16).cuda()
    q, scale = fp8.quantize_activation(x, per_token=per_token)
    q_ref, scale_ref = fp8.quantize_activation_reference(x, per_token=per_token)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == scale_ref.shape
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())
    empty, empty_scale = fp8.quantize_activation(x[:0], per_token=per_token)
    assert empty.shape == (0, width)
    assert empty_scale.shape == ((0, 1) if per_token else ())


@needs_fp8_gpu
@pytest.mark.gpu
def test_gpu_model_in_fp8_tracks_bfloat16(tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    reference = load_model(folder, dtype=torch.float32, device="cuda")
    bf16 = load_model(folder, dtype=torch.bfloat16, device="cuda")
    quantized = load_model(folder, dtype=torch.bfloat16, device="cuda", quantization="fp8")
    assert quantized.model.layers[0].qkv_proj.qweight.is_cuda
    tokens = tokens_for(quantized.config)
    expected = sequence_logits(reference.model, tokens)
    fp8_error = (sequence_logits(quantized.model, tokens) - expected).abs().mean()
    bf16_error = (sequence_logits(bf16.model, tokens) - expected).abs().mean()
    # As on CPU: e4m3 keeps 3 mantissa bits to bfloat16's 7.
    assert 0 < fp8_error < 2 ** 4 * bf16_error


def test_engine_loads_fp8_weights_when_asked(tiny_model_dir):
    from workers.engine import Engine, SamplingParams

    folder = tiny_model_dir("qwen2")
    with Engine(folder, device="cpu", dtype="float32", quantization="fp8",
                num_kv_blocks=64) as engine:
        assert engine.loaded.model.quantization == "fp8"
        result = engine.generate("Hello", SamplingParams(max_tokens=4, temperature=0,
                                                         ignore_eos=True), timeout=60)
        assert result.completion_tokens == 4
    plain = load_model(folder)
    with pytest.raises(ValueError, match="quantization is None, not fp8"):
        Engine(plain, quantization="fp8")


def test_gpu_shape_check_comes_before_any_weight_is_quantized(tiny_model_dir):
    # An MLP 40 wide: the down projection's inner side is not a multiple of 16.
    model = load_model(tiny_model_dir("llama", intermediate_size=40)).model
    with pytest.raises(Fp8Error, match=r"down_proj has shape \(64, 40\)"):
        model.quantize_weights("fp8", device="cuda")
    assert model.quantization is None
    assert all(isinstance(layer.qkv_proj, torch.nn.Parameter) for layer in model.layers)
