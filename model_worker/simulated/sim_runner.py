"""A stand-in for ModelRunner: the real scheduler and block pool run, the forward pass is a cost model.

`kvmesh worker --simulate` builds its LLMEngine with a :class:`SimRunner`. Every step it computes
how long a GPU would take for the scheduled batch (a step-time model, model_worker/simulated/step_time.py:
by default the roofline of an H100 serving Llama-3.1-8B), sleeps that long times ``time_scale`` on
the engine thread, and returns deterministic token ids. No weights are loaded and no KV tensors are
allocated, so a laptop can host many "GPUs" whose prefix caches, block events and load reports are
the real ones.

With ``time_scale=0`` nothing sleeps: the modelled duration of each step is only returned
(``last_step_s``; ``step_elapsed_s`` inside a multi-step window), and the virtual-time simulator
(kvmesh/sim/, whose runner runs whole windows: kvmesh/sim/engine.py) advances its own clock by it.

Optional per-step noise (``noise_sigma``): every step's modelled time times a lognormal factor
(median 1), drawn from the runner's own seeded RNG, so a seed gives the same steps.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.contract.types import H100_8B_KV_BLOCKS
from kvmesh.model_worker.config import EngineConfig, ModelConfig
from kvmesh.model_worker.scheduling.host_block_pool import KVTransfers, host_blocks_for
from kvmesh.model_worker.scheduling.output import SchedulerOutput
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.simulated.sim_lora import SimLoRA
from kvmesh.model_worker.simulated.step_time import Roofline, StepTimeModel

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

DEFAULT_SIM_NUM_BLOCKS = H100_8B_KV_BLOCKS

_ABSORB_S = 0.005

DEFAULT_SIM_MAX_MODEL_LEN = 131_072
"""Llama-3.1-8B's context; the Mooncake traces have prompts up to ~125k tokens."""


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
        cost: the step-time model (None: the roofline of an H100, model_worker/simulated/step_time.py).
        time_scale: wall seconds slept per modelled second (0.25 = four times faster than the GPU;
            0 = no sleeping at all).
        noise_sigma: every step's time times exp(noise_sigma x N(0, 1)); 0 = none.
        noise_seed: seeds that noise (the same seed, the same step times).
        lora: simulated LoRA adapters (sim_lora.py): a step waits for the loads of its adapters not in a
            slot; None = no adapters.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, cost: StepTimeModel | None = None,
                 time_scale: float = 1.0, noise_sigma: float = 0.0, noise_seed: int = 0,
                 lora: SimLoRA | None = None) -> None:
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        if noise_sigma < 0:
            raise ValueError(f"noise_sigma must be >= 0, got {noise_sigma}")
        self.config = config
        self.cost = cost or Roofline()
        self.time_scale = time_scale
        self.noise_sigma = noise_sigma
        self._noise = random.Random(noise_seed)
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks if config.num_blocks is not None else DEFAULT_SIM_NUM_BLOCKS
        # NOTE: the host tier has no tensors here: a block's bytes are the modelled model's, its
        # copies a time over the host link (step_time.py).
        self.num_host_blocks = host_blocks_for(config.host_kv_blocks, config.kv_offloading_size,
                                               self.cost.kv_bytes_per_token * config.block_size)
        self._copy_tokens = (0, 0)
        """Tokens the next step loads from and offloads to the host tier."""
        self.host_load_s = 0.0
        """Modelled seconds of host-tier loads so far (the engine reports them)."""
        self.vocab_size = model_config.vocab_size
        self._eos = frozenset(model_config.eos_token_ids)
        self.stats = SimStats()
        self.last_step_s = 0.0
        """Modelled seconds of the last ``execute`` / ``execute_window`` (the engine's step time)."""
        self.step_elapsed_s = 0.0
        """Modelled seconds since the current step began; inside a window, when the inner step whose
        tokens ``on_step`` is given ended."""
        self.lora = lora
        """The adapters' slots and host cache (the engine reads it as its LoRA manager); None without adapters."""
        self.running_adapters: Callable[[], AbstractSet[str]] | None = None
        """The adapters of the engine's running requests (their slots are never evicted); set by the simulator."""
        self._lock = threading.Lock()
        # NOTE: back-to-back steps are paced against a running deadline, so up to
        # _ABSORB_S of host overhead between them is absorbed instead of added (a GPU overlaps
        # the next step's scheduling with this one); a host slower than that slows the simulation.
        self._deadline = 0.0

    def copy_kv_blocks(self, transfers: KVTransfers) -> None:
        """A step's copies between the device and the host tier: timed with the step that follows."""
        bs = self.block_size
        self._copy_tokens = (len(transfers.loads) * bs, len(transfers.offloads) * bs)

    def copy_s(self, forward_s: float) -> float:
        """The step's time with its host-tier copies: its loads before the forward pass (the step
        waits for them), its offloads beside it (they cost only what the forward pass does not hide)."""
        load, offload = self._copy_tokens
        if not load and not offload:
            return forward_s
        self._copy_tokens = (0, 0)
        load_s = self.cost.host_copy_s(load)
        self.host_load_s += load_s
        return load_s + max(forward_s, self.cost.host_copy_s(offload))

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Sleeps for the batch's modelled time; returns request id -> one token for the rows that sample."""
        self.step_elapsed_s = 0.0
        if out.is_empty:
            self.last_step_s = 0.0
            return {}
        w = out.work()
        self._run(self.copy_s(self.cost.work_time(w) * self.jitter()) + self.adapter_load_s(out), w.prefill_tokens,
                  w.decode_seqs)
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
                self._run(self.copy_s(self.cost.time(0, 0.0, n, base + step * n) * self.jitter()), 0, n)
                active = on_step({rid: [self._token(s.request)] for rid, s in rows.items()})
                if len(active) != n:
                    keep = set(active)
                    rows = {rid: s for rid, s in rows.items() if rid in keep}
                    base = sum(s.start + 1 for s in rows.values())
                if not rows:
                    return
        finally:
            self.last_step_s = self.step_elapsed_s

    def adapter_load_s(self, out: SchedulerOutput) -> float:
        """Seconds the step waits for its adapters' loads into GPU slots (0 without adapters)."""
        if self.lora is None:
            return 0.0
        running = self.running_adapters() if self.running_adapters is not None else ()
        return self.lora.load_s((s.request.lora_name for s in out.scheduled if s.request.lora_name), running)

    def jitter(self) -> float:
        """The next step's noise factor (1.0 without noise)."""
        if not self.noise_sigma:
            return 1.0
        return math.exp(self.noise_sigma * self._noise.gauss(0.0, 1.0))

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
