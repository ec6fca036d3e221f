"""The virtual-time mesh simulator (`kvmesh simulate`), by part: config.py (SimConfig), events.py (the event
queue; the request records are kvmesh/replay/records.py), index.py (SimIndex), worker.py (SimWorker), router.py (SimRouter), mesh.py (Mesh, which
wires them), replicas.py (the peers' multi-router modes), oracle.py, information_limit.py, work_bound.py,
run.py (runs, sweeps, the capacity search)."""
