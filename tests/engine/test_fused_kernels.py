"""The fused Triton kernels against the model's plain PyTorch ops (``TorchOps``), their reference.

On CPU the kernels run in Triton's interpreter from a private copy of ``fused_kernels`` imported
with ``TRITON_INTERPRET=1`` set for that import only (the rest of the process keeps its mode).
With a CUDA GPU the same cases also run compiled.

The kernels repeat the reference's rounding steps, so where the reference does the same float
operations (the residual add, RoPE) the results must be identical; RMSNorm's sum and SiLU's exp
may differ in order or implementation, so there 16-bit results must agree to within two roundings
of the dtype (the normalised value's rounding may flip, then the product is rounded), float32 ones
to within 2^-17 relative (a GPU's rsqrt and exp are approximate).
"""

from __future__ import annotations


import pytest
import torch
import triton

from tests.engine.interpreted import import_interpreted, kernel_targets, needs_cuda
from workers.engine import fused_kernels
from workers.engine.accuracy import sequence_logits
from workers.engine.fused_kernels import FusedKernelInputError
from workers.engine.loader import load_model
from workers.engine.model import TorchOps, ops_for, rope_tables


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# What RMSNorm and SiLU may differ by from the reference (relative): two roundings of a 16-bit
# dtype; 2^-17 in float32.
ROUNDING_TOLERANCE = {torch.float32: 2.0 ** -17, torch.bfloat16: 2.0 ** -6,
                      torch.float16: 2.0 ** -9}


target = kernel_targets(fused_kernels)


def randn(*shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)


def norm_weight(hidden, dtype, device, seed):
    return (1.0 + randn(hidden, dtype=torch.float32, device=device, seed=seed, scale=0.2)).to(dtype)


