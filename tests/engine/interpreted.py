"""Copies of our Triton modules whose kernels run in Triton's CPU interpreter.

Triton decides between compiling and interpreting when ``@triton.jit`` decorates a kernel, so a
module imported with ``TRITON_INTERPRET=1`` set (for that import only) holds interpreted kernels
while the rest of the process, and the original module, keep whatever mode they had.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


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
