"""The virtual-time mesh simulator (`kvmesh simulate`): kvmesh/sim/mesh.py."""
