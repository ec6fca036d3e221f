"""What a replay reads and what it records, shared by the live bench (kvmesh/bench/) and the
simulator (kvmesh/sim/): the Mooncake trace reader (trace.py) and the per-request record with its
summary (records.py). Neither package is imported here (the simulator never imports the bench)."""
