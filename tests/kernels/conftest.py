"""Kernel tests run the Triton kernels on the interpreter when there is no CUDA."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def interpreter_env():
    """TRITON_INTERPRET=1 while a module's tests run (triton reads it while interpreting)."""
    if torch.cuda.is_available():
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield
