"""The workers' step time, learned online from what they report.

Every worker reports cumulative counters in its load (kvmesh.contract.types.Load): seconds spent
in steps, and what those steps computed (steps, prefill tokens, prefill attention pairs, decode
sequence-steps, decode context tokens). Between two reports of one worker, the busy seconds are
(close to) a linear function of the work:

    busy = step_s * steps + prefill_token_s * prefill + prefill_pair_s * pairs
         + decode_seq_s * decode_seqs + decode_context_token_s * decode_context

:class:`StepCostLearner` fits those five coefficients by least squares over the deltas of
successive reports, with exponential forgetting so the fit follows drift. It keeps one fit per
worker (``group``: each worker's own reports; a fleet may mix GPU types, and nothing a worker reports
names its hardware) and one pooled over every worker's reports, which answers for a worker until its
own fit has ``min_reports`` (docs/benchmarks.md, "Step-cost fit: per worker or pooled", has the
measurement that chose per worker). No coefficient is assumed: until enough reports arrived,
:meth:`StepCostLearner.estimate` returns None and callers fall back to a plain token count. The
fit approximates the true step time: on a GPU, and on a simulated worker (model_worker/simulated/step_time.py,
a roofline: memory bound at small batch, compute bound in a large prefill), step time is not
linear in the work.

**The host link.** A worker with a host KV tier also reports the blocks it loaded back from host
memory and the seconds those loads took (part of its busy seconds). The learner keeps, per worker
and pooled, the seconds per loaded block: the ratio of the two counters' deltas, forgetting the past
as the step fit does (a DMA over PCIe or NVLink-C2C costs bytes / bandwidth: linear in the blocks).
:meth:`StepCostLearner.load_s_per_block` answers it, None until a load was seen. The step fit
regresses the busy seconds *less* the load seconds, so loads do not bias its coefficients.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
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


LINKS = ("host", "adapter_cpu", "adapter_disk")
"""What a worker loads besides its steps' work, each a count and its seconds in the load report: host-tier
blocks, LoRA adapters copied into a slot from CPU memory, and read from disk."""


def _counters(load: Load) -> tuple[float, ...]:
    """(busy seconds less every load's seconds, the features..., then per LINKS: its count, its seconds)."""
    return (load.busy_s - load.host_load_s - load.adapter_cpu_load_s - load.adapter_disk_load_s,
            *(float(getattr(load, f)) for f in FEATURES),
            float(load.host_loaded_blocks), load.host_load_s, float(load.adapter_cpu_loads), load.adapter_cpu_load_s,
            float(load.adapter_disk_loads), load.adapter_disk_load_s)


class _Link:
    """Seconds per block loaded from the host tier: forgetting sums of the load seconds and blocks."""

    __slots__ = ("seconds", "blocks", "reports")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.blocks = 0.0
        self.reports = 0

    def add(self, blocks: float, seconds: float, forget: float) -> None:
        self.seconds = forget * self.seconds + float(seconds)
        self.blocks = forget * self.blocks + float(blocks)
        self.reports += 1

    @property
    def per_block(self) -> float:
        return float(self.seconds / self.blocks)


def per_worker(worker_id: str) -> str:
    """The default grouping of :class:`StepCostLearner`: every worker its own fit."""
    return worker_id


class _Fit:
    """One least-squares fit: the forgetting normal equations in scaled units."""

    __slots__ = ("a", "b", "scale", "pairs", "prefill", "reports", "fit", "dirty", "sx", "sy")

    def __init__(self) -> None:
        k = len(FEATURES)
        self.a = np.zeros((k, k))
        self.b = np.zeros(k)
        self.scale = np.ones(k)
        self.pairs = 0.0
        self.prefill = 0.0
        self.reports = 0
        self.fit: StepCost | None = None
        self.dirty = False
        self.sx = np.zeros(k)
        self.sy = 0.0
        """Forgetting sums of the work and of the busy seconds (the worker's speed against a fit)."""

    def add(self, x: np.ndarray, y: float, forget: float) -> None:
        # NOTE: the features differ by ~10 orders of magnitude (steps vs attention pairs):
        # solve in units of each feature's largest delta seen, for a well-conditioned system.
        self.sx = forget * self.sx + x
        self.sy = forget * self.sy + y
        self._rescale(np.maximum(self.scale, x))
        z = x / self.scale
        # NOTE: forgetting only along the direction this report informs (directional forgetting,
        # Kulhavy 1987). Uniform forgetting let a long run of alike reports (a burst: every step a
        # full prefill chunk, so steps and prefill tokens move together) erase what earlier, varied
        # steps had taught about the directions the burst does not excite; the fit then split a
        # step's time between its fixed cost and its tokens at random (0.19 s per step where the
        # roofline has 1 ms), and identical workers got fits 4x apart for a small prefill.
        # The estimate c (A c = b) is kept: b loses along z what A loses, b -= k (A z)(z^T b).
        az = self.a @ z
        zaz = float(z @ az)
        if zaz > 0.0:
            k = (1.0 - forget) / zaz
            self.b = self.b - k * az * float(z @ self.b)
            self.a = self.a - k * np.outer(az, az)
        self.a = self.a + np.outer(z, z)
        self.b = self.b + z * y
        self.pairs += x[2]
        self.prefill += x[1]
        self.reports += 1
        self.dirty = True

    def _rescale(self, scale: np.ndarray) -> None:
        if np.array_equal(scale, self.scale):
            return
        r = self.scale / scale
        self.a *= np.outer(r, r)
        self.b *= r
        self.scale = scale

    def solve(self, prior: _Fit | None = None, prior_weight: float = 0.0) -> StepCost:
        """The fit (cached until the next report). ``prior``: another fit whose reports count
        ``prior_weight`` as much as this one's own (a worker's fit leans on the pooled one)."""
        if self.dirty or self.fit is None:
            self.fit = self._solve(prior, prior_weight)
            self.dirty = False
        return self.fit

    def _solve(self, prior: _Fit | None, prior_weight: float) -> StepCost:
        k = len(FEATURES)
        active = list(range(k))
        coef = np.zeros(k)
        a_all, b_all = self.a, self.b
        if prior is not None and prior_weight > 0 and prior.reports:
            # NOTE: the prior's normal equations in this fit's units: z = z_prior * prior.scale / scale.
            r = prior.scale / self.scale
            a_all = a_all + prior_weight * prior.a * np.outer(r, r)
            b_all = b_all + prior_weight * prior.b * r
        ridge = 1e-9 * (np.trace(a_all) / k or 1.0)
        # NOTE: non-negative least squares by elimination: a coefficient fitted below zero (a
        # feature the data cannot tell apart from the others) is dropped and the rest refitted.
        while active:
            a = a_all[np.ix_(active, active)] + ridge * np.eye(len(active))
            sol = np.linalg.solve(a, b_all[active])
            if (sol >= 0).all():
                coef[active] = sol
                break
            active = [j for j, v in zip(active, sol, strict=True) if v >= 0] if (sol > 0).any() else []
        c = coef / self.scale
        ratio = self.pairs / self.prefill if self.prefill else 0.0
        return StepCost(*(float(v) for v in c), pairs_per_prefill_token=ratio)


PRIOR_WEIGHT = 1e-3
"""What the pooled fit weighs in a worker's own fit, as a share of an average worker's reports: enough
to settle the directions the worker's reports leave open, too little to move the ones they inform."""


class StepCostLearner:
    """Least squares of busy time on the work counters, per group of workers and pooled; thread-safe.

    Args:
        forget: weight kept by the past per new observation (0.995: ~200 reports of memory).
        min_reports: observations a fit needs before it answers.
        group: which fit a worker's reports feed besides the pooled one (:func:`per_worker`, the
            default: its own); None = the pooled fit only.
    """

    def __init__(self, forget: float = 0.995, min_reports: int = 8,
                 group: Callable[[str], Hashable] | None = per_worker) -> None:
        self.forget = forget
        self.min_reports = min_reports
        self.group = group
        self._last: dict[str, tuple[float, ...]] = {}
        self._pooled = _Fit()
        self._groups: dict[Hashable, _Fit] = {}
        self._link = {kind: _Link() for kind in LINKS}
        """Per kind of load, the pooled seconds per unit (host block, adapter)."""
        self._links: dict[tuple[str, Hashable], _Link] = {}
        self._lock = threading.Lock()

    @property
    def reports(self) -> int:
        """Observations so far (every worker's)."""
        return self._pooled.reports

    @property
    def learned(self) -> bool:
        """Whether :meth:`estimate` answers (the pooled fit has ``min_reports``), without solving a fit."""
        return self._pooled.reports >= self.min_reports

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
            k = 1 + len(FEATURES)
            y, x = d[0], d[1:k]
            for i, kind in enumerate(LINKS):
                loaded, load_s = d[k + 2 * i], d[k + 2 * i + 1]
                if loaded > 0 and load_s >= 0:
                    self._link[kind].add(loaded, load_s, self.forget)
                    if self.group is not None:
                        link = self._links.get(key := (kind, self.group(worker_id)))
                        if link is None:
                            link = self._links[key] = _Link()
                        link.add(loaded, load_s, self.forget)
            if y <= 0 or (x < 0).any():
                return
            self._pooled.add(x, y, self.forget)
            if self.group is not None:
                key = self.group(worker_id)
                fit = self._groups.get(key)
                if fit is None:
                    fit = self._groups[key] = _Fit()
                fit.add(x, y, self.forget)

    def estimate(self, worker_id: str | None = None) -> StepCost | None:
        """The fit for ``worker_id``: its group's once that has ``min_reports`` observations, else the
        pooled one; None (any worker) before the pooled fit has ``min_reports``. Without a worker:
        the pooled fit."""
        with self._lock:
            if self._pooled.reports < self.min_reports:
                return None
            if worker_id is not None and self.group is not None:
                fit = self._groups.get(self.group(worker_id))
                if fit is not None and fit.reports >= self.min_reports:
                    # NOTE: a worker's own reports decide what they inform; what they leave open
                    # (a worker that only ever ran full prefill chunks cannot tell a step's fixed cost
                    # from its tokens) comes from the pooled reports, weighted as a small share of one
                    # worker's (PRIOR_WEIGHT). Alone, such a fit split the step at random: identical
                    # H100s got small-prefill costs 4x apart, and kv-aware avoided the ones it misjudged.
                    return fit.solve(self._pooled, PRIOR_WEIGHT / len(self._groups))
            return self._pooled.solve()

    def relative_speed(self, worker_id: str) -> float:
        """The worker's busy seconds over what the pooled fit predicts for the same work (1.0 = as fast
        as the fleet's average, 2.0 = half as fast); 1.0 until both fits answer. One ratio over all of
        its reports, so identical workers read alike where their own five-coefficient fits differ."""
        return self.relative_speeds([worker_id])[0]

    def relative_speeds(self, worker_ids: Sequence[str]) -> list[float]:
        """:meth:`relative_speed` of each worker, the pooled fit solved once."""
        with self._lock:
            if self._pooled.reports < self.min_reports or self.group is None:
                return [1.0] * len(worker_ids)
            c = self._pooled.solve()
            pooled = np.array((c.step_s, c.prefill_token_s, c.prefill_pair_s, c.decode_seq_s, c.decode_context_token_s))
            out = []
            for w in worker_ids:
                fit = self._groups.get(self.group(w))
                if fit is None or fit.reports < self.min_reports:
                    out.append(1.0)
                    continue
                predicted = float(np.dot(pooled, fit.sx))
                out.append(fit.sy / predicted if predicted > 0 and fit.sy > 0 else 1.0)
            return out

    MIN_LINK_REPORTS = 3
    """Reports with loads a worker's own link estimate needs before it answers for the worker."""

    def load_s_per_block(self, worker_id: str | None = None) -> float | None:
        """Seconds one block takes to load from ``worker_id``'s host tier: its own estimate once it has
        :attr:`MIN_LINK_REPORTS` reports with loads, else the pooled one; None before any worker
        reported a load (a host block is then priced as a block to recompute)."""
        return self.load_s("host", worker_id)

    def load_s(self, kind: str, worker_id: str | None = None) -> float | None:
        """Seconds one unit of ``kind`` (LINKS) takes to load on ``worker_id``, as :meth:`load_s_per_block`
        for the host tier: an adapter copied from CPU memory (``adapter_cpu``) or read from disk
        (``adapter_disk``). None before any worker reported such a load."""
        with self._lock:
            pooled = self._link[kind]
            if not pooled.reports or pooled.blocks <= 0:
                return None
            if worker_id is not None and self.group is not None:
                link = self._links.get((kind, self.group(worker_id)))
                if link is not None and link.reports >= self.MIN_LINK_REPORTS and link.blocks > 0:
                    return link.per_block
            return pooled.per_block
