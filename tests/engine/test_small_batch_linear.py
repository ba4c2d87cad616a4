"""The small-batch matmul kernel against ``F.linear`` in float64 (in Triton's interpreter, and on
a GPU where there is one), its input checks, and the routing ``SmallBatchLinear`` does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from tests.engine.interpreted import kernel_targets, needs_cuda
from workers.engine import small_batch_linear
from workers.engine.small_batch_linear import (
    CANDIDATES, MAX_ROWS, ShapeChoice, SmallBatchLinear, TileConfig)

target = kernel_targets(small_batch_linear)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def reference(x, w, b=None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("rows,n,k,config,with_bias", [
    (1, 96, 256, TileConfig(32, 128, 4, 2), False),  # whole tiles
    (3, 80, 200, TileConfig(32, 64, 4, 2), True),  # ragged columns and K, a bias
    (MAX_ROWS, 48, 128, TileConfig(16, 128, 4, 2), True),  # every padded row used
], ids=["one-row", "ragged", "sixteen-rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_linear(target, rows, n, k, config, with_bias, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).to(target.device, dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(target.device, dtype)
    b = torch.randn(n, generator=gen).to(target.device, dtype) if with_bias else None
    out = target.kernels.small_batch_linear(x, w, b, config)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert torch.isfinite(out).all()
    # bfloat16 operands, float32 accumulation, one rounding of the result
    assert relative_error(out, reference(x, w, b)) < 8e-3


@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
def test_kernel_applies_weight_scales(target, per_channel):
    """The scaled form (what FP8 weights take): y = x @ (w * scale)^T + bias. The interpreter
    has no FP8, so there the values are bfloat16; on a GPU they are e4m3 too (below)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 200, generator=gen).to(target.device, torch.bfloat16)
    w = torch.randn(40, 200, generator=gen).to(target.device, torch.bfloat16)
    scale = (torch.rand(40 if per_channel else (), generator=gen) / 50 + 1e-3).to(target.device)
    b = torch.randn(40, generator=gen).to(target.device, torch.bfloat16)
    out = target.kernels.small_batch_linear(x, w, b, TileConfig(16, 64, 4, 2), scale=scale)
    scaled = w.double() * (scale.double()[:, None] if per_channel else scale.double())
    assert relative_error(out, reference(x, scaled, b)) < 8e-3


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("per_channel", [True, False], ids=["per-channel", "per-tensor"])
def test_kernel_multiplies_fp8_weights_by_their_scales(per_channel):
    from workers.engine import fp8

    torch.manual_seed(1)
    w = fp8.quantize_weight(torch.randn(96, 512) * 0.05, per_channel=per_channel).to("cuda")
    x = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
    out = small_batch_linear.small_batch_linear(x, w.qweight, None, TileConfig(32, 128, 4, 3),
                                                scale=w.scale)
    assert relative_error(out, reference(x, w.dequantize())) < 8e-3


def test_kernel_reads_strided_rows(target):
    """Rows of x one stride apart (a view into a wider tensor) are read as rows."""
    wide = torch.randn(4, 192).to(target.device, torch.bfloat16)
    x = wide[:, :128]
    w = torch.randn(64, 128).to(target.device, torch.bfloat16)
    out = target.kernels.small_batch_linear(x, w, None, TileConfig(16, 64, 4, 2))
    assert relative_error(out, reference(x, w)) < 8e-3


@pytest.mark.parametrize("x_shape,w_shape,dtypes,message", [
    ((MAX_ROWS + 1, 64), (32, 64), (torch.bfloat16,) * 2, "at most 16 rows"),
    ((2, 64), (32, 48), (torch.bfloat16,) * 2, "do not multiply"),
    ((2, 64), (32, 64), (torch.float32,) * 2, "bfloat16 or float16 x"),
    ((2, 64), (32, 64), (torch.bfloat16, torch.float16), "weight of x.s dtype"),
])
def test_kernel_refuses_what_it_cannot_compute(x_shape, w_shape, dtypes, message):
    x = torch.zeros(x_shape, dtype=dtypes[0])
    w = torch.zeros(w_shape, dtype=dtypes[1])
    with pytest.raises(ValueError, match=message):
        small_batch_linear.small_batch_linear(x, w)


