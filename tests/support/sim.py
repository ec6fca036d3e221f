"""`kvmesh simulate` as a user runs it: a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys


def simulate(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`kvmesh simulate ARGS` in a fresh interpreter (``env`` added to this one's), its output captured."""
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", "simulate", *args], capture_output=True, text=True,
                          timeout=170, env={**os.environ, **(env or {})})
