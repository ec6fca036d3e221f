"""Load generation and measurement: `kvmesh bench serve` and `kvmesh bench routing` (docs/benchmarks.md)."""
