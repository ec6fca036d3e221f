"""Attention kernels: torch references (always available) and Triton kernels (CUDA / interpreter)."""

from kernels.reference import ragged_paged_attention_ref, write_kv_cache_ref

__all__ = ["ragged_paged_attention_ref", "write_kv_cache_ref"]
