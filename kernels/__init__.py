"""Attention kernels: torch references (always available) and Triton kernels (CUDA / interpreter).

The engine calls ``ragged_paged_attention`` and ``write_kv_cache`` from here; which implementation
runs is decided in one place (see kernels/dispatch.py once the Triton kernels land).
"""

from kernels.reference import ragged_paged_attention_ref, write_kv_cache_ref

# NOTE: until the Triton kernels land these are the torch references.
ragged_paged_attention = ragged_paged_attention_ref
write_kv_cache = write_kv_cache_ref

__all__ = [
    "ragged_paged_attention",
    "ragged_paged_attention_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]
