"""The workers' step time, learned online from what they report.

Every worker reports cumulative counters in its load (kvmesh.contract.types.Load): seconds spent
in steps, and what those steps computed (steps, prefill tokens, prefill attention pairs, decode
sequence-steps, decode context tokens). Between two reports of one worker, the busy seconds are
(close to) a linear function of the work:

    busy = step_s * steps + prefill_token_s * prefill + prefill_pair_s * pairs
         + decode_seq_s * decode_seqs + decode_context_token_s * decode_context

:class:`StepCostLearner` fits those five coefficients by least squares over the deltas of every
worker's successive reports (pooled: the workers of one model run the same engine on the same
hardware), with exponential forgetting so the fit follows drift. No coefficient is assumed: until
enough reports arrived, :meth:`StepCostLearner.estimate` returns None and callers fall back to a
plain token count. On a GPU the fit approximates the true step time; on a simulated worker
(model_worker/sim_runner.py) the cost model is exactly of this form, so the fit recovers it.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from kvmesh.contract.types import Load

FEATURES = ("steps", "prefill_tokens", "prefill_pairs", "decode_tokens", "decode_context_tokens")


@dataclass(slots=True, frozen=True)
class StepCost:
    """Seconds per unit of work of one step (the fitted coefficients)."""

    step_s: float
    prefill_token_s: float
    prefill_pair_s: float
    decode_seq_s: float
    decode_context_token_s: float
    pairs_per_prefill_token: float
    """The mean attention pairs per prefill token seen (to cost a queue of unknown prompts)."""


def _counters(load: Load) -> tuple[float, ...]:
    return (load.busy_s, *(float(getattr(load, f)) for f in FEATURES))


class StepCostLearner:
    """Pooled least squares of busy time on the work counters; thread-safe.

    Args:
        forget: weight kept by the past per new observation (0.995: ~200 reports of memory).
        min_reports: observations needed before :meth:`estimate` answers.
    """

    def __init__(self, forget: float = 0.995, min_reports: int = 8) -> None:
        self.forget = forget
        self.min_reports = min_reports
        self.reports = 0
        self._last: dict[str, tuple[float, ...]] = {}
        k = len(FEATURES)
        self._a = np.zeros((k, k))
        self._b = np.zeros(k)
        self._scale = np.ones(k)
        self._pairs = 0.0
        self._prefill = 0.0
        self._fit: StepCost | None = None
        self._dirty = False
        self._lock = threading.Lock()

    def observe(self, worker_id: str, load: Load) -> None:
        """Feeds one report of a worker (repeats of the last one are ignored)."""
        if not load.steps:
            return  # NOTE: an older worker, or one that has not run a step yet
        cur = _counters(load)
        with self._lock:
            prev = self._last.get(worker_id)
            if prev == cur:
                return
            self._last[worker_id] = cur
            if prev is None or cur[1] <= prev[1]:
                return  # first report, or a restarted worker (counters back to 0)
            d = np.subtract(cur, prev)
            y, x = d[0], d[1:]
            if y <= 0 or (x < 0).any():
                return
            # NOTE: the features differ by ~10 orders of magnitude (steps vs attention pairs):
            # solve in units of each feature's largest delta seen, for a well-conditioned system.
            self._rescale(np.maximum(self._scale, x))
            z = x / self._scale
            self._a = self.forget * self._a + np.outer(z, z)
            self._b = self.forget * self._b + z * y
            self._pairs += x[2]
            self._prefill += x[1]
            self.reports += 1
            self._dirty = True

    def _rescale(self, scale: np.ndarray) -> None:
        if np.array_equal(scale, self._scale):
            return
        r = self._scale / scale
        self._a *= np.outer(r, r)
        self._b *= r
        self._scale = scale

    def estimate(self) -> StepCost | None:
        """The current fit, or None before ``min_reports`` observations."""
        with self._lock:
            if self.reports < self.min_reports:
                return None
            if self._dirty or self._fit is None:
                self._fit = self._solve()
                self._dirty = False
            return self._fit

    def _solve(self) -> StepCost:
        k = len(FEATURES)
        active = list(range(k))
        coef = np.zeros(k)
        ridge = 1e-9 * (np.trace(self._a) / k or 1.0)
        # NOTE: non-negative least squares by elimination: a coefficient fitted below zero (a
        # feature the data cannot tell apart from the others) is dropped and the rest refitted.
        while active:
            a = self._a[np.ix_(active, active)] + ridge * np.eye(len(active))
            sol = np.linalg.solve(a, self._b[active])
            if (sol >= 0).all():
                coef[active] = sol
                break
            active = [j for j, v in zip(active, sol, strict=True) if v >= 0] if (sol > 0).any() else []
        c = coef / self._scale
        ratio = self._pairs / self._prefill if self._prefill else 0.0
        return StepCost(*(float(v) for v in c), pairs_per_prefill_token=ratio)
