"""Runs one scheduled step on the model: packs the batch, runs the forward pass, samples.

A multi-step window (``SchedulerOutput.num_steps > 1``) runs in ``execute_window``: several decode
passes whose inputs are advanced in place on the device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from kvmesh.kernels import lora_groups
from kvmesh.kernels.attention_configs import check_head_shape
from kvmesh.kernels.dispatch import attention_backend
from kvmesh.model_worker.config import EngineConfig, ModelConfig
from kvmesh.model_worker.execution.compile import CompiledForward
from kvmesh.model_worker.execution.cpu_threads import apply_cpu_threads, set_cpu_threads
from kvmesh.model_worker.execution.forward_context import (
    AttentionMetadata,
    ForwardContext,
    LoRAMetadata,
    forward_context,
)
from kvmesh.model_worker.execution.graph_runner import DecodeGraphs, capture_sizes
from kvmesh.model_worker.execution.host_allocator import keep_freed_buffers
from kvmesh.model_worker.execution.input_packing import (
    LastSampled,
    decode_rows,
    pack_inputs,
    slot_mapping,
    to_device,
)
from kvmesh.model_worker.execution.kv_offload import HostKVCache, check_host_memory
from kvmesh.model_worker.execution.lora_manager import LoRAManager
from kvmesh.model_worker.execution.memory import (
    DeviceMemory,
    Footprint,
    activation_reserve,
    graph_reserve,
    kv_cache_budget,
    process_memory,
    worker_share,
)
from kvmesh.model_worker.execution.model_loader import load_model
from kvmesh.model_worker.execution.sampler import Sampler
from kvmesh.model_worker.execution.warmup import WarmupReport, warm_up
from kvmesh.model_worker.scheduling.host_block_pool import KVTransfers, host_blocks_for
from kvmesh.model_worker.scheduling.kv_cache_manager import check_host_tier
from kvmesh.model_worker.scheduling.kv_cache_spec import KVCacheConfig
from kvmesh.model_worker.scheduling.output import SchedulerOutput
from kvmesh.model_worker.scheduling.request import Request

__all__ = ["ModelRunner", "PendingTokens", "kv_bytes_per_block", "set_cpu_threads"]
"""``set_cpu_threads`` is cpu_threads.py's, named here too for its older importers (the benchmarks, the CLI)."""

log = logging.getLogger(__name__)

WindowStepCallback = Callable[[dict[str, list[int]]], list[str]]
"""Called after each inner step of a window with request id -> its token; returns the ids still running."""


class PendingTokens:
    """A launched step's sampled tokens on their way to the host (async scheduling).

    Args:
        request_ids: the sampling rows' requests, in row order.
        wait: waits for the copy and returns the tokens (row order); None when nothing samples.
    """

    __slots__ = ("_request_ids", "_wait")

    def __init__(self, request_ids: list[str], wait: Callable[[], list[int]] | None) -> None:
        self._request_ids = request_ids
        self._wait = wait

    def wait(self) -> dict[str, list[int]]:
        """Request id -> its token, once the copy is done (what ``execute`` returns)."""
        if self._wait is None:
            return {}
        return {rid: [t] for rid, t in zip(self._request_ids, self._wait(), strict=True)}


