"""The simulated fleet: which GPU each worker is (`kvmesh simulate --workers 4xH100,4xA100`).

A fleet is written as comma-separated groups, each ``N`` (N workers of the default GPU,
``--sim-gpu``) or ``NxGPU`` (N workers of that GPU type, model_worker/simulated/step_time.py ``GPUS``, any
case). Workers are numbered in the order written: ``4xH100,4xA100`` is worker-000 .. worker-003 on
H100s and worker-004 .. worker-007 on A100s.
"""

from __future__ import annotations

from itertools import groupby

from kvmesh.model_worker.simulated.step_time import gpu_spec


def parse_fleet(spec: str, default_gpu: str) -> list[str]:
    """Each worker's GPU type (canonical names), in worker order; ValueError naming --workers."""
    gpus: list[str] = []
    for item in str(spec).split(","):
        item = item.strip()
        if not item:
            continue
        count, sep, gpu = item.lower().partition("x")
        try:
            n = int(count)
            name = gpu_spec(gpu if sep else default_gpu).name
        except ValueError as exc:
            raise ValueError(f"--workers takes N or NxGPU groups, comma-separated (e.g. 8 or 4xH100,4xA100), "
                             f"got {spec!r}: {exc}") from None
        if n < 1:
            raise ValueError(f"--workers: a group needs at least 1 worker, got {item!r}")
        gpus += [name] * n
    if not gpus:
        raise ValueError(f"--workers must name at least 1 worker, got {spec!r}")
    return gpus


def fleet_spec(gpus: list[str]) -> str:
    """The canonical spelling of a fleet: ``8xH100``, ``4xH100,4xA100``."""
    return ",".join(f"{len(list(run))}x{gpu}" for gpu, run in groupby(gpus))


def fleet_counts(gpus: list[str]) -> dict[str, int]:
    """Workers per GPU type, in order of first appearance."""
    out: dict[str, int] = {}
    for g in gpus:
        out[g] = out.get(g, 0) + 1
    return out
