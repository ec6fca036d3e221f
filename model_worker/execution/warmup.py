"""Warm start: before a worker serves, it runs every shape its scheduler can produce once.

What a first call pays (and a request must not): a Triton kernel's JIT per specialisation, each
graph of the compiled forward pass, a CUDA graph per decode batch size, a library's lazy set-up
(cuBLAS handles, oneDNN primitives, CUDA's lazy module loading). ``warmup_batches`` lists the
dummy batches that reach each of them; ``warm_up`` runs them through the runner's own path, with
every slot -1 (nothing is written to the KV cache) and block tables of null blocks.

The engine then runs one request through its whole step path (llm_engine.py, ``_warm_step_path``):
what no dummy batch reaches (the scheduler, input packing and its pinned host buffers, the sampler
on a real batch, the async launch and commit) is first used there, not by a client's request.

What varies between the Triton specialisations is the tile (decode-heavy or prefill-heavy
batches) and split-KV (decided from shapes: a short grid and a wide block table); the integer
arguments that vary per batch are not specialised (kernels/triton_attention.py,
``do_not_specialize``). The compiled forward pass specialises ``T = 1`` apart from ``T >= 2``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.execution.forward_context import AttentionMetadata

if TYPE_CHECKING:
    from kvmesh.model_worker.config import EngineConfig
    from kvmesh.model_worker.execution.compile import CompiledForward
    from kvmesh.model_worker.execution.graph_runner import DecodeGraphs
    from kvmesh.model_worker.execution.sampler import Sampler
    from kvmesh.model_worker.scheduling.kv_cache_spec import KVCacheConfig

log = logging.getLogger(__name__)

_REQUEST_ID = "__warm-up__"


@dataclass(frozen=True, slots=True)
class WarmupBatch:
    """A dummy batch: sequence s has ``q_lens[s]`` new tokens and no earlier ones."""

    q_lens: tuple[int, ...]
    table_width: int
    """Blocks per block-table row (a wide table is what turns split-KV on for short grids)."""

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


@dataclass(slots=True)
class WarmupReport:
    seconds: float
    """Wall time of the whole warm-up."""
    batches: int
    """Dummy batches run eagerly."""
    graphs: int
    """CUDA graphs captured."""
    compiles: int
    """Graphs of the compiled forward pass compiled (0 without --compile, or when an earlier engine of
    this process compiled this model shape already)."""
    compile_s: float
    """Of ``seconds``, spent in inductor."""

    def __str__(self) -> str:
        parts = [f"{self.batches} batch shapes"]
        if self.compiles:
            parts.append(f"{self.compiles} compiled graphs ({self.compile_s:.1f} s in inductor)")
        if self.graphs:
            parts.append(f"{self.graphs} CUDA graphs")
        return f"warm-up took {self.seconds:.1f} s: " + ", ".join(parts)


def warmup_batches(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
                   prefill_classes: bool = False) -> list[WarmupBatch]:
    """The dummy batches of a warm-up, in the order they run: one of each shape class, and with
    ``prefill_classes`` a prefill of every power of two from 16 below the longest chunk (CUDA: the
    matrix products of a prompt length pick their kernels by size class, and CUDA loads each kernel's
    module on first use)."""
    widest = -(-max_model_len // block_size)
    longest = max(1, min(max_num_batched_tokens, max_model_len - 1))  # a prompt is < max_model_len
    seqs = min(max_num_seqs, max_num_batched_tokens)

    def cover(n: int) -> int:
        return -(-n // block_size)

    mixed_seqs = min(seqs, 3)
    mixed_tail = max(1, min(longest, max_num_batched_tokens - (mixed_seqs - 1), 2 * mixed_seqs + 1))
    mixed = WarmupBatch((1,) * (mixed_seqs - 1) + (mixed_tail,), cover(mixed_tail))
    batches = [
        WarmupBatch((1,), 1),  # decode of one sequence, T = 1
        WarmupBatch((1,), widest),  # the same with split-KV (GPU)
        WarmupBatch((1,) * seqs, widest),  # the largest decode batch
        WarmupBatch((longest,), cover(longest)),  # the longest prefill chunk
        mixed,  # decodes beside a prefill chunk
    ]
    if prefill_classes:
        batches += [WarmupBatch((n,), cover(n)) for n in (1 << k for k in range(4, longest.bit_length()))
                    if n < longest]
    return list(dict.fromkeys(batches))


def dummy_inputs(batch: WarmupBatch, num_groups: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
    """Token ids (0), positions and metadata of ``batch``: slots -1 (no KV write), null-block tables."""
    q_lens = torch.tensor(batch.q_lens, dtype=torch.int32)
    cu = torch.zeros(len(batch.q_lens) + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=cu[1:])
    positions = torch.cat([torch.arange(n) for n in batch.q_lens])
    tables = torch.zeros((len(batch.q_lens), batch.table_width), dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch.num_tokens,), -1, dtype=torch.int64, device=device),
        cu_q_lens=cu.to(device),
        kv_lens=q_lens.to(device),
        block_tables=tables,
    )
    ids = torch.zeros(batch.num_tokens, dtype=torch.int64, device=device)
    return ids, positions.to(device), [meta] * num_groups


class WarmupRunner(Protocol):
    """What the warm-up needs of the model runner (model_runner.py's ModelRunner, which calls
    :func:`warm_up` on itself: so the warm-up names the shape, not the class)."""

    config: EngineConfig
    device: torch.device
    block_size: int
    kv_cache_config: KVCacheConfig
    model: Any
    """The loaded model (``compute_logits``)."""
    compiled: CompiledForward | None
    graphs: DecodeGraphs | None
    sampler: Sampler

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metas: list[AttentionMetadata]) -> torch.Tensor: ...


@torch.inference_mode()
def warm_up(runner: WarmupRunner) -> WarmupReport:
    """Runs the warm-up batches, then captures the decode graphs; logs and returns what it did."""
    start = time.perf_counter()
    cfg = runner.config
    assert cfg.max_model_len is not None
    compiled = runner.compiled
    compiles_before = compiled.num_compiles if compiled is not None else 0
    inductor_before = compiled.compile_s if compiled is not None else 0.0
    # NOTE: on an eager CPU worker too: the largest batches set up the allocator's buffers and
    # oneDNN's primitives, which the first request would pay for (benchmarks/warm_start_bench.py).
    batches = warmup_batches(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, runner.block_size,
                             prefill_classes=runner.device.type == "cuda")
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, top_k=5, seed=0)
    for batch in batches:
        ids, positions, metas = dummy_inputs(batch, len(runner.kv_cache_config.groups), runner.device)
        hidden = runner.forward(ids, positions, metas)
        rows = torch.tensor(metas[0].cu_q_lens[1:].tolist(), device=runner.device) - 1
        logits = runner.model.compute_logits(hidden[rows])
        # NOTE: a seeded request's own generator: the shared one (unseeded requests) stays untouched.
        n = logits.shape[0]
        runner.sampler.sample_on_device(logits, [greedy, sampled][:n] + [greedy] * (n - 2), [_REQUEST_ID] * n)
        runner.sampler.release(_REQUEST_ID)
    graphs = runner.graphs
    if graphs is not None:
        if graphs.capture:
            graphs.capture_all()
        else:
            graphs.warm_up()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    report = WarmupReport(
        seconds=time.perf_counter() - start,
        batches=len(batches),
        graphs=graphs.num_captured if graphs is not None else 0,
        compiles=compiled.num_compiles - compiles_before if compiled is not None else 0,
        compile_s=compiled.compile_s - inductor_before if compiled is not None else 0.0,
    )
    log.info("%s", report)
    return report
