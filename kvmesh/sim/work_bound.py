"""The work bound: a rate above which no routing policy can meet the SLO (a reference beside the policies).

Oracle hits and perfect balance, made a bound by deadlines (docs/benchmarks.md, "Limits"):

1. **Least work per request.** Request i (prompt p, output o) gets the oracle's cache hit h (one LRU
   of the whole fleet's blocks, kvmesh/sim/oracle.py), so it computes u = p - h prompt tokens
   attending to h + (u + 1) / 2 tokens on average, and o - 1 decode steps at contexts p .. p + o - 2
   (or more). Split each piece of work (its prefill; its decodes) into the roofline's two sides:
   bytes (KV written by the prefill; KV read by the decodes, and the weights read once per step of
   at most S = --max-num-seqs decodes) and FLOPs, each in seconds of the GPU's, plus the launch of
   its share of steps.
2. **Overlap at best.** A step takes max(bytes, FLOPs) + launch, and bytes and FLOPs add up over
   steps; so any set of steps takes at least max(their bytes, their FLOPs) + their launches: the
   best a scheduler can do is overlap one side with the other completely.
3. **Deadlines.** A request that meets the SLO has its prefill done by arrival + its TTFT limit, and
   its decodes by that + TPOT limit x (o - 1). No GPU works before time 0, so at every time t the
   work due by t fits in [0, t]: max(bytes due, FLOPs due) + launches due <= t x workers. The SLO
   lets 1 - --slo-target of the requests fail: at each t, the largest prefill and the largest
   decode pieces of that many requests due by t are not counted (at least what they could shed).
   A fleet of several GPU types g (n_g workers) is one weighted pool: for weights y_g >= 0,
   sum_g y_g x (seconds of type g used by t) <= t x sum_g y_g n_g, and each piece counts
   min_g y_g x its seconds on g (LP weak duality: any y is valid; the one chosen makes the bound
   tightest over the whole workload).
4. **The bound** is the highest rate (arrival times divided by it) at which every such constraint
   holds, by bisection.

Beside it, :attr:`WorkBound.saturation`: the rate at which the same least work (every request, the
sides overlapped) keeps every GPU busy for the whole arrival span. A long run above it cannot keep
up; a finite one can still meet the SLO a little above it, by using the slack its deadlines leave
after the last arrival (so it is not a bound: the work bound is).

It ignores what only makes serving slower (network, queueing order, a request's prefill bound to
one GPU, chunk and batch limits, recomputation), so it is above every policy's capacity, the
information limit's included. Two caveats: hits beyond one fleet-wide LRU (possible in contrived
patterns) are not covered, and with --sim-step-noise a step can be faster than its roofline (the
bound holds for the expected step time).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from kvmesh.model_worker.simulated.step_time import LinearCost, Roofline, StepTimeModel
from kvmesh.sim.config import SimConfig, cold_prefill_s, fleet_capacity_blocks, slo_cost
from kvmesh.sim.fleet import fleet_counts
from kvmesh.sim.oracle import lru_hits
from kvmesh.sim.workload import Workload

WEIGHTS = np.exp(np.linspace(-2.0, 2.0, 41))


def request_terms(cost: StepTimeModel, prompt: np.ndarray, hits: np.ndarray, output: np.ndarray,
                  max_num_seqs: int) -> tuple[np.ndarray, ...]:
    """Per request, in seconds on ``cost``: (prefill bytes, prefill FLOPs, decode bytes, decode FLOPs,
    decode launches) of its least work (module doc; the linear model's terms all count as FLOPs)."""
    u = prompt - hits
    pairs = u * (hits + (u + 1) / 2)
    m = np.maximum(output - 1, 0)
    contexts = m * prompt + m * (m - 1) / 2
    if isinstance(cost, Roofline):
        return (cost.memory_s(u, 0.0), cost.compute_s(u, pairs, 0, 0),
                cost.memory_s(contexts, m / max_num_seqs), cost.compute_s(0, 0.0, m, contexts),
                cost.gpu.launch_s * m / max_num_seqs)
    if isinstance(cost, LinearCost):
        zero = np.zeros_like(prompt, dtype=float)
        return (zero, cost.prefill_token_s * u + cost.attn_pair_s * pairs, zero,
                cost.decode_seq_s * m + cost.decode_kv_token_s * contexts, cost.step_overhead_s * m / max_num_seqs)
    raise TypeError(f"no work bound for {type(cost).__name__}")


@dataclass(frozen=True, slots=True)
class WorkBound:
    """Rates (x the workload's own) of the module doc; None = no finite rate."""

    rate: float | None
    """The work bound: above it no policy meets the SLO."""
    saturation: float | None
    """Where the least work keeps every GPU busy for the arrival span."""


def work_bound(workload: Workload, cfg: SimConfig, chains: list[list[bytes]]) -> WorkBound:
    """The work bound and the saturation rate of ``workload`` on ``cfg``'s fleet (module doc)."""
    reqs = workload.requests
    if not reqs:
        return WorkBound(None, None)
    prompt = np.array([r.prompt_len for r in reqs], dtype=float)
    output = np.array([r.output_len for r in reqs], dtype=float)
    hits = np.array(lru_hits(((r.prompt_len, c) for r, c in zip(reqs, chains, strict=True)),
                             fleet_capacity_blocks(cfg), cfg.block_size), dtype=float)
    counts = fleet_counts(cfg.worker_gpus())
    terms = [request_terms(cfg.cost_for(g), prompt, hits, output, cfg.engine.max_num_seqs) for g in counts]
    n = np.array(list(counts.values()), dtype=float)
    y = _weights(terms, n)
    # per piece (prefills, then decodes): its bytes side and its FLOPs side, launches included
    mem = np.concatenate([_least(y, terms, 0, None), _least(y, terms, 2, 4)])
    flops = np.concatenate([_least(y, terms, 1, None), _least(y, terms, 3, 4)])
    capacity = float(y @ n)
    least = max(mem.sum(), flops.sum())
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    saturation = round(float(capacity * span / least), 6) if span > 0 and least > 0 else None
    slo = slo_cost(cfg)
    budget = cfg.engine.max_num_batched_tokens
    ttft = np.array([cfg.slo_ttft_s + cfg.slo_ttft_prefill_x * cold_prefill_s(slo, budget, r.prompt_len)
                     for r in reqs])
    decode_s = cfg.slo_tpot_s * np.maximum(output - 1, 0)
    arrival = np.array([r.arrival_s for r in reqs])
    spare = int(math.floor((1 - cfg.slo_target) * len(reqs) + 1e-9))
    is_pre = np.concatenate([np.ones(len(reqs), dtype=bool), np.zeros(len(reqs), dtype=bool)])

    def feasible(rate: float) -> bool:
        first = arrival / rate + ttft
        due = np.concatenate([first, first + decode_s])
        order = np.argsort(due, kind="stable")
        return _meets_deadlines(due[order].tolist(), mem[order].tolist(), flops[order].tolist(),
                                is_pre[order].tolist(), spare, capacity)

    lo, hi = 1e-6, 1.0
    if not feasible(lo):
        return WorkBound(0.0, saturation)
    while feasible(hi):
        lo, hi = hi, hi * 2
        if hi > 1e6:
            return WorkBound(None, saturation)
    while hi / lo > 1 + 1e-5:
        mid = math.sqrt(lo * hi)
        if feasible(mid):
            lo = mid
        else:
            hi = mid
    return WorkBound(round(lo, 6), saturation)


def _least(y: np.ndarray, terms: list[tuple[np.ndarray, ...]], side: int, launch: int | None) -> np.ndarray:
    """Per request, the least weighted seconds of one side of a piece over the GPU types."""
    return np.min([yg * (t[side] + (t[launch] if launch is not None else 0.0)) for yg, t in zip(y, terms, strict=True)],
                  axis=0)


class _Shed:
    """The sum of the ``k`` largest values pushed so far."""

    __slots__ = ("heap", "k", "total")

    def __init__(self, k: int) -> None:
        self.heap: list[float] = []
        self.k = k
        self.total = 0.0

    def push(self, v: float) -> None:
        if len(self.heap) < self.k:
            heapq.heappush(self.heap, v)
            self.total += v
        elif self.k and v > self.heap[0]:
            self.total += v - heapq.heapreplace(self.heap, v)


def _meets_deadlines(due: list[float], mem: list[float], flops: list[float], is_pre: list[bool], spare: int,
                     capacity: float) -> bool:
    """Whether at every deadline t (ascending) the work due by t, less what ``spare`` failed requests
    could shed, fits in ``capacity`` x t: max(bytes side, FLOPs side), each less the ``spare`` largest
    prefill and decode pieces of that side due so far."""
    need_mem = need_flops = 0.0
    shed = {(side, pre): _Shed(spare) for side in (0, 1) for pre in (True, False)}
    for t, m, f, pre in zip(due, mem, flops, is_pre, strict=True):
        need_mem += m
        need_flops += f
        shed[(0, pre)].push(m)
        shed[(1, pre)].push(f)
        least = max(need_mem - shed[(0, True)].total - shed[(0, False)].total,
                    need_flops - shed[(1, True)].total - shed[(1, False)].total)
        if least > capacity * t * (1 + 1e-12):
            return False
    return True


def _weights(terms: list[tuple[np.ndarray, ...]], n: np.ndarray) -> np.ndarray:
    """Weights y per GPU type (type 0's is 1) making the bound tightest over the whole workload: the most
    least work per unit of weighted capacity, by coordinate search (any choice is a valid bound)."""
    k = len(terms)
    if k == 1:
        return np.ones(1)

    def score(y: np.ndarray) -> float:
        mem = np.min([y[j] * (t[0] + t[2] + t[4]) for j, t in enumerate(terms)], axis=0).sum()
        flops = np.min([y[j] * (t[1] + t[3] + t[4]) for j, t in enumerate(terms)], axis=0).sum()
        return float(max(mem, flops) / (y @ n))

    y = np.ones(k)
    best = score(y)
    for _ in range(4):
        improved = False
        for j in range(1, k):
            for w in WEIGHTS:
                trial = y.copy()
                trial[j] = w
                if (s := score(trial)) > best * (1 + 1e-12):
                    best, y, improved = s, trial, True
        if not improved:
            break
    return y
