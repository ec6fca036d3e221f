"""The host tier's memory and the copies between it and the device KV cache.

The scheduler decides what moves (model_worker/scheduling/host_block_pool.py: ``KVTransfers``);
this module moves it, before the step's forward pass, every offload before any load.

Layout: one tensor ``[num_host_blocks, layers, 2 (K, V), block_size, kv_heads, head_dim]``, so a
host block is one contiguous run of bytes (one DMA per block over the host link), while the device
cache keeps its per-layer ``[num_blocks, block_size, kv_heads, head_dim]`` tensors.

- **CPU** (a CPU worker: the device cache is host memory too). The same mechanism between two
  memory pools, synchronously: offloads gather each layer's evicted blocks into their host blocks,
  loads scatter host blocks into the device blocks given to them, layer by layer (no staging).
- **CUDA.** The host tensor is pinned. An offload gathers the evicted blocks into a device staging
  buffer on the compute stream (ordered before the forward pass that overwrites those blocks),
  then copies each block to its host block on a copy stream: the transfer over PCIe (or
  NVLink-C2C) overlaps the step. A load copies its host blocks into a staging buffer on the copy
  stream (after every earlier offload there, so a block stored and loaded back in one step or in
  consecutive steps arrives whole), the compute stream waits for it, then scatters the staging
  buffer into the device blocks: the step waits for its loads, not for its offloads. The host
  memory is touched only by copies on the one copy stream, so a store into a host block can never
  overtake a load from it. Written for CUDA, not yet run on a GPU (docs/engine.md, Host KV tier).
"""

from __future__ import annotations

import os
import time

import torch

from kvmesh.model_worker.scheduling.host_block_pool import GIB, KVTransfers


def check_host_memory(num_blocks: int, bytes_per_block: int) -> None:
    """Raises ValueError when the host tier would not fit in the machine's available memory."""
    want = num_blocks * bytes_per_block
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return  # NOTE: no sysconf here: the allocation itself will say
    if want > available:
        raise ValueError(f"the host KV tier wants {want / GIB:.2f} GiB ({num_blocks} blocks of {bytes_per_block} "
                         f"bytes), more than the {available / GIB:.2f} GiB this machine has available; lower "
                         "--host-kv-blocks or --kv-offloading-size")


class HostKVCache:
    """The host tier's blocks and the copies to and from the device KV cache.

    Args:
        caches: per layer, its (K, V) cache tensors ``[num_blocks, block_size, kv_heads, head_dim]``.
        num_blocks: host blocks.
    """

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int) -> None:
        k0 = caches[0][0]
        self.caches = caches
        self.device = k0.device
        self.block_shape = (len(caches), 2, *k0.shape[1:])
        cuda = self.device.type == "cuda"
        # NOTE: pinned only where a DMA engine reads it; a CPU worker's tier is plain memory. Zeroed,
        # as the device cache is: every page is faulted in at start, not by the first offloads.
        self.blocks = torch.zeros((num_blocks, *self.block_shape), dtype=k0.dtype, pin_memory=cuda)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._load_s = 0.0
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        """CUDA: (start, end) events of loads whose time is not read yet."""

    @property
    def load_s(self) -> float:
        """Seconds spent loading host blocks so far: what routers learn a loaded block's cost from
        (the engine reports it). CPU: the wall time of the loads; CUDA: the copy stream's time of
        every load whose events completed (the step waits for them)."""
        if self._timing:
            done = [pair for pair in self._timing if pair[1].query()]
            for start, end in done:
                self._load_s += start.elapsed_time(end) / 1000
            self._timing = [pair for pair in self._timing if pair not in done]
        return self._load_s

    @torch.inference_mode()
    def copy(self, transfers: KVTransfers) -> None:
        """Runs one step's copies: every offload, then every load (host_block_pool.KVTransfers)."""
        if transfers.offloads:
            self._offload(*zip(*transfers.offloads, strict=True))
        if transfers.loads:
            host, device = zip(*transfers.loads, strict=True)
            t0 = time.perf_counter()
            self._load(host, device)
            if self._stream is None:
                self._load_s += time.perf_counter() - t0

    def _gather(self, device_ids: torch.Tensor) -> torch.Tensor:
        """The device blocks ``device_ids`` of every layer, as host-layout blocks (on the device)."""
        out = torch.empty((len(device_ids), *self.block_shape), dtype=self.blocks.dtype, device=self.device)
        for layer, (k, v) in enumerate(self.caches):
            out[:, layer, 0] = k.index_select(0, device_ids)
            out[:, layer, 1] = v.index_select(0, device_ids)
        return out

    def _scatter(self, blocks: torch.Tensor, device_ids: torch.Tensor) -> None:
        """Writes host-layout ``blocks`` into the device blocks ``device_ids`` of every layer."""
        for layer, (k, v) in enumerate(self.caches):
            k.index_copy_(0, device_ids, blocks[:, layer, 0])
            v.index_copy_(0, device_ids, blocks[:, layer, 1])

    def _offload(self, device_ids: tuple[int, ...], host_ids: tuple[int, ...]) -> None:
        ids = torch.tensor(device_ids, dtype=torch.int64, device=self.device)
        stream = self._stream
        if stream is None:
            # NOTE: straight from each layer's cache into the host blocks' strided views: one gather
            # and one scatter per tensor, no staging pass.
            hosts = torch.tensor(host_ids, dtype=torch.int64)
            for layer, (k, v) in enumerate(self.caches):
                self.blocks[:, layer, 0].index_copy_(0, hosts, k.index_select(0, ids))
                self.blocks[:, layer, 1].index_copy_(0, hosts, v.index_select(0, ids))
            return
        staged = self._gather(ids)
        # NOTE: the gather ran on the compute stream; the copy stream starts after it and the
        # staging buffer stays allocated until the copy stream is done with it.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for i, h in enumerate(host_ids):
                self.blocks[h].copy_(staged[i], non_blocking=True)
        staged.record_stream(stream)

    def _load(self, host_ids: tuple[int, ...], device_ids: tuple[int, ...]) -> None:
        ids = torch.tensor(device_ids, dtype=torch.int64, device=self.device)
        stream = self._stream
        if stream is None:
            hosts = torch.tensor(host_ids, dtype=torch.int64)
            for layer, (k, v) in enumerate(self.caches):
                k.index_copy_(0, ids, self.blocks[:, layer, 0].index_select(0, hosts))
                v.index_copy_(0, ids, self.blocks[:, layer, 1].index_select(0, hosts))
            return
        compute = torch.cuda.current_stream(self.device)
        staged = torch.empty((len(host_ids), *self.block_shape), dtype=self.blocks.dtype, device=self.device)
        stream.wait_stream(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for i, h in enumerate(host_ids):
                staged[i].copy_(self.blocks[h], non_blocking=True)
            end.record(stream)
        self._timing.append((start, end))
        compute.wait_stream(stream)
        self._scatter(staged, ids)
