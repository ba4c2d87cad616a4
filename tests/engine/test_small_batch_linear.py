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
    ((2, 64), (32, 64), (torch.float32,) * 2, "bfloat16 or float16"),
    ((2, 64), (32, 64), (torch.bfloat16, torch.float16), "one dtype"),
])
def test_kernel_refuses_what_it_cannot_compute(x_shape, w_shape, dtypes, message):
    x = torch.zeros(x_shape, dtype=dtypes[0])
    w = torch.zeros(w_shape, dtype=dtypes[1])
    with pytest.raises(ValueError, match=message):
        small_batch_linear.small_batch_linear(x, w)


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
                        lambda x, w, b, config: calls.append((x.shape[0], config)) or F.linear(x, w, b))
    linear = SmallBatchLinear()
    config = TileConfig(16, 64, 4, 2)
    linear.choices[(32, 64, torch.float32)] = ShapeChoice(config=config, max_rows=4)
    w, other = torch.randn(32, 64), torch.randn(48, 64)
    for rows in (1, 4, 5):
        x = torch.randn(rows, 64)
        assert torch.allclose(linear(x, w), F.linear(x, w))
    linear(torch.randn(1, 64), other)  # a shape tune did not choose: cuBLAS
    assert calls == [(1, config), (4, config)]
    assert linear.report()["shapes"]["32x64"]["max_rows"] == 4


def test_tuning_skips_weights_off_the_gpu():
    linear = SmallBatchLinear()
    linear.tune([[(torch.randn(32, 64, dtype=torch.bfloat16), None)]])
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
    constants = {"K": 4096, "HAS_BIAS": True, "EVEN_K": True, "BLOCK_M": MAX_ROWS, "INTERPRETED": False,
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


@needs_cuda
@pytest.mark.gpu
def test_tuning_on_a_gpu_routes_to_the_faster_and_keeps_results():
    torch.manual_seed(0)
    layers = [[(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02, None)]
              for _ in range(8)]
    linear = SmallBatchLinear()
    linear.tune(layers)
    choice = linear.choices[(4096, 4096, torch.bfloat16)]
    timings = choice.timings
    assert set(timings) <= {1, 2, 4, 8, 16} and 1 in timings
    for rows in (1, 2, 4, 8, 16):
        if rows <= choice.max_rows:
            assert timings[rows]["kernel_s"] < timings[rows]["cublas_s"]
    assert (choice.config is None) == (choice.max_rows == 0)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    w = layers[0][0][0]
    assert relative_error(linear(x, w), reference(x, w)) < 8e-3
