"""kv-aware's step-cost fit per worker, pooled, or per GPU class: which routes better (docs/benchmarks.md).

    flock /tmp/kvmesh-heavy.lock .venv/bin/python benchmarks/step_cost_fit.py [--json out.json]

For every fleet and workload, kv-aware's capacity (the simulator's bisection, `kvmesh simulate`'s
SLO) with its step-cost learner (router/core/policies/cost.py) fitting

- ``pooled``: one fit over every worker's reports (kv-aware until 2026-11-23);
- ``worker``: each worker's own reports (the pooled fit answers until a worker has 8 reports);
- ``class``: one fit per GPU type. No worker reports its GPU type, so this variant is handed the
  simulator's fleet (worker id -> GPU): the best a reported class key could do, measured here only.

Then one run per variant at a fixed rate (``--probe-rate`` x the pooled capacity) whose fits are read
back: the relative error of each worker's fitted step time against its true roofline on three probe
steps (an 8k-token prefill, 32 decodes at 2k context, a 2k-token chunk beside 64 decodes at 4k),
averaged over the fleet's workers of each GPU type.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
PROBES = (([(0, 8192)], []), ([], [2048] * 32), ([(0, 2048)], [4096] * 64))


def probe_error(fit, true) -> float:
    """Mean |fitted - true| / true step time over PROBES (fit: a router StepCost)."""
    errs = []
    for prefills, decodes in PROBES:
        n = sum(k for _, k in prefills)
        pairs = sum(k * (s + (k + 1) / 2) for s, k in prefills)
        got = (fit.step_s + fit.prefill_token_s * n + fit.prefill_pair_s * pairs + fit.decode_seq_s * len(decodes)
               + fit.decode_context_token_s * sum(decodes))
        want = true.step_time(prefills, decodes)
        errs.append(abs(got - want) / want)
    return sum(errs) / len(errs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fleets", default="4xH100,4xA100;8xH100", help="';'-separated --workers values")
    p.add_argument("--workloads", default="shared-prefix,trace", help="generators and/or 'trace' (conversation)")
    p.add_argument("--variants", default="pooled,worker,class")
    p.add_argument("--max-requests", type=int, default=1500)
    p.add_argument("--probe-rate", type=float, default=0.8, help="the fixed-rate run, x pooled capacity")
    p.add_argument("--seeds", default="0", help="comma-separated: the workload's and the run's seed")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from kvmesh.router.core.policies import kv_aware
    from kvmesh.router.core.policies.cost import per_worker
    from kvmesh.sim.config import SimConfig
    from kvmesh.sim.mesh import Mesh
    from kvmesh.sim.run import Sim, chains_for, sim_model_dir
    from kvmesh.sim.workload import make_workload, trace_workload

    out: list[dict] = []
    for fleet, name, seed in itertools.product(args.fleets.split(";"), args.workloads.split(","),
                                               [int(x) for x in args.seeds.split(",")]):
        workload = (trace_workload(TRACE, args.max_requests, seed) if name == "trace"
                    else make_workload(name, args.max_requests, seed))
        pooled_cap = None
        for variant in args.variants.split(","):
            base = SimConfig(workers=fleet, seed=seed)
            gpus = base.worker_gpus()
            pc = dataclasses.replace(base.routing.policy_config,
                                     step_cost_fit="pooled" if variant == "pooled" else "worker")
            cfg = dataclasses.replace(base, routing=dataclasses.replace(base.routing, policy_config=pc))
            # NOTE: the class variant's key is the simulator's own knowledge (worker-NNN -> its GPU):
            # what a class a worker reported could give; no product code reads it.
            kv_aware.per_worker = ((lambda w, gpus=gpus: gpus[int(w.rsplit("-", 1)[1])]) if variant == "class"
                                   else per_worker)
            sim = Sim(workload, cfg)
            t0 = time.perf_counter()
            cap, runs = sim.capacity("kv-aware")
            wall = time.perf_counter() - t0
            if variant == "pooled":
                pooled_cap = cap
            rate = args.probe_rate * (pooled_cap or cap)
            probe = sim.config("kv-aware", rate)
            mesh = Mesh(probe, workload, sim_model_dir(), chains_for(workload, probe.block_size))
            mesh.run()
            learner = mesh.routers[0].core.policy.cost
            errors: dict[str, list[float]] = {}
            for w in mesh.workers:
                fit = learner.estimate(w.worker_id)
                if fit is not None:
                    errors.setdefault(w.gpu, []).append(probe_error(fit, probe.cost_for(w.gpu)))
            row = {"fleet": fleet, "workload": workload.name, "seed": seed, "requests": len(workload), "variant": variant,
                   "capacity": cap, "capacity_runs": len(runs), "probe_rate": round(rate, 6),
                   "fit_error": {g: round(sum(e) / len(e), 4) for g, e in errors.items()},
                   "wall_s": round(wall, 1)}
            out.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
