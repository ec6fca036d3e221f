"""Keeps a CPU worker's activation buffers in the process heap (glibc malloc settings).

Every step allocates and frees activations of megabytes (``[tokens, hidden]`` per op; a 2048-token
step's MLP output is 12 MiB). glibc serves an allocation above ``M_MMAP_THRESHOLD`` (128 KiB at
start, adapting upwards) with a fresh ``mmap`` and gives it back with ``munmap``, and trims the
heap top above ``M_TRIM_THRESHOLD``: either way the next op touches new pages and pays a page fault
per 4 KiB. Profiled on CPU, RMSNorm over 2048 x 256 took 3.5 ms with the defaults and 0.3 ms with
the buffers kept, and a prefill step spent ~20 % of its time so (docs/engine.md, "CPU profile").
vLLM's CPU guide asks for tcmalloc in ``LD_PRELOAD`` for the same reason; these two settings do it
without a second allocator.

The cost: memory a step freed stays with the process (its peak activation size) instead of going
back to the OS between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""glibc's ceiling for ``M_MMAP_THRESHOLD`` on 64-bit (``4 * 1024 * 1024 * sizeof(long)``): larger
blocks (a KV cache, a long prompt's attention mask) are still mapped, and they are allocated
rarely."""
TRIM_THRESHOLD = 2**31 - 1
"""The largest value ``mallopt`` takes (an int): the heap top is trimmed only past 2 GiB free."""

_ENV_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_done: bool | None = None


def keep_freed_buffers() -> bool:
    """Applies the settings once per process; True when glibc took them.

    A no-op (False) off glibc (macOS, musl) and when the user set glibc's own environment variables
    for them, which win.
    """
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux") or any(v in os.environ for v in _ENV_VARS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # NOTE: setting either threshold also turns off glibc's dynamic threshold adjustment.
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    log.debug("glibc malloc: mmap threshold %d, trim threshold %d: %s", MMAP_THRESHOLD, TRIM_THRESHOLD, ok)
    _done = ok
    return ok
