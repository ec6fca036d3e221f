"""How long one engine step takes on a simulated GPU: the roofline model (default) and the linear one.

Both answer one question, :meth:`StepTimeModel.time`: the seconds of a forward pass that computes
``prefill_tokens`` new prompt tokens (with ``prefill_pairs`` attention pairs, sum of
new x (context before + (new + 1) / 2) over the chunks) and decodes ``decode_seqs`` sequences
attending to ``decode_context_tokens`` tokens in all. These are the work counters a worker
reports (kvmesh.contract.types.Load), so a router learns step cost from the same units; it never
sees the model's parameters.

The roofline (:class:`Roofline`, docs/benchmarks.md "Cost model" has every figure's source):

    flops = 2 * params * (prefill_tokens + decode_seqs) + 4 * layers * hidden * (prefill_pairs + decode_context)
    bytes = weight_bytes + kv_bytes_per_token * (decode_context + prefill_tokens)
    t     = max(bytes / (bandwidth * MBU), flops / (peak_flops * MFU)) + launch_s

A decode step at small batch reads the weights and the KV it attends to (memory bound); a large
prefill chunk is bound by its FLOPs, and the decodes that share its step ride along at no memory
cost. A least-squares fit of the linear form below cannot represent that max exactly.

A host KV tier's copies (:meth:`StepTimeModel.host_copy_s`) cross the host link (PCIe, or NVLink-C2C
on a GH200): ``t = tokens * kv_bytes_per_token / host_link_bandwidth`` one way. The simulated runner
(sim_runner.py) adds a step's loads (the step waits for them) and the part of its offloads the step
does not hide: ``t_step = t_load + max(t_forward, t_offload)``, as the CUDA runner overlaps them
(model_worker/execution/kv_offload.py).

The linear model (:class:`LinearCost`) is the simulator's step time until 2026-11-23, kept
selectable (``--sim-cost-model linear``) because older results used it.

This module imports neither torch, grpc nor redis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.contract.settings import flag

if TYPE_CHECKING:
    from kvmesh.model_worker.scheduling.output import SchedulerOutput, StepWork

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a step's FLOPs and bytes depend on: a dense decoder's size and attention shape."""

    name: str
    params: float
    """Parameters (every one read per step, two FLOPs per token each)."""
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    """bf16."""

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_flops_per_pair(self) -> int:
        """One (query, context token) pair: QK^T and PV, 2 x hidden FLOPs each, per layer."""
        return 4 * self.layers * self.hidden


LLAMA_31_8B = ModelShape("Llama-3.1-8B", params=8.03e9, layers=32, hidden=4096, kv_heads=8, head_dim=128)
"""meta-llama/Llama-3.1-8B's config.json (32 layers, hidden 4096, 8 KV heads of 128): 128 KiB of KV
per token, 16.06 GB of bf16 weights."""


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU type serving one model replica (sources: docs/benchmarks.md, "Cost model")."""

    name: str
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s (the datasheet's figure without sparsity)."""
    bandwidth: float
    """Memory bandwidth, bytes/s."""
    memory_gib: float
    """The datasheet's GB, taken as GiB (the driver reports ~80 GiB on the 80 GB parts)."""
    mfu: float
    """Share of ``peak_flops`` a step reaches (GEMMs and attention together)."""
    mbu: float
    """Share of ``bandwidth`` a step reaches."""
    launch_s: float = 0.001
    """Per step: kernel launches, sampling, scheduling not hidden behind the GPU."""
    host_link_bandwidth: float = 50e9
    """Host <-> device copy bandwidth, one direction, bytes/s (the host KV tier's link): PCIe Gen5 x16
    ~50 GB/s effective, NVLink-C2C (GH200) ~360 GB/s."""

    def kv_tokens(self, model: ModelShape = LLAMA_31_8B, memory_utilization: float = 0.9,
                  activation_gib: float = 3.0) -> int:
        """Tokens of KV the GPU holds: ``memory_utilization`` of its memory, less the weights (whole
        GiB, as allocated) and an activation reserve."""
        weights_gib = math.ceil(model.weight_bytes / GIB)
        free = memory_utilization * self.memory_gib - weights_gib - activation_gib
        return max(0, int(free * GIB) // model.kv_bytes_per_token)


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("H100", peak_flops=989.4e12, bandwidth=3.35e12, memory_gib=80, mfu=0.35, mbu=0.75,
            host_link_bandwidth=50e9),
    GpuSpec("H200", peak_flops=989.4e12, bandwidth=4.8e12, memory_gib=141, mfu=0.35, mbu=0.75,
            host_link_bandwidth=50e9),
    GpuSpec("A100", peak_flops=312e12, bandwidth=2.039e12, memory_gib=80, mfu=0.50, mbu=0.80,
            host_link_bandwidth=25e9),
    GpuSpec("GH200", peak_flops=989.4e12, bandwidth=4.0e12, memory_gib=96, mfu=0.35, mbu=0.75,
            host_link_bandwidth=360e9),
)}
"""The simulator's GPU types (SXM parts; A100 = the 80 GB one; GH200 = the Hopper of a Grace Hopper
superchip, 96 GB HBM3, its host memory behind NVLink-C2C)."""