def test_kernel_refuses_weights_of_another_dtype_without_scales_and_bad_scales():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="no scales"):
        small_batch_linear.small_batch_linear(x, w)
    with pytest.raises(ValueError, match="scales must be float32"):
        small_batch_linear.small_batch_linear(x, w, scale=torch.ones(31))


def test_kernel_refuses_a_bias_of_the_wrong_size():
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bias"):
        small_batch_linear.small_batch_linear(x, w, torch.zeros(31, dtype=torch.bfloat16))


def test_untuned_routing_is_f_linear():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert torch.equal(SmallBatchLinear()(x, w), F.linear(x, w))


def test_routing_sends_only_tuned_shapes_and_row_counts_to_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(small_batch_linear, "small_batch_linear",
                        lambda x, w, b, config, scale: calls.append((x.shape[0], config))
                        or F.linear(x, w, b))
    linear = SmallBatchLinear()
    config = TileConfig(16, 64, 4, 2)
    w, other = torch.randn(32, 64), torch.randn(48, 64)
    linear.choices[small_batch_linear._key(w)] = ShapeChoice(config=config, max_rows=4)
    for rows in (1, 4, 5):
        x = torch.randn(rows, 64)
        assert torch.allclose(linear(x, w), F.linear(x, w))
    linear(torch.randn(1, 64), other)  # a shape tune did not choose: cuBLAS
    linear(torch.randn(MAX_ROWS + 1, 64), w)  # more rows than the kernel takes: cuBLAS
    assert calls == [(1, config), (4, config)]
    assert linear.report()["shapes"]["32x64"]["max_rows"] == 4


def test_routing_hands_fp8_weights_to_the_kernel_as_values_and_scales(monkeypatch):
    from workers.engine import fp8

    calls = []
    monkeypatch.setattr(small_batch_linear, "small_batch_linear",
                        lambda x, w, b, config, scale: calls.append((w, scale))
                        or F.linear(x, w.float() * scale[:, None], b))
    fallback_calls = []
    linear = SmallBatchLinear(fallback=lambda x, w, b: fallback_calls.append(w) or x)
    weight = fp8.quantize_weight(torch.randn(32, 64))
    linear.choices[small_batch_linear._key(weight)] = ShapeChoice(TileConfig(16, 64, 4, 2), 2)
    linear(torch.randn(2, 64), weight)
    assert calls[0][0] is weight.qweight and calls[0][1] is weight.scale
    linear(torch.randn(3, 64), weight)  # more rows than tuned: the model's own FP8 matmul
    assert fallback_calls == [weight]
    assert "32x64 float8_e4m3fn scaled" in linear.report()["shapes"]


def test_tuning_keeps_the_fastest_fitting_candidate_up_to_the_row_count_it_wins(monkeypatch):
    """The decision alone, with the timings made up: a candidate this GPU cannot launch is
    skipped, the fastest of the rest is kept, and it serves row counts up to the first bucket
    where the fallback is as fast."""
    from triton.runtime.errors import OutOfResources

    too_big, slow, fast = TileConfig(64, 512, 8, 4), TileConfig(16, 128, 4, 2), \
        TileConfig(32, 128, 4, 2)
    kernel_s = {too_big: None, slow: 3.0, fast: 2.0}
    fallback_s = {1: 4.0, 2: 4.0, 4: 1.0}

    def fake_time(run, calls, replays):
        (name, config, rows), = run()  # one weight: one call
        if name == "fallback":
            return fallback_s.get(rows, 9.0)
        if kernel_s[config] is None:
            raise OutOfResources(300_000, 232_448, "shared memory")
        return kernel_s[config]

    monkeypatch.setattr(small_batch_linear, "_time_per_call", fake_time)
    monkeypatch.setattr(small_batch_linear, "small_batch_linear",
                        lambda x, w, b, config, scale: ("kernel", config, x.shape[0]))
    choice = small_batch_linear._tune_shape(
        [(torch.zeros(8, 16), None)], (too_big, slow, fast), 1, torch.float32,
        lambda x, w, b: ("fallback", None, x.shape[0]))
    assert choice.config == fast and choice.max_rows == 2
    assert set(choice.timings) == {1, 2, 4}  # stopped at the first bucket it lost
    none_fit = small_batch_linear._tune_shape(
        [(torch.zeros(8, 16), None)], (too_big,), 1, torch.float32,
        lambda x, w, b: ("fallback", None, x.shape[0]))
    assert none_fit.config is None and none_fit.max_rows == 0


