"""`kvmesh simulate`: the mesh in virtual time on the production code; policies side by side.

See docs/cli.md (every flag) and docs/benchmarks.md (results, the simulator's model).
"""

from __future__ import annotations

import argparse
import sys


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


EXCLUDE = ("routing.policy", "routing.pd.pd_mode", "routing.first_token_timeout_s", "routing.policy_config.seed")
"""Settings with no simulate flag: the policies come from --policies, the simulator derives each router's
seed from --seed, and no request waits for its first token past a timeout in virtual time."""


def register(sub: argparse._SubParsersAction) -> None:
    from kvmesh.commands.common import add_cost_model_args, sim_choices
    from kvmesh.commands.config_args import add_config_args
    from kvmesh.model_worker.simulated.step_time import LinearCost
    from kvmesh.router.core.policies import policy_names
    from kvmesh.router.core.policies.base import STEP_COST_FITS
    from kvmesh.sim.config import SimConfig
    from kvmesh.sim.workload import GENERATORS

    p = sub.add_parser(
        "simulate", help="replay a workload through a virtual-time mesh per routing policy; capacities at an SLO",
        description="The mesh in virtual time: real engines (cost-model forward pass), the real kv_service "
                    "core and router core; every policy's capacity at the SLO, full runs at chosen rates. "
                    "Settings the live system has take its flags (--lookup-timeout-ms, --speculative-ttl, "
                    "--discovery-interval, --max-num-seqs, ...).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids)")
    src.add_argument("--workload", choices=sorted(GENERATORS), help="a generated workload")
    p.add_argument("--max-requests", type=int, default=None, help="the first N requests (default: all; "
                                                                  "generators: 3000)")
    p.add_argument("--skip-requests", type=int, default=0, metavar="N",
                   help="--trace: start at the trace's request N (a later segment; times restart at 0) (default 0)")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated (default all: {','.join(policy_names())}; on a workload without LoRA "
                        "adapters all but the adapter peers, which pick as llm-d / kv-aware there)")
    p.add_argument("--rates", default="", help="full runs at these rates (x the workload's own rate)")
    p.add_argument("--relative-rates", default="0.5,1,1.5",
                   help="full runs at these multiples of the baseline's capacity (default 0.5,1,1.5; '' = none)")
    p.add_argument("--baseline", default="round-robin", help="policy whose capacity --relative-rates scale")
    p.add_argument("--no-capacity", action="store_true", help="skip the capacity search")
    p.add_argument("--no-limits", action="store_true",
                   help="skip the two reference limits: the information limit's capacity search and the work bound")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    p.add_argument("--plot-dir", default=None, help="write <workload>_ttft_p90_vs_rate.png and _slo_vs_rate.png here")
    p.add_argument("--plot-note", default="", help="a line under the plots' title (e.g. what else ran)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes for the runs (default 1)")
    p.add_argument("--no-progress", action="store_true")
    add_config_args(p.add_argument_group("the mesh (kvmesh/sim/config.py SimConfig; live settings keep their flags)"),
                    SimConfig, exclude=EXCLUDE,
                    choices={"load_reports": ["events", "heartbeat"], "step_cost_fit": STEP_COST_FITS, **sim_choices()})
    add_cost_model_args(p.add_argument_group("the linear cost model (--sim-cost-model linear; as `kvmesh worker "
                                             "--simulate`)"), LinearCost())
    p.set_defaults(func=run)


def config_from(args: argparse.Namespace):
    """SimConfig from the flags; ValueError where a flag does not apply."""
    from kvmesh.commands.common import linear_cost_from
    from kvmesh.commands.config_args import config_from_args
    from kvmesh.sim.config import SimConfig

    return config_from_args(SimConfig, args, exclude=EXCLUDE, cost=linear_cost_from(args))


def run(args: argparse.Namespace) -> int:
    from kvmesh.router.core.policies import ADAPTER_PEERS, POLICIES, policy_names
    from kvmesh.sim import report
    from kvmesh.sim.pd import parse_policy
    from kvmesh.sim.run import Sim, dump, sweep
    from kvmesh.sim.workload import make_workload, trace_workload

    default = args.policies is None
    policies = policy_names() if default else [p for p in args.policies.split(",") if p]
    try:
        bases = [parse_policy(p) for p in policies]
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    unknown = [p for p, (base, _) in zip(policies, bases, strict=True) if base not in POLICIES]
    if unknown:
        print(f"unknown policy {unknown[0]!r}; choose from {', '.join(policy_names())} (with --pd, add +always, "
              "+auto or a peer's +pd: kvmesh/sim/pd.py)", file=sys.stderr)
        return 2
    if any(split for _, split in bases) and not args.pd:
        print("a policy with +always, +auto or +pd needs a P/D fleet: --pd PREFILL:DECODE", file=sys.stderr)
        return 2
    try:
        rates, relative = _floats(args.rates), _floats(args.relative_rates)
    except ValueError as exc:
        print(f"--rates / --relative-rates take comma-separated numbers: {exc}", file=sys.stderr)
        return 2
    if any(r <= 0 for r in rates + relative) or args.jobs < 1:
        print("rates must be > 0 and --jobs >= 1", file=sys.stderr)
        return 2
    try:
        config = config_from(args)
        config.check()
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if args.skip_requests < 0 or (args.skip_requests and not args.trace):
        print("--skip-requests takes a count >= 0, with --trace", file=sys.stderr)
        return 2
    capacity = not args.no_capacity
    if relative and (not capacity or args.baseline not in policies):
        relative = []  # NOTE: nothing to scale by
    if args.trace:
        try:
            workload = trace_workload(args.trace, args.max_requests, args.seed, skip=args.skip_requests)
        except (OSError, ValueError, KeyError) as exc:
            print(f"cannot read trace {args.trace}: {exc}", file=sys.stderr)
            return 2
    else:
        workload = make_workload(args.workload, args.max_requests, args.seed)
    if not workload.requests:
        print("the workload has no requests", file=sys.stderr)
        return 2
    not_run = {}
    if default and not workload.adapters:
        # NOTE: on base-model requests the adapter peers pick as the policy they extend: their runs would repeat it
        not_run = {p: f"no LoRA adapter in the workload: picks as {ADAPTER_PEERS[p]}" for p in policies if p in ADAPTER_PEERS}
        policies = [p for p in policies if p not in not_run]
        print("not run (name them in --policies to run them): "
              + "; ".join(f"{p}: {why}" for p, why in not_run.items()), file=sys.stderr)
    sim = Sim(workload, config)
    doc = sweep(sim, policies, rates, capacity=capacity, relative=relative, baseline=args.baseline,
                jobs=args.jobs, progress=not args.no_progress, limits=not args.no_limits)
    if not_run:
        doc["not_run"] = not_run
    print(report.format_table(doc))
    print(f"({doc['_wall_s']:.0f} s of simulation over {args.jobs} process(es))", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            f.write(dump(doc))
    if args.plot_dir:
        for path in report.plot(doc, args.plot_dir, args.plot_note):
            print(f"wrote {path}", file=sys.stderr)
    if doc.get("failures"):
        print(f"{len(doc['failures'])} run(s) failed (listed above and under 'failures' in the JSON); "
              "the other results are complete", file=sys.stderr)
        return 1
    return 0
