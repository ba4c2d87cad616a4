"""``import_interpreted``: a copy of a Triton module whose kernels run in the interpreter, made
without changing the mode of the process or of the original module."""

from __future__ import annotations

import os
import sys

import pytest
import triton

from tests.engine.interpreted import import_interpreted
from workers.engine import fused_kernels
from workers.engine.attention import triton_kernels


@pytest.mark.parametrize("module,kernel", [(triton_kernels, "_paged_decode_kernel"),
                                           (fused_kernels, "_rms_norm_kernel")],
                         ids=["triton_kernels", "fused_kernels"])
def test_interpreter_copy_leaves_the_process_mode_alone(monkeypatch, module, kernel):
    before = os.environ.get("TRITON_INTERPRET")
    name = f"_{module.__name__.rsplit('.', 1)[-1]}_interpreted"
    monkeypatch.delitem(sys.modules, name, raising=False)
    interpreted = import_interpreted(module)
    assert type(getattr(interpreted, kernel)).__name__ == "InterpretedFunction"
    assert type(getattr(module, kernel)).__name__ != "InterpretedFunction" or before == "1"
    assert interpreted._INTERPRETED and module._INTERPRETED == (before == "1")
    assert os.environ.get("TRITON_INTERPRET") == before
    assert triton.knobs.runtime.interpret == (before == "1")