DEFAULT_GPU = "H100"


def gpu_spec(name: str) -> GpuSpec:
    """The GPU type named ``name`` (case-insensitive); ValueError naming the known ones."""
    for key, spec in GPUS.items():
        if key.lower() == name.strip().lower():
            return spec
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")


class StepTimeModel:
    """Seconds one step takes, from the work counters of the step (module doc)."""

    __slots__ = ()

    def time(self, prefill_tokens: int, prefill_pairs: float, decode_seqs: int, decode_context_tokens: int) -> float:
        """Seconds one step with this work takes (0 for no work at all)."""
        raise NotImplementedError

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

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token (K and V, every layer): what the host KV tier moves per token."""
        raise NotImplementedError

    def host_copy_s(self, tokens: int) -> float:
        """Seconds to move ``tokens`` tokens of KV one way between device and host memory."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Roofline(StepTimeModel):
    """The roofline step time of ``model`` on ``gpu`` (module doc)."""

    gpu: GpuSpec = field(default_factory=lambda: GPUS[DEFAULT_GPU])
    model: ModelShape = LLAMA_31_8B
    # NOTE: the formula's constants, folded once: time() runs for every simulated (inner) step.
    _token_s: float = field(init=False, repr=False, compare=False)
    _pair_s: float = field(init=False, repr=False, compare=False)
    _weights_s: float = field(init=False, repr=False, compare=False)
    _kv_token_s: float = field(init=False, repr=False, compare=False)
    _host_token_s: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        flops = self.gpu.peak_flops * self.gpu.mfu
        bandwidth = self.gpu.bandwidth * self.gpu.mbu
        object.__setattr__(self, "_token_s", 2 * self.model.params / flops)
        object.__setattr__(self, "_pair_s", self.model.attn_flops_per_pair / flops)
        object.__setattr__(self, "_weights_s", self.model.weight_bytes / bandwidth)
        object.__setattr__(self, "_kv_token_s", self.model.kv_bytes_per_token / bandwidth)
        object.__setattr__(self, "_host_token_s", self.model.kv_bytes_per_token / self.gpu.host_link_bandwidth)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def host_copy_s(self, tokens: int) -> float:
        return self._host_token_s * tokens

    def time(self, prefill_tokens: int, prefill_pairs: float, decode_seqs: int, decode_context_tokens: int) -> float:
        if not prefill_tokens and not decode_seqs:
            return 0.0
        compute = self._token_s * (prefill_tokens + decode_seqs) + self._pair_s * (prefill_pairs + decode_context_tokens)
        memory = self._weights_s + self._kv_token_s * (decode_context_tokens + prefill_tokens)
        return (compute if compute > memory else memory) + self.gpu.launch_s

    def compute_s(self, prefill_tokens: int, prefill_pairs: float, decode_seqs: int, decode_context_tokens: int) -> float:
        """The FLOPs term alone (seconds)."""
        return self._token_s * (prefill_tokens + decode_seqs) + self._pair_s * (prefill_pairs + decode_context_tokens)

    def memory_s(self, kv_tokens: float, weight_reads: float = 1.0) -> float:
        """The bytes term alone (seconds): ``kv_tokens`` of KV moved and the weights read ``weight_reads`` times."""
        return self._weights_s * weight_reads + self._kv_token_s * kv_tokens


