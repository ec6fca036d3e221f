"""Test helpers (in the tests, not the wheel)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Polls ``cond`` every 50 ms; raises AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def varint(n: int) -> bytes:
    """``n`` as a protobuf base-128 varint (hand-built wire bytes: invalid UTF-8 and oversized fields)."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def wire_field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field on the wire (string, bytes, message)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload



NANOBIND_LEAK_REPORT = re.compile(
    r"^(nanobind: leaked \d+ (instances|types|functions)!"
    r"|nanobind: this is likely caused by a reference counting issue"
    r"| - leaked (instance|type|function) "
    r"| - \.\.\. skipped remainder"
    r"|See https://nanobind\.readthedocs\.io/en/latest/refleaks\.html)")
"""The lines of nanobind's report of objects alive at interpreter exit (triton's extension prints one
after a test run; it is about triton's bindings, not kvmesh)."""


def filter_nanobind_leak_report(src: IO[str], dst: IO[str]) -> None:
    """Copies ``src`` to ``dst`` line by line, without nanobind's leak report; everything else passes."""
    for line in src:
        if not NANOBIND_LEAK_REPORT.match(line):
            dst.write(line)
            dst.flush()


def filter_own_stderr_at_exit() -> None:
    """From now on this process's stderr (fd 2) goes through :func:`filter_nanobind_leak_report` in a
    small child process, which writes to the original stderr until this process exits."""
    sys.stderr.flush()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tests.support import filter_nanobind_leak_report as f; "
                               "f(sys.stdin, sys.stderr)"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=os.dup(2), text=True)
    assert child.stdin is not None
    os.dup2(child.stdin.fileno(), 2)
    child.stdin.close()
