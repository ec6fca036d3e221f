"""Decode steps replayed from CUDA graphs at padded batch sizes.

The idea of nano-vllm's ``capture_cudagraph`` and vLLM's ``CudaGraphManager``: a decode step is a
few hundred small kernels whose launches cost more than their work, so each decode batch size
``B`` of a short list (1, 2, 4, 8, then every 16 up to ``--max-num-seqs``) is captured once, at
start-up, and a step replays its graph: one launch. A batch of ``n`` sequences runs in the graph of
the smallest captured ``B >= n``; larger batches, prefills and mixed steps run as before.

Every input of a step lives in one static int32 buffer, ``[B_max, C]``, one row per sequence:
KV length, a real-row flag, position, token id, where the token is still on the device (async
scheduling), the row's LoRA adapter slot + 1 (0 = the base model, what a padding row holds), then the
block table of each KV cache group.
A step copies its rows in with one host-to-device copy, and the captured body reads them:

1. token ids and positions (as int64), each row's cache slot from its block table, or -1;
2. the forward pass (compiled or eager) and the logits, into a static ``[B_max, vocab]`` buffer;
3. position and KV length + 1 on the real rows: the inputs of a multi-step window's next step,
   which then only needs the sampled ids (``feed``).

NOTE: padding is invisible to real rows. A padding row is token 0 at position 0 with KV length 1,
a block table of null blocks and no slot: it writes nothing, reads only the null block, and every
op of the model is row-wise but attention, which reads each sequence's own blocks. With
``capture=False`` the same buffers, padding and body run eagerly: the CPU tests check the
padding there (tests/model_worker/execution/test_graph_runner.py).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import torch

from kvmesh.model_worker.execution.forward_context import AttentionMetadata, LoRAMetadata

log = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
"""The largest batch captured by default (vLLM's and nano-vllm's bound): larger batches run eagerly,
where a step's launches weigh little against its work."""

# Columns of the static buffer. _SOURCE: 1 + the row of the previous step's sampled ids that holds
# this row's input token (async scheduling), 0 = the token column holds it. _LORA: 1 + the row's LoRA
# slot, 0 = none.
_KV_LEN, _REAL, _POS, _TOKEN, _SOURCE, _LORA = 0, 1, 2, 3, 4, 5
_ALIGN = 4
"""int32 columns per 16 bytes: each block table starts 16-byte aligned (what Triton specialises on)."""
_TABLES = 8

ForwardLogits = Callable[..., torch.Tensor]
"""(token ids ``[T]``, positions ``[T]``, metadata per KV cache group[, LoRA metadata]) -> float32 logits
``[T, vocab]``; the LoRA metadata is passed only by graphs made with ``lora=True``."""


def capture_sizes(max_num_seqs: int, sizes: Sequence[int] = ()) -> list[int]:
    """The decode batch sizes to capture, ascending: ``sizes`` when given, else 1, 2, 4, 8 and
    every multiple of 16 up to ``max_num_seqs`` (capped at :data:`MAX_CAPTURE_SIZE`), plus that
    bound itself, so every batch up to it has a graph."""
    if sizes:
        return sorted(set(sizes))
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    out = {s for s in (1, 2, 4, 8) if s <= top} | set(range(16, top + 1, 16)) | {top}
    return sorted(out)


