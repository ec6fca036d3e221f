"""A request's latency objectives as the fronts receive them: llm-d's ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``
headers (the OpenAI API, the endpoint picker's gateway headers), the Generate request's ``slo_ttft_ms`` /
``slo_tpot_ms`` fields, and the router's ``--slo-ttft-ms`` / ``--slo-tpot-ms`` defaults for what a request
leaves unsaid (docs/router.md, "Latency objectives"). Milliseconds outside, seconds inside.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from kvmesh.contract.errors import InvalidArgument
from kvmesh.router.core.policies.base import Objectives

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
MAX_OBJECTIVE_MS = 3_600_000.0
"""An hour: a larger objective is a unit mistake, not an objective."""


def objective_ms(value: str | float, name: str) -> float:
    """One objective in milliseconds (0 = none); InvalidArgument naming ``name`` when it is not a number in
    [0, :data:`MAX_OBJECTIVE_MS`]."""
    try:
        ms = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name} must be a number of milliseconds, got {str(value)[:40]!r}") from None
    if not math.isfinite(ms) or not 0 <= ms <= MAX_OBJECTIVE_MS:
        raise InvalidArgument(f"{name} must be in [0, {MAX_OBJECTIVE_MS:g}] milliseconds (0 = none), got {ms:g}")
    return ms


def objectives_of(ttft_ms: str | float | None, tpot_ms: str | float | None, default: Objectives,
                  names: tuple[str, str] = (TTFT_HEADER, TPOT_HEADER)) -> Objectives:
    """The request's objectives: each one given (None = not given: the router's default; 0 = none), checked
    under its ``names`` (the header's or the field's)."""
    ttft = default.ttft_s if ttft_ms is None else objective_ms(ttft_ms, names[0]) / 1000
    tpot = default.tpot_s if tpot_ms is None else objective_ms(tpot_ms, names[1]) / 1000
    return Objectives(ttft, tpot)


def objectives_from_headers(headers: Mapping[str, str], default: Objectives) -> Objectives:
    """The objectives of an HTTP request's headers (lower-case names, as Starlette's and the picker's are)."""
    return objectives_of(headers.get(TTFT_HEADER), headers.get(TPOT_HEADER), default)
