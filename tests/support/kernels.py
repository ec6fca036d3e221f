"""Test support: import a Triton kernel module so that it runs on the interpreter without CUDA."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch


def import_kernel_module(name: str, kernel_attr: str) -> ModuleType:
    """Imports ``name``; without CUDA its ``@triton.jit`` functions must be interpreted.

    NOTE: triton reads TRITON_INTERPRET when a function is decorated (module import) and again
    while interpreting. It is set for this import only (tests set it again while they run, see
    tests/kernels/conftest.py), then restored, so it does not leak into other test modules or the
    subprocesses they start (the engine tests run the torch path anyway).
    """
    if torch.cuda.is_available():
        return importlib.import_module(name)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module(name)
        if type(getattr(module, kernel_attr)).__name__ != "InterpretedFunction":
            module = importlib.reload(sys.modules[name])  # imported earlier without the interpreter
        return module
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
