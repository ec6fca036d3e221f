"""The one place that decides which attention / KV-write implementation runs.

``resolve_attention_backend`` is a pure function of (device type, requested backend, interpreter
flag, triton importable) so it is testable without a GPU; ``attention_backend`` feeds it the
process environment:

* ``KVMESH_ATTENTION_BACKEND=auto`` (default): Triton on CUDA tensors, the torch reference on
  anything else (CPU, MPS, ...).
* ``KVMESH_ATTENTION_BACKEND=torch``: the torch reference everywhere.
* ``KVMESH_ATTENTION_BACKEND=triton``: Triton everywhere; a non-CUDA tensor then needs the
  Triton interpreter (``TRITON_INTERPRET=1`` set before triton is first imported).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

Backend = Literal["triton", "torch"]

BACKEND_ENV = "KVMESH_ATTENTION_BACKEND"
INTERPRET_ENV = "TRITON_INTERPRET"
_CHOICES = ("auto", "triton", "torch")


def resolve_attention_backend(
    device_type: str,
    requested: str = "auto",
    triton_interpret: bool = False,
    triton_available: bool = True,
) -> Backend:
    """Which implementation serves tensors on ``device_type``.

    Args:
        device_type: ``torch.device.type`` of the inputs ("cuda", "cpu", ...).
        requested: the value of ``KVMESH_ATTENTION_BACKEND``: auto | triton | torch (case-insensitive).
        triton_interpret: whether ``TRITON_INTERPRET`` is on.
        triton_available: whether the triton package can be imported.

    Returns:
        "triton" or "torch".

    Raises:
        ValueError: an unknown ``requested`` value, or "triton" where it cannot run.
    """
    choice = (requested or "auto").strip().lower()
    if choice not in _CHOICES:
        raise ValueError(f"{BACKEND_ENV}={requested!r}: expected one of {', '.join(_CHOICES)}")
    if choice == "torch":
        return "torch"
    if choice == "auto":
        # NOTE: auto never picks the interpreter: it is for tests, far too slow to serve with.
        return "triton" if device_type == "cuda" and triton_available else "torch"
    if not triton_available:
        raise ValueError(f"{BACKEND_ENV}=triton but the triton package is not installed")
    if device_type != "cuda" and not triton_interpret:
        raise ValueError(
            f"{BACKEND_ENV}=triton on a {device_type} tensor needs the Triton interpreter: set "
            f"{INTERPRET_ENV}=1 before triton is imported (or use {BACKEND_ENV}=auto|torch)"
        )
    return "triton"


@functools.lru_cache(maxsize=1)
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _env_flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=32)
def _resolve_cached(device_type: str, requested: str, interpret: str) -> Backend:
    return resolve_attention_backend(device_type, requested, _env_flag(interpret), _triton_available())


def attention_backend(device: torch.device | str) -> Backend:
    """The backend for tensors on ``device`` under the current environment (cached per inputs)."""
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    # NOTE: the env is read on every call (two dict lookups) and the decision cached on its
    # values, so changing the env (tests, monkeypatch) takes effect without a cache clear.
    return _resolve_cached(
        device_type, os.environ.get(BACKEND_ENV, "auto"), os.environ.get(INTERPRET_ENV, "")
    )


__all__ = ["BACKEND_ENV", "Backend", "attention_backend", "resolve_attention_backend"]