def assert_within_rounding(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = ROUNDING_TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------
# RMSNorm, with and without the residual add
# ------------------------------------------------------------------------------------------------

# (tokens, hidden): one token, a non-power-of-two hidden size, many tokens, a large hidden size.
NORM_SHAPES = [(1, 64), (7, 576), (3, 1000), (257, 128), (2, 4096)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", NORM_SHAPES)
def test_rms_norm_matches_reference(target, dtype, tokens, hidden):
    x = randn(tokens, hidden, dtype=dtype, device=target.device, seed=1, scale=3.0)
    weight = norm_weight(hidden, dtype, target.device, seed=2)
    before = x.clone()
    out = target.kernels.rms_norm(x, weight, 1e-5)
    assert_within_rounding(out, TorchOps.rms_norm(x, weight, 1e-5))
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", NORM_SHAPES)
def test_add_rms_norm_adds_in_place_and_normalises_the_sum(target, dtype, tokens, hidden):
    x = randn(tokens, hidden, dtype=dtype, device=target.device, seed=3)
    residual = randn(tokens, hidden, dtype=dtype, device=target.device, seed=4, scale=5.0)
    weight = norm_weight(hidden, dtype, target.device, seed=5)
    expected_out, expected_sum = TorchOps.add_rms_norm(x, residual.clone(), weight, 1e-6)

    out, new_residual = target.kernels.add_rms_norm(x, residual, weight, 1e-6)
    assert new_residual is residual  # updated in place
    assert torch.equal(residual, expected_sum)  # the same addition, rounded the same way
    assert_within_rounding(out, expected_out)


def test_rms_norm_reads_rows_by_their_stride(target):
    # Rows of a wider tensor (only the last dimension need be contiguous).
    wide = randn(5, 200, dtype=torch.float32, device=target.device, seed=6)
    x = wide[:, 30:130]
    weight = randn(100, dtype=torch.float32, device=target.device, seed=7)
    assert_within_rounding(target.kernels.rms_norm(x, weight, 1e-5),
                               TorchOps.rms_norm(x, weight, 1e-5))


# ------------------------------------------------------------------------------------------------
# Rotary embedding of q and k, in place
# ------------------------------------------------------------------------------------------------


def rope_rows(positions, head_dim, dtype, device, theta=10000.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cos, sin = rope_tables(inv_freq, int(positions.max()) + 1)
    return cos[positions].to(dtype).to(device), sin[positions].to(dtype).to(device)


# (tokens, q heads, kv heads, head_dim): GQA groups of 2, 3 and 8; head_dim 64, 128 and 80
# (whose half, 40, is not a power of two); one token and many.
ROPE_SHAPES = [(1, 4, 2, 64), (9, 9, 3, 64), (130, 8, 1, 128), (5, 6, 2, 80), (33, 32, 8, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", ROPE_SHAPES)
def test_rope_rotates_q_and_k_in_place_and_leaves_v(target, dtype, tokens, heads, kv_heads,
                                                     head_dim):
    # The fused qkv projection's output, viewed per head: q heads, then k heads, then v heads.
    qkv = randn(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype, device=target.device, seed=8)
    positions = torch.randint(0, 5000, (tokens,), generator=torch.Generator().manual_seed(9))
    cos, sin = rope_rows(positions, head_dim, dtype, target.device)
    qk = qkv[:, : heads + kv_heads]
    expected = TorchOps.apply_rope(qk, cos, sin)
    v_before = qkv[:, heads + kv_heads:].clone()

    returned = target.kernels.apply_rope(qk, cos, sin)
    assert returned.data_ptr() == qk.data_ptr()
    assert torch.equal(qkv[:, : heads + kv_heads], expected)
    assert torch.equal(qkv[:, heads + kv_heads:], v_before)


def test_rope_at_position_zero_is_the_identity(target):
    qk = randn(3, 6, 64, dtype=torch.float32, device=target.device, seed=10)
    before = qk.clone()
    cos, sin = rope_rows(torch.zeros(3, dtype=torch.int64), 64, torch.float32, target.device)
    target.kernels.apply_rope(qk, cos, sin)
    assert torch.equal(qk, before)


# ------------------------------------------------------------------------------------------------
# SiLU and multiply
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,size", [(1, 64), (5, 300), (257, 96), (2, 1536), (3, 2500)])
def test_silu_and_mul_matches_reference(target, dtype, tokens, size):
    gate_up = randn(tokens, 2 * size, dtype=dtype, device=target.device, seed=11, scale=4.0)
    out = target.kernels.silu_and_mul(gate_up)
    assert out.shape == (tokens, size)
    assert_within_rounding(out, TorchOps.silu_and_mul(gate_up))


# The interpreter runs on numpy, which warns where a GPU silently overflows exp(1000) to inf.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_silu_saturates_without_nan_for_large_gates(target):
    gate = torch.tensor([[-1000.0, -90.0, 0.0, 90.0, 1000.0]], device=target.device)
    up = torch.full_like(gate, 2.0)
    out = target.kernels.silu_and_mul(torch.cat([gate, up], dim=1))
    torch.testing.assert_close(out, TorchOps.silu_and_mul(torch.cat([gate, up], dim=1)))


# ------------------------------------------------------------------------------------------------
# Edge cases and bad input
# ------------------------------------------------------------------------------------------------


def test_no_tokens_launches_nothing(target):
    kernels = target.kernels
    empty = torch.empty(0, 64, device=target.device)
    weight = torch.ones(64, device=target.device)
    assert kernels.rms_norm(empty, weight, 1e-5).shape == (0, 64)
    out, residual = kernels.add_rms_norm(empty, empty.clone(), weight, 1e-5)
    assert out.shape == residual.shape == (0, 64)
    assert kernels.silu_and_mul(torch.empty(0, 128, device=target.device)).shape == (0, 64)
    qk = torch.empty(0, 4, 64, device=target.device)
    assert kernels.apply_rope(qk, torch.empty(0, 64, device=target.device),
                              torch.empty(0, 64, device=target.device)) is qk


def test_bad_input_is_refused_with_a_clear_error():
    x = torch.randn(4, 64)
    weight = torch.ones(64)
    cases = [
        (lambda: fused_kernels.rms_norm(x[None], weight, 1e-5), "expected \\[tokens, features\\]"),
        (lambda: fused_kernels.rms_norm(x, torch.ones(63), 1e-5), "weight has shape \\(63,\\)"),
        (lambda: fused_kernels.rms_norm(x, weight.half(), 1e-5), "weight is torch.float16"),
        (lambda: fused_kernels.rms_norm(x.int(), weight, 1e-5), "dtype torch.int32"),
        (lambda: fused_kernels.rms_norm(x.t(), torch.ones(4), 1e-5), "contiguous in its last"),
        (lambda: fused_kernels.add_rms_norm(x, x[:3].clone(), weight, 1e-5),
         "residual is \\(3, 64\\)"),
        (lambda: fused_kernels.apply_rope(x, x, x), "expected \\[tokens, heads, head_dim\\]"),
        (lambda: fused_kernels.apply_rope(torch.randn(4, 2, 63), x, x), "even head_dim"),
        (lambda: fused_kernels.apply_rope(torch.randn(4, 2, 64), x[:3], x[:3]), "cos has shape"),
        (lambda: fused_kernels.apply_rope(torch.randn(4, 2, 64), x, x.double()),
         "sin is torch.float64"),
        (lambda: fused_kernels.silu_and_mul(torch.randn(4, 63)), "even number"),
    ]
    for call, message in cases:
        with pytest.raises(FusedKernelInputError, match=message):
            call()


# ------------------------------------------------------------------------------------------------
# Compiled for a GPU, without one
# ------------------------------------------------------------------------------------------------

def bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


# Each kernel's host wrapper called on Llama-3-8B-sized bfloat16 inputs (hidden 4096, 32 + 8
# heads of 128, intermediate 14336).
LAUNCHES = {
    "_rms_norm_kernel": lambda: fused_kernels.add_rms_norm(bf16(2, 4096), bf16(2, 4096),
                                                           bf16(4096), 1e-5),
    "_rope_kernel": lambda: fused_kernels.apply_rope(bf16(2, 48, 128)[:, :40], bf16(2, 128),
                                                     bf16(2, 128)),
    "_silu_and_mul_kernel": lambda: fused_kernels.silu_and_mul(bf16(2, 2 * 14336)),
}


class LaunchRecorder:
    """Stands in for a kernel: records the constants and options its wrapper launches it with."""

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        self.kwargs = kwargs


@pytest.mark.skipif("nvidia" not in triton.backends.backends, reason="Triton has no CUDA backend")
@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_kernels_compile_for_hopper_without_fma_and_with_round_to_nearest(monkeypatch, name):
    """Compiled ahead of time for compute capability 9.0 (no GPU needed) with the constants and
    options its wrapper launches it with: what the interpreter cannot check. Contraction is off
    (the kernels repeat PyTorch's separate roundings) and bfloat16 results are rounded to nearest
    even, as PyTorch rounds them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(fused_kernels, name)
    recorder = LaunchRecorder()
    monkeypatch.setattr(fused_kernels, name, recorder)
    LAUNCHES[name]()
    constants = {k: v for k, v in recorder.kwargs.items() if k in kernel.arg_names}
    options = {k: v for k, v in recorder.kwargs.items() if k not in kernel.arg_names}
    assert options["enable_fp_fusion"] is False
    signature = {}
    for arg in kernel.arg_names:
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = "*bf16"
        else:
            signature[arg] = "fp32" if arg == "eps" else "i32"
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    assert "fma." not in ptx
    assert "cvt.rn.bf16" in ptx


# ------------------------------------------------------------------------------------------------
# The model with the fused ops
# ------------------------------------------------------------------------------------------------


def test_the_ops_are_chosen_by_device(tiny_model_dir):
    from workers.engine.cpu_ops import CpuOps

    assert ops_for("cpu") is CpuOps  # C ops for bfloat16, TorchOps for anything else
    assert issubclass(CpuOps, TorchOps)
    assert ops_for("cuda") is fused_kernels
    assert ops_for(torch.device("cuda", 1)) is fused_kernels
    assert load_model(tiny_model_dir("llama")).model.ops is CpuOps


def run_mixed_steps(paged_runner, model, seed=0):
    """Logits of three sequences through prefill, a prefill chunk beside decodes, and decodes."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    sequences = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (21, 1, 9)]
    runner = paged_runner(model)
    a, b, c = (runner.add() for _ in sequences)
    outputs = [runner.step({a: sequences[0][:-2], b: sequences[1]}),
               runner.step({c: sequences[2], a: [sequences[0][-2]], b: [5]}),
               runner.step({a: [sequences[0][-1]], b: [6], c: [7]})]
    return torch.cat([logits for step in outputs for logits in step.values()])


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])
def test_model_with_fused_ops_matches_plain_ops(paged_runner, tiny_model_dir, arch):
    loaded = load_model(tiny_model_dir(arch), dtype=torch.float32)
    plain = run_mixed_steps(paged_runner, loaded.model)
    loaded.model.ops = import_interpreted(fused_kernels)
    fused = run_mixed_steps(paged_runner, loaded.model)
    # Only RMSNorm's sum order (and SiLU's exp) differ: float32 rounding, through two layers.
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)


def test_model_with_fused_ops_in_bfloat16_tracks_plain_ops(paged_runner, tiny_model_dir):
    loaded = load_model(tiny_model_dir("qwen2"), dtype=torch.bfloat16)
    plain = run_mixed_steps(paged_runner, loaded.model)
    loaded.model.ops = import_interpreted(fused_kernels)
    fused = run_mixed_steps(paged_runner, loaded.model)
    # A one-rounding difference in a norm can flip later bfloat16 roundings; it must stay at
    # the level of bfloat16's precision (2^-8 relative), far below the logits' spread.
    assert (fused - plain).abs().max() < 2.0 ** -5 * plain.abs().max()
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() > 0.95


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_model_on_cuda_uses_fused_ops_and_matches_plain_ops_and_cpu(tiny_model_dir, dtype):
    folder = tiny_model_dir("qwen2")
    gpu = load_model(folder, dtype=dtype, device="cuda")
    assert gpu.model.ops is fused_kernels
    tokens = torch.randint(0, gpu.config.vocab_size, (70,),
                           generator=torch.Generator().manual_seed(12)).tolist()
    fused = sequence_logits(gpu.model, tokens).cpu()
    gpu.model.ops = TorchOps
    plain = sequence_logits(gpu.model, tokens).cpu()
    on_cpu = sequence_logits(load_model(folder, dtype=dtype).model, tokens)
    scale = on_cpu.abs().max()
    if dtype == torch.float32:
        torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
    else:
        assert (fused - plain).abs().max() < 2.0 ** -5 * scale
    # Against CPU the matmuls and attention differ too (accumulation order).
    assert (fused - on_cpu).abs().max() < (1e-3 if dtype == torch.float32 else 0.05) * scale


# ------------------------------------------------------------------------------------------------
# The FP8 matmul's epilogue: both scales and the cast
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 1000), (3, 3000)])
def test_scale_rows_and_columns_matches_reference(target, dtype, rows, cols):
    y = randn(rows, cols, dtype=torch.float32, device=target.device, seed=7, scale=50.0)
    row_scale = randn(rows, 1, dtype=torch.float32, device=target.device, seed=8).abs()
    col_scale = randn(cols, dtype=torch.float32, device=target.device, seed=9).abs()
    out = target.kernels.scale_rows_and_columns(y, row_scale, col_scale, dtype)
    # One rounding to ``dtype`` of the float32 product, whichever order it was multiplied in.
    assert_within_rounding(out, (y * row_scale * col_scale).to(dtype))


def test_scale_rows_and_columns_refuses_scales_that_do_not_fit():
    y = torch.zeros(2, 8)
    with pytest.raises(FusedKernelInputError, match="do not fit"):
        fused_kernels.scale_rows_and_columns(y, torch.ones(3, 1), torch.ones(8), torch.bfloat16)
    with pytest.raises(FusedKernelInputError, match="float32"):
        fused_kernels.scale_rows_and_columns(y, torch.ones(2, 1).double(), torch.ones(8),
                                             torch.bfloat16)