def _block_ids(blocks: Sequence, start: int) -> list[int]:
    """``blocks[start:]`` as block ids (the KV cache manager's blocks, or ids already)."""
    tail = blocks[start:]
    return [b if isinstance(b, int) else b.block_id for b in tail]


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``n`` rows; None when none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """Static decode buffers and a graph per batch size.

    Args:
        forward_logits: runs the model on a packed batch and returns its logits.
        sizes: the batch sizes, ascending (:func:`capture_sizes`).
        num_groups: KV cache groups (one block table each).
        max_blocks: block table width: blocks of a ``max_model_len`` sequence.
        block_size: tokens per KV block.
        vocab_size: logits width.
        device: where the buffers live.
        capture: capture CUDA graphs (CUDA); False runs the same body eagerly (tests on CPU).
        append_only_tables: the tables :meth:`load` gets are the KV cache manager's own lists, which
            only grow while a request runs (full attention only: KVCacheManager.live_blocks); a
            row that holds the same list as at the last step then writes only its new blocks.
        lora: the model runs LoRA adapters: each row's slot is an input (``load(lora_slots=...)``).
    """

    def __init__(self, forward_logits: ForwardLogits, *, sizes: Sequence[int], num_groups: int, max_blocks: int,
                 block_size: int, vocab_size: int, device: torch.device, capture: bool,
                 append_only_tables: bool = False, lora: bool = False) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.sizes = list(sizes)
        self.max_size = self.sizes[-1]
        self.capture = capture
        self._forward_logits = forward_logits
        self._groups = num_groups
        self._width = max_blocks
        self._stride = -(-max_blocks // _ALIGN) * _ALIGN
        self._block_size = block_size
        self._device = device
        cols = _TABLES + num_groups * self._stride
        self._inputs = torch.zeros((self.max_size, cols), dtype=torch.int32, device=device)
        self._staging = torch.zeros((self.max_size, cols), dtype=torch.int32, pin_memory=device.type == "cuda")
        self._copied: torch.cuda.Event | None = None
        self._cu_q_lens = torch.arange(self.max_size + 1, dtype=torch.int32, device=device)
        self._logits = torch.zeros((self.max_size, vocab_size), dtype=torch.float32, device=device)
        self._append_only = append_only_tables
        self._lora = lora
        # NOTE: what each staging row's table holds, per group: the list it was read from and how
        # many of its entries; past them the row is zero (the invariant load() keeps).
        self._row_src: list[list[Sequence | None]] = [[None] * self.max_size for _ in range(num_groups)]
        self._row_len: list[list[int]] = [[0] * self.max_size for _ in range(num_groups)]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._has_sources = False
        self.num_rows = 0
        """Real rows of the loaded batch."""
        self.size = 0
        """Its padded size: the graph that runs it."""

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def fits(self, n: int) -> bool:
        return 0 < n <= self.max_size

    def load(self, token_ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[Sequence]],
             sources: Sequence[int] | None = None, lora_slots: Sequence[int] | None = None) -> None:
        """Loads a decode batch: row i is token ``token_ids[i]`` at ``positions[i]`` (KV length
        position + 1) with block table ``tables[g][i]`` in group g (block ids, or blocks with a
        ``block_id``); pads it to its graph's size. ``sources[i] >= 0``: the row's token is that row
        of the previous step's sampled ids, still on the device (:meth:`take_tokens`). ``lora_slots[i]``:
        the row's LoRA adapter slot, -1 = none (graphs made with ``lora=True``).

        A row's table is written whole when its list differs from the last step's, else (append-only
        tables) only the blocks appended since: a decode step costs O(rows), not O(context).
        """
        n = len(token_ids)
        size = padded_size(n, self.sizes)
        if size is None or n == 0:
            raise ValueError(f"a decode batch of {n} rows; the captured sizes go up to {self.max_size}")
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has left the pinned staging rows
        host = self._staging
        head = host[:size, :_TABLES]
        head.zero_()
        head[:, _KV_LEN] = 1
        pos = torch.tensor(positions, dtype=torch.int32)
        head[:n, _KV_LEN] = pos + 1
        head[:n, _REAL] = 1
        head[:n, _POS] = pos
        head[:n, _TOKEN] = torch.tensor(token_ids, dtype=torch.int32)
        self._has_sources = sources is not None and any(i >= 0 for i in sources)
        if self._has_sources:
            head[:n, _SOURCE] = torch.tensor(sources, dtype=torch.int32) + 1
        if lora_slots is not None:
            head[:n, _LORA] = torch.tensor(lora_slots, dtype=torch.int32) + 1
        for g, group in enumerate(tables):
            start = _TABLES + g * self._stride
            src, held = self._row_src[g], self._row_len[g]
            for i, blocks in enumerate(group):
                m = len(blocks)
                if m > self._width:
                    raise ValueError(f"a block table of {m} blocks; the buffers hold {self._width}")
                have = held[i] if self._append_only and src[i] is blocks and held[i] <= m else 0
                if have < m:
                    host[i, start + have : start + m] = torch.tensor(_block_ids(blocks, have), dtype=torch.int32)
                if held[i] > m:  # a longer table was here: past this one the row is zero again
                    host[i, start + m : start + held[i]] = 0
                src[i], held[i] = blocks, m
            for i in range(len(group), size):  # padding rows: null tables
                if held[i]:
                    host[i, start : start + held[i]] = 0
                src[i], held[i] = None, 0
        self._inputs[:size].copy_(host[:size], non_blocking=True)
        if self._device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.num_rows, self.size = n, size

    def run(self) -> torch.Tensor:
        """One decode step of the loaded batch: its logits ``[num_rows, vocab]`` (a view of a static
        buffer, valid until the next step). Positions and KV lengths then point at the next step."""
        if not self.capture:
            return self._step(self.size)[: self.num_rows]
        graph = self._graphs.get(self.size)
        if graph is None:
            log.warning("decode graph of %d rows captured while serving (warm-up did not)", self.size)
            graph = self._capture(self.size)
        graph.replay()
        return self._logits[: self.num_rows]

    def take_tokens(self, sampled: torch.Tensor) -> None:
        """Async scheduling: the rows :meth:`load` gave a source take their input id from
        ``sampled`` (the previous step's ids, on the device), without a host sync. Before :meth:`run`."""
        if not self._has_sources:
            return
        rows = self._inputs[: self.size]
        source = rows[:, _SOURCE].long()
        picked = sampled.to(torch.int32)[(source - 1).clamp_(0, sampled.numel() - 1)]
        rows[:, _TOKEN] = torch.where(source > 0, picked, rows[:, _TOKEN])

    def feed(self, token_ids: torch.Tensor) -> None:
        """The next step's input ids (``[num_rows]``, on the device): a window's sampled tokens."""
        self._inputs[: self.num_rows, _TOKEN].copy_(token_ids)

    def keep(self, rows: torch.Tensor) -> None:
        """Keeps only ``rows`` (device int64 indices, ascending) of the loaded batch, in that order:
        the requests of a window still running; the batch moves to the graph of its new size."""
        n = rows.shape[0]
        size = padded_size(n, self.sizes)
        assert size is not None and 0 < n <= self.num_rows
        self._inputs[:n] = self._inputs[rows]
        self._pad(n, size)
        self.num_rows, self.size = n, size

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Captures every size, largest first (its memory pool then serves the smaller ones)."""
        for size in reversed(self.sizes):
            if size not in self._graphs:
                self._capture(size)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Runs every size once without capturing (compiles, kernel JITs); rows are padding."""
        for size in reversed(self.sizes):
            self._pad(0, size)
            self._step(size)

    def _capture(self, size: int) -> torch.cuda.CUDAGraph:
        # NOTE: captured with padding rows only (no slot: nothing is written). One eager run first:
        # first calls compile, JIT and allocate, which a capture must not do.
        self._pad(0, size)
        self._step(size)
        torch.cuda.synchronize(self._device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(size)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[size] = graph
        return graph

    def _pad(self, n: int, size: int) -> None:
        pad = self._inputs[n:size]
        pad.zero_()
        pad[:, _KV_LEN] = 1

    def _step(self, size: int) -> torch.Tensor:
        """The captured body: inputs from the static buffer, logits into the static output."""
        rows = self._inputs[:size]
        # NOTE: contiguous copies: the compiled forward pass guards on its inputs' strides.
        positions = rows[:, _POS].to(torch.int64, memory_format=torch.contiguous_format)
        real = rows[:, _REAL]
        kv_lens = rows[:, _KV_LEN]
        bs = self._block_size
        metas = []
        for g in range(self._groups):
            start = _TABLES + g * self._stride
            tables = rows[:, start : start + self._width]
            slots = tables.gather(1, (positions // bs)[:, None])[:, 0].long() * bs + positions % bs
            metas.append(AttentionMetadata(
                slot_mapping=torch.where(real.bool(), slots, -1),
                cu_q_lens=self._cu_q_lens[: size + 1],
                kv_lens=kv_lens,
                block_tables=tables,
            ))
        token_ids = rows[:, _TOKEN].to(torch.int64, memory_format=torch.contiguous_format)
        if self._lora:
            lora = LoRAMetadata(rows[:, _LORA] - 1)
            logits = self._forward_logits(token_ids, positions, metas, lora)
        else:
            logits = self._forward_logits(token_ids, positions, metas)
        self._logits[:size].copy_(logits)
        # NOTE: the next step of a window attends one more key at the next position (real rows only:
        # a padding row stays at position 0 with one key of the null block).
        rows[:, _POS] += real
        rows[:, _KV_LEN] += real
        return self._logits[:size]
