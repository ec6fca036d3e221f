"""The simulated GPU: a runner whose forward pass is a step-time model (no weights), for `kvmesh worker --simulate` and the simulator."""
