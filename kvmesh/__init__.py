"""kvmesh: KV-cache-aware LLM serving."""
