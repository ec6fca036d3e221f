"""A stand-in for ModelRunner: the real scheduler and block pool run, the forward pass is a cost model.

`kvmesh worker --simulate` builds its LLMEngine with a :class:`SimRunner`. Every step it computes
how long an H100 would take for the scheduled batch (:class:`CostModel`), sleeps that long times
``time_scale`` on the engine thread, and returns deterministic token ids. No weights are loaded
and no KV tensors are allocated, so a laptop can host many "GPUs" whose prefix caches, block
events and load reports are the real ones.

With ``time_scale=0`` nothing sleeps: the modelled duration of each step is only returned
(``last_step_s``; ``step_elapsed_s`` inside a multi-step window), and the virtual-time simulator
(kvmesh/sim/, whose runner runs whole windows: kvmesh/sim/engine.py) advances its own clock by it.

Cost model of one step (seconds), docs/benchmarks.md#cost-model:

    t = step_overhead_s                                   (any work at all)
      + prefill_token_s * new_prefill_tokens              (GEMMs, compute bound)
      + attn_pair_s * sum(new * (context_before + (new + 1) / 2))   (prefill attention)
      + decode_seq_s * decode_batch                       (per sequence in the batch)
      + decode_kv_token_s * sum(decode context tokens)    (KV read, memory bound)

Cached prompt tokens cost nothing in the linear terms; they are read by the attention terms as
context (``context_before`` of the first chunk is the cache hit).
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.contract.types import H100_8B_KV_BLOCKS
from kvmesh.model_worker.config import EngineConfig, ModelConfig
from kvmesh.model_worker.request import Request
from kvmesh.model_worker.scheduler import SchedulerOutput, StepWork

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

DEFAULT_SIM_NUM_BLOCKS = H100_8B_KV_BLOCKS

_ABSORB_S = 0.005

DEFAULT_SIM_MAX_MODEL_LEN = 131_072
"""Llama-3.1-8B's context; the Mooncake traces have prompts up to ~125k tokens."""


