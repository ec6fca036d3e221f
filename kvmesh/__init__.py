"""kvmesh: KV-cache-aware LLM serving."""

import os as _os
import sys as _sys

# NOTE: OpenMP (torch's CPU thread pool, MKL and oneDNN) reads its wait policy once, when torch
# loads it, so this must happen before any torch import. By default idle pool threads spin for a
# while at every barrier: on a machine whose cores are shared (other processes, other workers, a
# gRPC server in the same process), a descheduled thread makes the others spin away their time
# slices, and a 2-thread CPU engine measured 99 s instead of 9 s on one workload (docs/engine.md,
# "Threads"). PASSIVE makes them sleep; set OMP_WAIT_POLICY yourself to choose otherwise.
OMP_WAIT_POLICY_SET_HERE = "torch" not in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ
"""True when this import chose the policy (child processes of other programs may want it unset)."""
if OMP_WAIT_POLICY_SET_HERE:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
