"""Copies of our Triton modules whose kernels run in Triton's CPU interpreter, and the
``target`` fixture that runs a kernel test both there and, where there is one, on a GPU.

Triton decides between compiling and interpreting when ``@triton.jit`` decorates a kernel, so a
module imported with ``TRITON_INTERPRET=1`` set (for that import only) holds interpreted kernels
while the rest of the process, and the original module, keep whatever mode they had.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs an NVIDIA GPU with CUDA; on CPU the interpreter tests cover the kernels")


@dataclass
class Target:
    kernels: ModuleType  # the module: its interpreted copy, or the compiled original
    device: str  # where the test's tensors live: "cpu" for the interpreter, else "cuda"


def kernel_targets(module: ModuleType):
    """A module-scoped ``target`` fixture: the interpreted copy of ``module`` on CPU tensors,
    and ``module`` itself on CUDA where a GPU is present (skipped with the reason otherwise)."""

    @pytest.fixture(scope="module", params=[
        "interpreter", pytest.param("cuda", marks=[needs_cuda, pytest.mark.gpu])])
    def target(request) -> Target:
        if request.param == "interpreter":
            return Target(import_interpreted(module), "cpu")
        return Target(module, "cuda")

    return target


def import_interpreted(module: ModuleType) -> ModuleType:
    """A private copy of ``module`` (cached) with interpreted kernels."""
    name = f"_{module.__name__.rsplit('.', 1)[-1]}_interpreted"
    if name in sys.modules:
        return sys.modules[name]
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location(name, module.__file__)
        copy = importlib.util.module_from_spec(spec)
        sys.modules[name] = copy
        spec.loader.exec_module(copy)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return copy