@dataclass(slots=True, frozen=True)
class CostModel:
    """Step time of an H100 SXM serving an 8B dense model in bf16 (approximations, see module doc).

    Defaults come from public figures: ~16 GFLOP per token for 8B parameters at ~50 % of the
    989 TFLOPS bf16 peak gives ~30k tok/s for the GEMMs; measured vLLM/SGLang prefill of 8B models
    on one H100 is 10-20k tok/s at 2-16k prompt lengths once attention is included; a decode step
    reads the 16 GB of weights at ~3.35 TB/s (~5 ms) plus scheduling/launch overhead, so ITL at
    small batch is ~7-8 ms; KV read is 128 KiB per context token per step at ~3.35 TB/s.
    """

    step_overhead_s: float = 0.006
    """Fixed cost of a step: weight read (~4.8 ms) plus launch/sampling overhead."""
    prefill_token_s: float = 60e-6
    """Per new prefill token: the GEMMs (~16.7k tok/s before attention)."""
    attn_pair_s: float = 1.3e-9
    """Per (new token x context token) pair of prefill attention: 4 x 32 layers x 4096 FLOP
    at ~400 TFLOPS effective."""
    decode_seq_s: float = 50e-6
    """Per sequence in the decode batch (sampling, small GEMM growth)."""
    decode_kv_token_s: float = 40e-9
    """Per context token read by a decode step: 128 KiB / 3.35 TB/s."""

    def time(self, prefill_tokens: int, prefill_pairs: float, decode_seqs: int, decode_context_tokens: int) -> float:
        """Seconds one step with this work takes (the one formula; 0 for no work at all)."""
        if not prefill_tokens and not decode_seqs:
            return 0.0
        return (self.step_overhead_s + self.prefill_token_s * prefill_tokens + self.attn_pair_s * prefill_pairs
                + self.decode_seq_s * decode_seqs + self.decode_kv_token_s * decode_context_tokens)

    def step_time(self, prefills: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        """Seconds one step takes.

        Args:
            prefills: per prefill chunk, (tokens already in the KV cache before it, new tokens).
            decode_contexts: per decoding sequence, its context length (tokens it attends to).
        """
        return self.time(sum(n for _, n in prefills), sum(n * (start + (n + 1) / 2) for start, n in prefills),
                         len(decode_contexts), sum(decode_contexts))

    def work_time(self, w: StepWork) -> float:
        """:meth:`time` of a step's work counts."""
        return self.time(w.prefill_tokens, w.prefill_pairs, w.decode_seqs, w.decode_context_tokens)

    def batch_time(self, out: SchedulerOutput) -> float:
        """:meth:`time` of a scheduled batch: a request computing tokens past its prompt decodes."""
        return self.work_time(out.work())


@dataclass(slots=True)
class SimStats:
    """What the simulated GPU did so far (exported as Prometheus counters by the worker)."""

    busy_s: float = 0.0
    """Modelled seconds of work (unscaled)."""
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0


@functools.lru_cache(maxsize=8192)
def _request_seed(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


_TOKEN_STRIDE = 40_503
"""Odd, so consecutive positions of a request walk through the whole vocabulary."""


def sim_token_id(request_id: str, position: int, vocab_size: int, avoid: AbstractSet[int]) -> int:
    """A deterministic token for a request's position, never one of ``avoid`` (EOS, stop ids).

    One hash per request (cached), then arithmetic per position: the simulator draws ~10^6 tokens
    per run, and nothing reads their values beyond hashing the blocks they fill.
    """
    token = (_request_seed(request_id) + position * _TOKEN_STRIDE) % vocab_size
    while token in avoid:
        token = (token + 1) % vocab_size
    return token


def sim_token_ids(request_id: str, start: int, n: int, vocab_size: int, avoid: AbstractSet[int]) -> list[int]:
    """``sim_token_id`` of positions ``start .. start + n - 1``."""
    seed = _request_seed(request_id)
    out = [(seed + p * _TOKEN_STRIDE) % vocab_size for p in range(start, start + n)]
    if not avoid.isdisjoint(out):
        out = [sim_token_id(request_id, p, vocab_size, avoid) for p in range(start, start + n)]
    return out


class SimRunner:
    """The runner interface LLMEngine uses (``num_blocks``, ``execute``) over a cost model.

    Args:
        config: the checked engine config; ``num_blocks`` None = :data:`DEFAULT_SIM_NUM_BLOCKS`.
        model_config: the model's config (vocabulary and EOS ids only).
        cost: the step-time model.
        time_scale: wall seconds slept per modelled second (0.25 = four times faster than the GPU;
            0 = no sleeping at all).
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, cost: CostModel | None = None,
                 time_scale: float = 1.0) -> None:
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.config = config
        self.cost = cost or CostModel()
        self.time_scale = time_scale
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks if config.num_blocks is not None else DEFAULT_SIM_NUM_BLOCKS
        self.vocab_size = model_config.vocab_size
        self._eos = frozenset(model_config.eos_token_ids)
        self.stats = SimStats()
        self.last_step_s = 0.0
        """Modelled seconds of the last ``execute`` / ``execute_window`` (the engine's step time)."""
        self.step_elapsed_s = 0.0
        """Modelled seconds since the current step began; inside a window, when the inner step whose
        tokens ``on_step`` is given ended."""
        self._lock = threading.Lock()
        # NOTE: back-to-back steps are paced against a running deadline, so up to
        # _ABSORB_S of host overhead between them is absorbed instead of added (a GPU overlaps
        # the next step's scheduling with this one); a host slower than that slows the simulation.
        self._deadline = 0.0

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Sleeps for the batch's modelled time; returns request id -> one token for the rows that sample."""
        self.step_elapsed_s = 0.0
        if out.is_empty:
            self.last_step_s = 0.0
            return {}
        w = out.work()
        self._run(self.cost.work_time(w), w.prefill_tokens, w.decode_seqs)
        self.last_step_s = self.step_elapsed_s
        return {s.request.request_id: [self._token(s.request)] for s in out.scheduled if s.sample}

    def execute_window(self, out: SchedulerOutput, on_step: Callable[[dict[str, list[int]]], list[str]]) -> None:
        """A multi-step decode window (``--num-scheduler-steps``): up to ``out.num_steps`` decode steps.

        Each inner step is costed and slept on its own, with every context one token longer than
        the step before, and its tokens go to ``on_step`` at once (as on the GPU path); requests
        ``on_step`` no longer lists leave the batch. The win is on the host: one scheduling pass per
        window instead of per token, which is what lets one small machine host many simulated GPUs.
        """
        rows = {s.request.request_id: s for s in out.scheduled}
        self.step_elapsed_s = 0.0
        base = sum(s.start + 1 for s in rows.values())
        try:
            for step in range(out.num_steps):
                n = len(rows)
                self._run(self.cost.time(0, 0.0, n, base + step * n), 0, n)
                active = on_step({rid: [self._token(s.request)] for rid, s in rows.items()})
                if len(active) != n:
                    keep = set(active)
                    rows = {rid: s for rid, s in rows.items() if rid in keep}
                    base = sum(s.start + 1 for s in rows.values())
                if not rows:
                    return
        finally:
            self.last_step_s = self.step_elapsed_s

    def _token(self, r: Request) -> int:
        return self._token_at(r, r.num_tokens)

    def _token_at(self, r: Request, position: int) -> int:
        stop = r.sampling_params.stop_token_ids
        return sim_token_id(r.request_id, position, self.vocab_size, self._eos.union(stop) if stop else self._eos)

    def _account(self, t: float, steps: int, prefill_tokens: int, decode_tokens: int) -> None:
        with self._lock:
            self.stats.busy_s += t
            self.stats.steps += steps
            self.stats.prefill_tokens += prefill_tokens
            self.stats.decode_tokens += decode_tokens

    def _run(self, t: float, prefill_tokens: int, decode_tokens: int) -> None:
        """Accounts one step of ``t`` modelled seconds and sleeps it, scaled and paced."""
        self.step_elapsed_s += t
        self._account(t, 1, prefill_tokens, decode_tokens)
        if self.time_scale > 0:
            now = time.monotonic()
            start = self._deadline if now - self._deadline < _ABSORB_S else now
            self._deadline = start + t * self.time_scale
            if self._deadline > now:
                time.sleep(self._deadline - now)

    def snapshot(self) -> SimStats:
        """A copy of the counters; safe from any thread."""
        with self._lock:
            s = self.stats
            return SimStats(s.busy_s, s.steps, s.prefill_tokens, s.decode_tokens)


def export_metrics(runner: SimRunner, registry: CollectorRegistry) -> None:
    """Publishes the runner's counters on the worker's Prometheus registry (`/metrics`)."""
    from prometheus_client import Gauge

    fields = {"busy_seconds": "modelled seconds of GPU work (unscaled)", "steps": "engine steps run",
              "prefill_tokens": "prompt tokens computed", "decode_tokens": "decode tokens computed"}
    attrs = {"busy_seconds": "busy_s"}
    for name, doc in fields.items():
        attr = attrs.get(name, name)
        Gauge(f"kvmesh_sim_{name}", f"Simulated worker: {doc}", registry=registry).set_function(
            lambda a=attr: float(getattr(runner.snapshot(), a)))