@dataclass(frozen=True, slots=True)
class LinearCost(StepTimeModel):
    """The linear step time of an H100 serving an 8B model (the simulator's until 2026-11-23).

    Defaults come from public figures: ~16 GFLOP per token for 8B parameters at ~50 % of the
    989 TFLOPS bf16 peak gives ~30k tok/s for the GEMMs; measured vLLM/SGLang prefill of 8B models
    on one H100 is 10-20k tok/s at 2-16k prompt lengths once attention is included; a decode step
    reads the 16 GB of weights at ~3.35 TB/s (~5 ms) plus scheduling/launch overhead, so ITL at
    small batch is ~7-8 ms; KV read is 128 KiB per context token per step at ~3.35 TB/s.

        t = step_overhead_s + prefill_token_s * prefill_tokens + attn_pair_s * prefill_pairs
          + decode_seq_s * decode_seqs + decode_kv_token_s * decode_context_tokens
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
        if not prefill_tokens and not decode_seqs:
            return 0.0
        return (self.step_overhead_s + self.prefill_token_s * prefill_tokens + self.attn_pair_s * prefill_pairs
                + self.decode_seq_s * decode_seqs + self.decode_kv_token_s * decode_context_tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        return LLAMA_31_8B.kv_bytes_per_token  # NOTE: the model its coefficients were set for

    def host_copy_s(self, tokens: int) -> float:
        return tokens * LLAMA_31_8B.kv_bytes_per_token / GPUS[DEFAULT_GPU].host_link_bandwidth


COST_MODELS = ("roofline", "linear")


@dataclass(slots=True)
class StepTimeConfig:
    """A simulated worker's step time (`kvmesh worker --simulate`, `kvmesh simulate`): which model,
    which GPU, how noisy."""

    cost_model: str = flag("roofline", name="sim-cost-model")
    """roofline: the GPU's roofline (docs/benchmarks.md, cost model); linear: the linear model of the --sim-*
    coefficients (an H100 only; the simulator's until 2026-11-23)."""
    gpu: str = flag(DEFAULT_GPU, name="sim-gpu")
    """The GPU type (H100, H200, A100, GH200): its roofline and, unless --num-blocks says otherwise, its KV capacity;
    `kvmesh simulate`: the GPU of a plain --workers N."""
    step_noise: float = flag(0.0, name="sim-step-noise")
    """Every step's time times exp(sigma x N(0, 1)) with this sigma, seeded per worker; 0 = no noise."""

    def check(self) -> None:
        """Raises ValueError with the flag to fix."""
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"--sim-cost-model must be one of {', '.join(COST_MODELS)}, got {self.cost_model!r}")
        gpu_spec(self.gpu)
        if not 0 <= self.step_noise < 1:
            raise ValueError(f"--sim-step-noise must be in [0, 1), got {self.step_noise}")

    def model(self, gpu: str | None = None, linear: LinearCost | None = None) -> StepTimeModel:
        """The step-time model of ``gpu`` (default: ``self.gpu``); ``linear``: the linear model's
        coefficients (the --sim-* flags)."""
        return step_time_model(self.cost_model, gpu or self.gpu, linear)


def step_time_model(kind: str = "roofline", gpu: str = DEFAULT_GPU, linear: LinearCost | None = None) -> StepTimeModel:
    """The step-time model ``kind`` for ``gpu`` (the linear one has an H100's coefficients only)."""
    if kind == "roofline":
        return Roofline(gpu_spec(gpu))
    if kind == "linear":
        if gpu_spec(gpu).name != DEFAULT_GPU:
            raise ValueError(f"the linear cost model has {DEFAULT_GPU} coefficients only, not {gpu}'s: "
                             "use --sim-cost-model roofline")
        return linear or LinearCost()
    raise ValueError(f"unknown cost model {kind!r}; choose from {', '.join(COST_MODELS)}")
