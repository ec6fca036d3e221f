"""The record of one replayed request and the figures of many: one record and one summary for the
live bench (kvmesh/bench/serve.py fills it in wall seconds from the benchmark's start) and the
simulator (kvmesh/sim/ fills it in virtual seconds). Each reports them its own way: the bench in
vLLM's `bench serve` layout (kvmesh/bench/report.py), the simulator as one run's row
(kvmesh/sim/run.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request, as its client saw it; times on the replay's clock (seconds)."""

    index: int
    arrival: float
    """When it was sent."""
    prompt_len: int
    output_len: int
    """Tokens asked for."""
    worker: str = ""
    """The worker that served it."""
    first_token: float | None = None
    finish: float | None = None
    """When the message with its finish reason arrived."""
    completion_tokens: int = 0
    cached_tokens: int = 0
    failed: str = ""
    """Why it failed; "" = it did not."""
    attempts: int = 0
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive token-carrying messages after the first (the live bench measures them)."""
    slo_ok: bool | None = None
    counted_miss: bool = False
    """Already counted as an SLO miss (its TTFT deadline passed before its first token)."""
    pulled_tokens: int = 0
    """Prompt tokens whose KV a decode leg took in from a prefill worker (prefill/decode disaggregation, the
    simulator: no cache hit, computed for it)."""
    last_token: float | None = None
    max_itl: float = 0.0
    """The simulator's longest gap between two of its tokens (a multi-step window's tokens spread evenly over it)."""

    @property
    def success(self) -> bool:
        """It finished and did not fail."""
        return self.finish is not None and not self.failed

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.finish is None or self.completion_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.completion_tokens - 1)


PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) with numpy's linear interpolation; nan when empty."""
    return float(np.percentile(values, p)) if len(values) else float("nan")


def stats(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean / median / std / p50 / p90 / p99 (numpy's linear interpolation) of ``values`` times
    ``scale``; zeros when empty."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64) * scale
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    out.update({f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES})
    return out


@dataclass(slots=True)
class Summary:
    """The figures of a replay's records, in their own units (seconds, tokens)."""

    requests: int
    completed: int
    """Finished and not failed: every figure below is over these, but ``ttft``."""
    failed: int
    unfinished: int
    """Neither finished nor failed (a replay stopped before they ended)."""
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    ttft: list[float]
    """Of every request that got its first token and did not fail (finished or not)."""
    tpot: list[float]
    e2e: list[float]
    itl: list[float]
    served: dict[str, int]
    """Per worker, prompt + output tokens of the requests it completed (every worker named, 0 if none)."""
    errors: list[str]
    """The distinct reasons of the failures, sorted, 10 at most."""

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_mean_load(self) -> float:
        """The busiest worker's tokens over the mean worker's."""
        mean = sum(self.served.values()) / len(self.served) if self.served else 0.0
        return max(self.served.values()) / mean if mean else 0.0


def summarize(records: Sequence[RequestRecord], workers: Iterable[str] = ()) -> Summary:
    """The figures of ``records``; ``workers``: every worker that could serve (idle ones count in the load)."""
    done = [r for r in records if r.success]
    served: dict[str, int] = dict.fromkeys(workers, 0)
    for r in done:
        served[r.worker] = served.get(r.worker, 0) + r.prompt_len + r.completion_tokens
    return Summary(
        requests=len(records), completed=len(done), failed=sum(1 for r in records if r.failed),
        unfinished=sum(1 for r in records if r.finish is None and not r.failed),
        prompt_tokens=sum(r.prompt_len for r in done), output_tokens=sum(r.completion_tokens for r in done),
        cached_tokens=sum(r.cached_tokens for r in done),
        ttft=[t for r in records if (t := r.ttft) is not None and not r.failed],
        tpot=[t for r in done if (t := r.tpot) is not None],
        e2e=[r.finish - r.arrival for r in done if r.finish is not None],
        itl=[g for r in done for g in r.itl], served=served,
        errors=sorted({r.failed for r in records if r.failed})[:10])
