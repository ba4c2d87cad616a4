"""The C elementwise ops of a bfloat16 model on the CPU, against the plain PyTorch ops they replace."""

from __future__ import annotations

import pytest
import torch

from workers.engine.attention import cpu_native
from workers.engine.cpu_ops import CpuOps
from workers.engine.model import TorchOps, ops_for

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs a C compiler")

# 7 rows: the serial path; 300 rows of 576: enough elements for the threads.
ROWS = [7, 300]


def bf16(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def assert_within_one_rounding(got, expected):
    """Equal but for the last bit of bfloat16 here and there (a different float32 sum order)."""
    assert got.dtype == expected.dtype == torch.bfloat16
    differ = got != expected
    assert differ.float().mean() < 0.01
    ulp = expected.float().abs() * 2 ** -7 + 1e-30
    assert ((got.float() - expected.float()).abs() <= ulp).all()


def test_the_cpu_uses_them():
    assert ops_for("cpu") is CpuOps


@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_updates_the_residual_exactly_and_normalises_it(rows):
    x, residual, weight = bf16(rows, 576, seed=1), bf16(rows, 576, seed=2, scale=4), bf16(576, seed=3)
    expected, expected_residual = TorchOps.add_rms_norm(x, residual.clone(), weight, 1e-5)
    got, got_residual = CpuOps.add_rms_norm(x, residual, weight, 1e-5)
    assert got_residual is residual  # in place, like the CUDA path's kernel
    assert torch.equal(got_residual, expected_residual)
    assert_within_one_rounding(got, expected)


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm(rows):
    x, weight = bf16(rows, 576, seed=4, scale=3), bf16(576, seed=5)
    assert_within_one_rounding(CpuOps.rms_norm(x, weight, 1e-6), TorchOps.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("tokens", [5, 130])
def test_rope_rotates_q_and_k_in_place_with_the_same_roundings(tokens):
    qkv = bf16(tokens, 15, 64, seed=6, scale=2)
    qk = qkv[:, :12]  # q and k heads of a fused projection: not contiguous
    angles = bf16(tokens, 64, seed=7, scale=3).float()
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    expected = TorchOps.apply_rope(qk.clone(), cos, sin)
    v_before = qkv[:, 12:].clone()
    got = CpuOps.apply_rope(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()
    assert torch.equal(got, expected)
    assert torch.equal(qkv[:, 12:], v_before)  # v untouched


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul(rows):
    gate_up = bf16(rows, 2 * 1536, seed=8, scale=4)
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, 1e-3])  # the exp's range ends
    got = CpuOps.silu_and_mul(gate_up)
    assert_within_one_rounding(got, TorchOps.silu_and_mul(gate_up))


def test_float32_and_layouts_the_c_ops_do_not_read_go_to_pytorch():
    x, residual, weight = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    got, got_residual = CpuOps.add_rms_norm(x, residual, weight, 1e-5)
    expected, expected_residual = TorchOps.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(got, expected) and torch.equal(got_residual, expected_residual)
    strided = bf16(4, 128, seed=9)[:, ::2]
    assert torch.equal(CpuOps.silu_and_mul(strided), TorchOps.silu_and_mul(strided))
    assert torch.equal(CpuOps.rms_norm(strided, bf16(64, seed=10), 1e-5),
                       TorchOps.rms_norm(strided, bf16(64, seed=10), 1e-5))
