"""bfloat16 CPU matmuls against weights packed for oneDNN: the same numbers as F.linear, and the
model uses them only where it should."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.engine import onednn
from workers.engine.loader import load_model

needs_onednn = pytest.mark.skipif(not onednn.available(),
                                  reason="this PyTorch build has no packed bfloat16 linear")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_weight_multiplies_exactly_like_f_linear(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator).bfloat16()
    weight = torch.randn(80, 96, generator=generator).bfloat16()
    bias = torch.randn(80, generator=generator).bfloat16() if with_bias else None
    # A non-contiguous input, as a slice of a wider activation would be.
    wide = torch.cat([x, x], dim=1)[:, :96]
    assert torch.equal(onednn.linear(wide, onednn.pack(weight), bias), F.linear(x, weight, bias))


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_a_bfloat16_cpu_model_is_packed_and_its_logits_do_not_change(
        arch, tiny_model_dir, paged_runner, monkeypatch):
    path = tiny_model_dir(arch)
    packed = load_model(path, dtype=torch.bfloat16).model
    monkeypatch.setattr(onednn, "available", lambda: False)
    plain = load_model(path, dtype=torch.bfloat16).model
    assert packed.linear is onednn.linear and plain.linear is F.linear
    monkeypatch.undo()
    assert not packed.pack_for_cpu()  # already packed: a second call changes nothing

    logits = []
    for model in (packed, plain):
        runner = paged_runner(model)
        seq = runner.add()
        prefill = runner.step({seq: list(range(3, 40))})[seq]
        decode = runner.step({seq: [5]})[seq]
        logits.append((prefill, decode))
    assert torch.equal(logits[0][0], logits[1][0]) and torch.equal(logits[0][1], logits[1][1])


def test_float32_models_keep_f_linear(tiny_model_dir):
    # float32 is held to transformers' numbers; a packed matmul would sum in another order.
    assert load_model(tiny_model_dir("llama"), dtype=torch.float32).model.linear is F.linear
