"""Latency objectives in the simulator (issue 51): the TTFT/TPOT objectives every request carries to its router
(``RouteQuery.objectives``, as llm-d's ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` headers would) and goodput, the
requests per second that met both.

``--objectives workload`` takes the workload's own (:func:`workload_objectives`), ``--objectives TTFT_MS:TPOT_MS``
sets them; without the flag requests carry none and a run's figures are as before (no goodput keys).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvmesh.replay.records import RequestRecord
from kvmesh.router.core.policies.base import NO_OBJECTIVES, Objectives

WORKLOAD = "workload"
TPOT_S = 0.05
"""The workloads' TPOT objective: 50 ms, ~2.5x a 64-sequence decode step at 4k context on the default cost model
(H100 roofline, Llama-3.1-8B: 21 ms; 256 sequences 61 ms): a worker that packs long prefill chunks beside its decodes
or runs a deep batch misses it."""
TTFT_PREFILL_X = 2.0
TTFT_FLOOR_S = 1.0


def parse_objectives(spec: str) -> Objectives | None:
    """``TTFT_MS:TPOT_MS`` -> Objectives; ``workload`` -> None (the workload's own); "" -> none.
    Raises ValueError naming the flag."""
    if not spec:
        return NO_OBJECTIVES
    if spec == WORKLOAD:
        return None
    t, sep, p = spec.partition(":")
    try:
        ttft_ms, tpot_ms = float(t), float(p)
    except ValueError:
        raise ValueError(f"--objectives takes 'workload' or TTFT_MS:TPOT_MS, e.g. 1000:50, got {spec!r}") from None
    if not sep or not (ttft_ms >= 0 and tpot_ms >= 0) or not (ttft_ms or tpot_ms):
        raise ValueError(f"--objectives takes TTFT_MS:TPOT_MS, each >= 0, not both 0, e.g. 1000:50, got {spec!r}")
    return Objectives(ttft_ms / 1000, tpot_ms / 1000)


def workload_objectives(prompt_lens: Sequence[int], cold_prefill_s) -> Objectives:
    """A workload's own objectives: TTFT twice the cold prefill of its 90th-percentile prompt on the fleet's slowest
    GPU, rounded up to 0.5 s, at least 1 s (a cache miss on an idle worker meets it with room; a prompt queued
    behind a few others' prefills does not); TPOT :data:`TPOT_S`."""
    p90 = int(np.percentile(np.asarray(prompt_lens), 90)) if len(prompt_lens) else 0
    ttft = max(TTFT_FLOOR_S, math.ceil(TTFT_PREFILL_X * cold_prefill_s(p90) * 2) / 2)
    return Objectives(ttft, TPOT_S)


def objectives_for(spec: str, prompt_lens: Sequence[int], cold_prefill_s) -> Objectives:
    """The run's objectives from ``--objectives``."""
    fixed = parse_objectives(spec)
    return workload_objectives(prompt_lens, cold_prefill_s) if fixed is None else fixed


def meets(rec: RequestRecord, objectives: Objectives) -> bool:
    """It finished and met both objectives (a request with one output token has no TPOT to miss)."""
    if rec.failed or rec.finish is None or rec.ttft is None:
        return False
    if objectives.ttft_s and rec.ttft > objectives.ttft_s:
        return False
    tpot = rec.tpot
    return not (objectives.tpot_s and tpot is not None and tpot > objectives.tpot_s)


def goodput(records: Sequence[RequestRecord], objectives: Objectives, span_s: float) -> dict:
    """The run's figures at its objectives: requests/s completed, requests/s meeting both objectives (goodput), the
    share that did, and the objectives (seconds)."""
    met = sum(1 for r in records if meets(r, objectives))
    done = sum(1 for r in records if r.success)
    return {"objectives": {"ttft_s": objectives.ttft_s, "tpot_s": objectives.tpot_s},
            "request_rps": done / span_s, "goodput_rps": met / span_s,
            "objectives_met": met / len(records) if records else 0.0}

