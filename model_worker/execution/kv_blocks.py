"""A worker's KV blocks as bytes: what a prefill worker sends and a decode worker writes
(prefill/decode disaggregation, model_worker/scheduling/kv_holds.py).

The wire layout of one block is ``[layers, 2 (K, V), block_size, kv_heads, head_dim]`` in the cache's
dtype (kvmesh.contract.kv_transfer.KVLayout), the host tier's layout (kv_offload.py): one block is one
contiguous run of bytes. The device cache keeps its per-layer ``[num_blocks, block_size, kv_heads,
head_dim]`` tensors; a block of one layer's K (or V) is contiguous there too, which is what NIXL reads
in place (``regions``).
"""

from __future__ import annotations

import torch

from kvmesh.contract.kv_transfer import KVLayout

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class KVBlocks:
    """Reads and writes whole KV blocks of a runner's cache.

    Args:
        caches: per layer, its (K, V) cache tensors ``[num_blocks, block_size, kv_heads, head_dim]``.
        model_id, hash_algorithm: the block hashes' spec (part of the layout two workers must share).
    """

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]], model_id: str, hash_algorithm: str) -> None:
        k0 = caches[0][0]
        self.caches = caches
        self.device = k0.device
        self.dtype = k0.dtype
        self.block_shape = (len(caches), 2, *k0.shape[1:])
        _, bs, heads, dim = k0.shape
        self.layout = KVLayout(model_id, bs, _DTYPE_NAMES.get(k0.dtype, str(k0.dtype)), len(caches), heads, dim,
                               hash_algorithm)
        self.bytes_per_block = self.layout.bytes_per_block
        self.layer_block_bytes = k0[0].numel() * k0.element_size()
        """Bytes of one block of one layer's K (or V)."""

    @torch.inference_mode()
    def read(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks ``block_ids`` in wire layout, on the host ``[n, *block_shape]``."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        out = torch.empty((len(block_ids), *self.block_shape), dtype=self.dtype, device=self.device)
        for layer, (k, v) in enumerate(self.caches):
            out[:, layer, 0] = k.index_select(0, ids)
            out[:, layer, 1] = v.index_select(0, ids)
        return out.cpu()

    @torch.inference_mode()
    def write(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Writes wire-layout ``blocks`` ``[n, *block_shape]`` into the cache blocks ``block_ids``."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        data = blocks.to(self.device)
        for layer, (k, v) in enumerate(self.caches):
            k.index_copy_(0, ids, data[:, layer, 0])
            v.index_copy_(0, ids, data[:, layer, 1])

    def empty(self, n: int) -> torch.Tensor:
        """A host buffer for ``n`` blocks in wire layout."""
        return torch.empty((n, *self.block_shape), dtype=self.dtype)

    def from_bytes(self, data: bytes | bytearray | memoryview, n: int) -> torch.Tensor:
        """``n`` wire-layout blocks from their bytes (a copy the caller owns)."""
        want = n * self.bytes_per_block
        if len(data) != want:
            raise ValueError(f"{n} KV blocks are {want} bytes, got {len(data)}")
        return torch.frombuffer(bytearray(data), dtype=self.dtype).reshape(n, *self.block_shape)

    def regions(self, block_ids: list[int]) -> list[tuple[int, int]]:
        """(address, length) of every per-layer K and V piece of the blocks, in wire order (block-major,
        then layer, then K before V): the descriptors a NIXL read of them names."""
        out = []
        size = self.layer_block_bytes
        for b in block_ids:
            for k, v in self.caches:
                out.append((k.data_ptr() + b * size, size))
                out.append((v.data_ptr() + b * size, size))
        return out