def test_tuning_skips_weights_off_the_gpu():
    linear = SmallBatchLinear()
    linear.tune([[(torch.randn(32, 64, dtype=torch.bfloat16), None)]],
                activation_dtype=torch.bfloat16)
    assert linear.choices == {} and linear.tune_seconds is not None


def test_the_model_tunes_only_on_a_gpu(tiny_model_dir):
    from workers.engine.loader import load_model

    loaded = load_model(tiny_model_dir("llama"), dtype=torch.bfloat16, device="cpu")
    assert loaded.model.tune_small_batch_linear() is None
    assert not isinstance(loaded.model.linear, SmallBatchLinear)


@pytest.mark.skipif("nvidia" not in triton.backends.backends, reason="Triton has no CUDA backend")
@pytest.mark.parametrize("config", CANDIDATES, ids=lambda c: f"n{c.block_n}k{c.block_k}")
def test_candidates_compile_for_hopper(config):
    """Each candidate compiles for compute capability 9.0 (no GPU needed), with a matrix
    instruction for the dot and asynchronous copies feeding it: what the interpreter cannot
    check."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = small_batch_linear._small_batch_linear_kernel
    constants = {"K": 4096, "HAS_BIAS": True, "SCALES": 0, "EVEN_K": True, "BLOCK_M": MAX_ROWS, "INTERPRETED": False,
                 "BLOCK_N": config.block_n, "BLOCK_K": config.block_k}
    signature = {arg: "constexpr" if arg in constants else
                 "*bf16" if arg.endswith("_ptr") else "i32" for arg in kernel.arg_names}
    # What a launch tells Triton of pointers and sizes that are multiples of 16.
    aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(kernel.arg_names)
               if arg.endswith("_ptr") or arg in ("N", "stride_x", "stride_w", "stride_y")}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants,
                                        attrs=aligned),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps,
                                       "num_stages": config.num_stages})
    ptx = compiled.asm["ptx"]
    assert "mma" in ptx
    assert "cp.async" in ptx  # the weight tiles stream through the software pipeline


@pytest.mark.skipif("nvidia" not in triton.backends.backends, reason="Triton has no CUDA backend")
@pytest.mark.parametrize("scales", [1, 2], ids=["per-channel", "per-tensor"])
def test_fp8_weights_compile_for_hopper(scales):
    """The FP8 form compiles for compute capability 9.0: e4m3 loads widened to bfloat16 for
    the dot, the scales applied to the result."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = small_batch_linear._small_batch_linear_kernel
    config = CANDIDATES[0]
    constants = {"K": 4096, "HAS_BIAS": False, "SCALES": scales, "EVEN_K": True,
                 "BLOCK_M": MAX_ROWS, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
                 "INTERPRETED": False}
    types = {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    signature = {arg: "constexpr" if arg in constants else types.get(arg, "*bf16")
                 if arg.endswith("_ptr") else "i32" for arg in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps,
                                       "num_stages": config.num_stages})
    assert "mma" in compiled.asm["ptx"]


@needs_cuda
@pytest.mark.gpu
def test_tuning_on_a_gpu_routes_to_the_faster_and_keeps_results():
    torch.manual_seed(0)
    layers = [[(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02, None)]
              for _ in range(8)]
    linear = SmallBatchLinear()
    linear.tune(layers, activation_dtype=torch.bfloat16)
    choice = linear.choices[small_batch_linear._key(layers[0][0][0])]
    timings = choice.timings
    assert set(timings) <= {1, 2, 4, 8, 16} and 1 in timings
    for rows in (1, 2, 4, 8, 16):
        if rows <= choice.max_rows:
            assert timings[rows]["kernel_s"] < timings[rows]["fallback_s"]
    assert (choice.config is None) == (choice.max_rows == 0)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    w = layers[0][0][0]
    assert relative_error(linear(x, w), reference(x, w)) < 8e-3