_DEFAULT_CPU_FRACTION = 0.05
_DEFAULT_GPU_FRACTION = 0.9
_DEVICES_COUNTED: set[int] = set()
"""CUDA devices whose first engine in this process counted the process's memory (its CUDA context)."""


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Bytes one block takes, K and V, over ``num_layers`` layers (default all: one KV cache group).

    With several groups a block id is one page in each of ``layers_per_group`` tensors, so a block
    costs ``layers_per_group`` pages (kv_cache_spec.py).
    """
    elem = torch.empty((), dtype=dtype).element_size()
    layers = cfg.num_layers if num_layers is None else num_layers
    return 2 * layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    """Owns the model, its paged KV cache and the sampler.

    Args:
        config: the checked engine config.
        model_config: the model's parsed config.json.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_buffers()  # NOTE: process-wide; see host_allocator.py for why and the cost
            apply_cpu_threads()
        if self.device.type == "cuda" and self.device.index is not None:
            # NOTE: graph captures, Triton launches and the side stream use the current device.
            torch.cuda.set_device(self.device)
        if attention_backend(self.device) == "triton":
            # NOTE: before anything is loaded: a head shape the kernel cannot run is refused, never served wrong.
            check_head_shape(model_config.num_heads, model_config.num_kv_heads, model_config.head_dim)
        self._share: tuple[Footprint, int] | None = None
        if self.device.type == "cuda" and config.num_blocks is None:
            # NOTE: before anything is loaded, and refused at once when the share is not free. What
            # torch caches but does not use (an earlier engine of this process) is given back first.
            torch.cuda.empty_cache()
            memory = DeviceMemory.read(self.device)
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            footprint = Footprint(memory, torch.cuda.memory_reserved(self.device),
                                  counts_process=index not in _DEVICES_COUNTED)
            _DEVICES_COUNTED.add(index)
            share = worker_share(memory, config.memory_fraction or _DEFAULT_GPU_FRACTION, footprint.held_at_start)
            self._share = (footprint, share)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.model = load_model(config.model, model_config, self.dtype, config.device)
        # NOTE: before the compiled forward and the graphs are made: they see the wrapped projections.
        self.lora = LoRAManager.for_engine(self.model, self.model_config, self.config)
        """The LoRA adapters and their device slots (--enable-lora); None = the base model only."""
        self.kv_cache_config = KVCacheConfig.from_sliding_windows(model_config.sliding_windows, self.block_size)
        self.compiled = CompiledForward(self.model) if config.compile else None
        """The compiled forward pass (--compile); None = the eager model."""
        self.graphs = self._decode_graphs_for_device()
        """Decode steps replayed from CUDA graphs (CUDA without --enforce-eager); None = eager."""
        self.num_blocks = self._decide_num_blocks()
        self._allocate_kv_cache()
        self.host_kv = self._allocate_host_tier()
        self.num_host_blocks = self.host_kv.blocks.shape[0] if self.host_kv is not None else 0
        self.sampler = Sampler(config.seed)
        self._copy_stream: torch.cuda.Stream | None = None
        self._last_sampled: LastSampled | None = None
        """The last launched step's sampled ids (on the device) and each request's row: the input ids
        of the next step's placeholders (async scheduling)."""
        self.warmup_report: WarmupReport | None = None

    def _lora_rows(self, out: SchedulerOutput) -> list[int] | None:
        """Each scheduled row's adapter slot (-1 = base model), its adapters put in slots first; None without LoRA."""
        if self.lora is None:
            return None
        names = [s.request.lora_name for s in out.scheduled]
        slot_of = self.lora.slots_for(n for n in names if n)
        return [slot_of[n] if n else -1 for n in names]

    def _lora_metadata(self, out: SchedulerOutput, rows: list[int] | None) -> LoRAMetadata | None:
        """The step's per-token adapter slots (each row's, repeated over its new tokens)."""
        if rows is None:
            return None
        counts = torch.tensor([s.num_new_tokens for s in out.scheduled])
        slots = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int32), counts)
        groups = lora_groups(slots) if attention_backend(self.device) == "torch" else None
        return LoRAMetadata(to_device(slots, self.device), groups)

    def warm_up(self) -> WarmupReport:
        """Runs every shape the scheduler can produce once (compiles, Triton JITs, graph captures), so
        that no request pays for them; the worker calls it before it reports SERVING."""
        self.warmup_report = warm_up(self)
        return self.warmup_report

    def decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Static decode buffers for this model and config; ``capture=False`` runs their padded
        steps eagerly (what the CPU tests check)."""
        cfg = self.config
        assert cfg.max_model_len is not None
        return DecodeGraphs(
            self._forward_logits,
            sizes=capture_sizes(cfg.max_num_seqs, cfg.cuda_graph_sizes),
            num_groups=len(self.kv_cache_config.groups),
            max_blocks=-(-cfg.max_model_len // self.block_size),
            block_size=self.block_size,
            vocab_size=self.model_config.vocab_size,
            device=self.device,
            capture=capture,
            append_only_tables=self.kv_cache_config.full_attention_only,
            lora=self.lora is not None,
        )

    def _decode_graphs_for_device(self) -> DecodeGraphs | None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if attention_backend(self.device) != "triton":
            log.warning("no CUDA graphs: the torch attention backend reads its metadata on the host, which a "
                        "graph cannot replay (unset KVMESH_ATTENTION_BACKEND, or pass --enforce-eager)")
            return None
        return self.decode_graphs(capture=True)

    def _allocate_host_tier(self) -> HostKVCache | None:
        """The host KV tier's memory (kv_offload.py), or None when none is asked for."""
        cfg = self.config
        if not cfg.host_tier:
            return None
        check_host_tier(self.kv_cache_config, cfg.enable_prefix_caching)
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.dtype)
        n = host_blocks_for(cfg.host_kv_blocks, cfg.kv_offloading_size, per_block)
        check_host_memory(n, per_block)
        attns = self.model.kv_caches()
        return HostKVCache([(a.k_cache, a.v_cache) for a in attns], n)

    def copy_kv_blocks(self, transfers: KVTransfers) -> None:
        """Runs a step's copies between the device KV cache and the host tier, before its forward pass."""
        assert self.host_kv is not None, "KV transfers without a host tier"
        self.host_kv.copy(transfers)

    @property
    def host_load_s(self) -> float:
        """Seconds spent loading host-tier blocks so far (kv_offload.HostKVCache.load_s)."""
        return self.host_kv.load_s if self.host_kv is not None else 0.0

    def _decide_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        kvc = self.kv_cache_config
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.dtype, kvc.layers_per_group)
        assert cfg.max_model_len is not None
        blocks_per_seq = kvc.max_blocks_per_request(cfg.max_model_len, cfg.max_num_batched_tokens)
        if self.device.type == "cuda":
            assert self._share is not None
            footprint, share = self._share
            mc = self.model_config
            # NOTE: this engine's weights, static decode buffers and library workspaces, by this
            # process's own figures: never what another process took meanwhile (memory.py).
            held = footprint.held(process_memory(self.device), torch.cuda.memory_reserved(self.device))
            graphs = self.graphs.max_size if self.graphs is not None else 0
            budget = kv_cache_budget(
                share,
                held=held,
                # NOTE: activations of one step are bounded by the token budget; keep room for them.
                activations=activation_reserve(cfg.max_num_batched_tokens, mc.hidden_size, mc.intermediate_size),
                graphs=graph_reserve(graphs, mc.hidden_size, mc.intermediate_size, mc.vocab_size),
            )
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = int(available * (cfg.memory_fraction or _DEFAULT_CPU_FRACTION))
            # Enough for every sequence at full length is all a CPU worker can use.
            budget = min(budget, (cfg.max_num_seqs * blocks_per_seq + 1) * per_block)
        num_blocks = budget // per_block
        if num_blocks < blocks_per_seq + 1:
            raise ValueError(
                f"the KV cache budget ({budget / 2**20:.0f} MiB) holds {num_blocks} blocks, fewer than "
                f"one max_model_len sequence needs ({blocks_per_seq + 1}); raise --memory-fraction, set "
                "--num-blocks, or lower --max-model-len (or --max-num-batched-tokens, --max-num-seqs)"
            )
        return num_blocks

    def _allocate_kv_cache(self) -> None:
        mc = self.model_config
        shape = (self.num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        # NOTE: block 0 is the null block: padding entries of block tables (and a sliding window's
        # dropped blocks) point at it, never written. Groups hold disjoint block ids of one pool, so
        # the j-th layer of every group shares the j-th tensor pair: layers_per_group pairs in all.
        kvc = self.kv_cache_config
        pairs = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(kvc.layers_per_group)
        ]
        attns = self.model.kv_caches()
        for g, group in enumerate(kvc.groups):
            for j, layer in enumerate(group.layer_ids):
                attns[layer].k_cache, attns[layer].v_cache = pairs[j]
                attns[layer].kv_group = g
        self.attention_layers = attns

    def prepare_inputs(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata], torch.Tensor]:
        """Packs the step (input_packing.py): token ids, positions, attention metadata per KV cache group, rows
        to sample; a placeholder token (async scheduling) reads the step launched before from the device."""
        return pack_inputs(out, self.block_size, self.device, self._last_sampled)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Runs the scheduled batch; returns request id -> sampled tokens for the rows that sample."""
        for request_id in out.finished_ids:
            self.sampler.release(request_id)
        if out.is_empty:
            return {}
        graphs = self.graphs
        lora_rows = self._lora_rows(out)
        if graphs is not None and self._graph_decode(out):
            graphs.load(*decode_rows(out), lora_slots=lora_rows)
            logits = graphs.run()
            rows = [s.request for s in out.scheduled]
            tokens = self.sampler.sample(logits, [r.sampling_params for r in rows], [r.request_id for r in rows])
            return {r.request_id: [t] for r, t in zip(rows, tokens, strict=True)}
        input_ids, positions, metas, sample_rows = self.prepare_inputs(out)
        hidden = self.forward(input_ids, positions, metas, self._lora_metadata(out, lora_rows))
        sampling = [s.request for s in out.scheduled if s.sample]
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])
        tokens = self.sampler.sample(
            logits, [r.sampling_params for r in sampling], [r.request_id for r in sampling]
        )
        return {r.request_id: [t] for r, t in zip(sampling, tokens, strict=True)}

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> PendingTokens:
        """Async scheduling: runs the batch and samples on the device, starts copying the tokens to
        the host and returns without waiting for them; the next step may be planned and launched
        first. A row whose last input token is a placeholder (sampled by the step launched before
        this one) reads it from that step's ids on the device."""
        for request_id in out.finished_ids:
            self.sampler.release(request_id)
        if out.is_empty:
            return PendingTokens([], None)
        graphs = self.graphs
        lora_rows = self._lora_rows(out)
        if graphs is not None and self._graph_decode(out):
            token_ids, positions, tables = decode_rows(out)
            sources = None
            if any(s.start >= s.request.num_tokens for s in out.scheduled):
                assert self._last_sampled is not None, "a placeholder token without a step in flight"
                sampled, row_of = self._last_sampled
                sources = [row_of[s.request.request_id] if s.start >= s.request.num_tokens else -1
                           for s in out.scheduled]
            graphs.load(token_ids, positions, tables, sources, lora_slots=lora_rows)
            if sources is not None:
                graphs.take_tokens(sampled)
            logits = graphs.run()
            rows = [s.request for s in out.scheduled]
        else:
            input_ids, positions, metas, sample_rows = self.prepare_inputs(out)
            hidden = self.forward(input_ids, positions, metas, self._lora_metadata(out, lora_rows))
            rows = [s.request for s in out.scheduled if s.sample]
            if not rows:
                self._last_sampled = None
                return PendingTokens([], None)
            logits = self.model.compute_logits(hidden[sample_rows])
        ids = self.sampler.sample_on_device(logits, [r.sampling_params for r in rows], [r.request_id for r in rows])
        self._last_sampled = (ids, {r.request_id: i for i, r in enumerate(rows)})
        return PendingTokens([r.request_id for r in rows], self._copy_to_host(ids))

    @torch.inference_mode()
    def execute_window(self, out: SchedulerOutput, on_step: WindowStepCallback) -> None:
        """Runs up to ``out.num_steps`` decode passes on an all-decode batch (multi-step decode).

        Step i+1's inputs come from step i's in place: the sampled ids stay on the device and are
        the next input ids, positions and KV lengths advance by one, slots are read from the block
        tables (which hold the window's lookahead blocks). ``on_step`` gets each step's tokens as
        soon as they are on the host; rows of requests it no longer lists leave the batch.

        On CUDA the device-to-host copy runs on a side stream and the next step is launched before
        waiting for it, so stop checks and streaming overlap the GPU; a request that stopped has
        then one extra token computed, which the scheduler drops (it is no longer running). On the
        CPU every step's tokens are handed over before the next step runs.
        """
        for request_id in out.finished_ids:
            self.sampler.release(request_id)
        graphs = self.graphs if self.graphs is not None and self._graph_decode(out) else None
        lora_rows = self._lora_rows(out)
        lora = None
        if graphs is not None:
            graphs.load(*decode_rows(out), lora_slots=lora_rows)
        else:
            input_ids, positions, metas, _ = self.prepare_inputs(out)
            lora = self._lora_metadata(out, lora_rows)
        rows: list[Request] = [s.request for s in out.scheduled]
        overlap = self.device.type == "cuda"
        pending: tuple[list[Request], Callable[[], list[int]]] | None = None

        def deliver(batch: list[Request], wait: Callable[[], list[int]]) -> set[str]:
            tokens = wait()
            return set(on_step({r.request_id: [t] for r, t in zip(batch, tokens, strict=True)}))

        for step in range(out.num_steps):
            if graphs is not None:
                logits = graphs.run()  # NOTE: it also moves positions and KV lengths to the next step
            elif step > 0:
                positions = positions + 1
                kv_lens = metas[0].kv_lens + 1
                metas = [
                    AttentionMetadata(
                        slot_mapping=slot_mapping(m.block_tables, positions, self.block_size),
                        cu_q_lens=m.cu_q_lens,
                        kv_lens=kv_lens,
                        block_tables=m.block_tables,
                    )
                    for m in metas
                ]
            if graphs is None:
                logits = self.model.compute_logits(self.forward(input_ids, positions, metas, lora))
            input_ids = self.sampler.sample_on_device(
                logits, [r.sampling_params for r in rows], [r.request_id for r in rows]
            )
            if graphs is not None:
                graphs.feed(input_ids)
            wait = self._copy_to_host(input_ids)
            if overlap:
                # NOTE: the previous step's tokens are handled while this one runs on the GPU.
                keep = deliver(*pending) if pending is not None else {r.request_id for r in rows}
                pending = (rows, wait)
            else:
                keep = deliver(rows, wait)
            if step + 1 == out.num_steps:
                break
            idx = [i for i, r in enumerate(rows) if r.request_id in keep]
            if not idx:
                break
            if len(idx) < len(rows):
                # NOTE: a finished request's blocks are freed at once. On CUDA its in-flight step
                # may still write one slot past its last committed token: that block is not full
                # of committed tokens, so it is not cached, and nothing allocates during a window.
                sel = torch.tensor(idx, dtype=torch.int64, device=self.device)
                rows = [rows[i] for i in idx]
                if graphs is not None:
                    graphs.keep(sel)
                    continue
                input_ids, positions = input_ids[sel], positions[sel]
                lora = lora.select(sel) if lora is not None else None
                cu_q_lens = torch.arange(len(idx) + 1, dtype=torch.int32, device=self.device)
                kv_lens = metas[0].kv_lens[sel]
                metas = [
                    AttentionMetadata(
                        slot_mapping=m.slot_mapping[sel],
                        cu_q_lens=cu_q_lens,
                        kv_lens=kv_lens,
                        block_tables=m.block_tables[sel],
                    )
                    for m in metas
                ]
        if pending is not None:
            deliver(*pending)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata],
                lora: LoRAMetadata | None = None) -> torch.Tensor:
        """The model's hidden states ``[T, hidden]`` for one packed batch (compiled with --compile); ``lora``:
        each token's adapter slot (with --enable-lora; none given = every token on the base model)."""
        if lora is None and self.lora is not None:
            # NOTE: the LoRA path runs whatever the batch (warm-up batches too: the kernels JIT there).
            lora = LoRAMetadata(torch.full(input_ids.shape, -1, dtype=torch.int32, device=input_ids.device), [])
        with forward_context(ForwardContext(self.attention_layers, metas, lora)):
            if self.compiled is not None:
                return self.compiled(input_ids, positions)
            return self.model(input_ids, positions)

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        metas: list[AttentionMetadata], lora: LoRAMetadata | None = None) -> torch.Tensor:
        return self.model.compute_logits(self.forward(input_ids, positions, metas, lora))

    def _graph_decode(self, out: SchedulerOutput) -> bool:
        """Whether the step is a decode batch a graph holds: one new token per row, every row samples."""
        assert self.graphs is not None
        return self.graphs.fits(len(out.scheduled)) and all(
            s.num_new_tokens == 1 and s.sample for s in out.scheduled)

    def _copy_to_host(self, ids: torch.Tensor) -> Callable[[], list[int]]:
        """Starts copying ``ids`` to the host; the returned function waits for it and gives the list."""
        if self.device.type != "cuda":
            return ids.tolist
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = self._copy_stream
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        done = torch.cuda.Event()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host.copy_(ids, non_blocking=True)
            done.record(stream)
        # NOTE: ids was made on the compute stream and is read on the copy stream.
        ids.record_stream(stream)

        def wait() -> list[int]:
            done.synchronize()
            return host.tolist()

        return wait
