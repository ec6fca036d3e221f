"""`kvmesh simulate`: the mesh in virtual time on the production code; policies side by side.

See docs/cli.md (every flag) and docs/benchmarks.md (results, the simulator's model).
"""

from __future__ import annotations

import argparse
import sys


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    from kvmesh.commands.common import add_cost_model_args
    from kvmesh.model_worker.sim_runner import CostModel
    from kvmesh.router.policies import policy_names
    from kvmesh.router.policies.base import PolicyConfig
    from kvmesh.sim.mesh import SimConfig
    from kvmesh.sim.workload import GENERATORS

    d, pc, cm = SimConfig(), PolicyConfig(), CostModel()
    p = sub.add_parser(
        "simulate", help="replay a workload through a virtual-time mesh per routing policy; capacities at an SLO",
        description="The mesh in virtual time: real engines (cost-model forward pass), the real kv_service "
                    "core and router core; every policy's capacity at the SLO, full runs at chosen rates.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids)")
    src.add_argument("--workload", choices=sorted(GENERATORS), help="a generated workload")
    p.add_argument("--max-requests", type=int, default=None, help="the first N requests (default: all; "
                                                                  "generators: 3000)")
    p.add_argument("--skip-requests", type=int, default=0, metavar="N",
                   help="--trace: start at the trace's request N (a later segment; times restart at 0) (default 0)")
    p.add_argument("--workers", type=int, default=d.workers, help=f"simulated workers (default {d.workers})")
    p.add_argument("--routers", type=int, default=d.routers,
                   help="routers sharing the index, requests dealt to them in turn (default 1)")
    p.add_argument("--policies", default=",".join(policy_names()),
                   help=f"comma-separated (default all: {','.join(policy_names())})")
    p.add_argument("--rates", default="", help="full runs at these rates (x the workload's own rate)")
    p.add_argument("--relative-rates", default="0.5,1,1.5",
                   help="full runs at these multiples of the baseline's capacity (default 0.5,1,1.5; '' = none)")
    p.add_argument("--baseline", default="round-robin", help="policy whose capacity --relative-rates scale")
    p.add_argument("--no-capacity", action="store_true", help="skip the capacity search")
    p.add_argument("--seed", type=int, default=0, help="seeds tokens, tie-breaks and faults (default 0)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    p.add_argument("--plot-dir", default=None, help="write <workload>_ttft_p90_vs_rate.png and _slo_vs_rate.png here")
    p.add_argument("--plot-note", default="", help="a line under the plots' title (e.g. what else ran)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes for the runs (default 1)")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("SLO")
    g.add_argument("--slo-ttft", type=float, default=d.slo_ttft_s, help=f"TTFT base seconds (default {d.slo_ttft_s:g})")
    g.add_argument("--slo-ttft-prefill-x", type=float, default=d.slo_ttft_prefill_x,
                   help=f"plus this many times the request's cold prefill time (default {d.slo_ttft_prefill_x:g})")
    g.add_argument("--slo-tpot", type=float, default=d.slo_tpot_s, help=f"mean TPOT seconds (default {d.slo_tpot_s:g})")
    g.add_argument("--slo-target", type=float, default=d.slo_target,
                   help=f"capacity = highest rate with at least this attainment (default {d.slo_target:g})")
    g = p.add_argument_group("engines (each worker is a real LLMEngine with a cost-model runner)")
    g.add_argument("--block-size", type=int, default=d.block_size, help=f"tokens per KV block (default {d.block_size})")
    g.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks per worker (default: an H100's 442,368 tokens in blocks of --block-size)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--num-scheduler-steps", type=int, default=d.num_scheduler_steps,
                   help="the engines' decode window; 1 = admit at every step (default 1)")
    g.add_argument("--window-steps", type=int, default=d.window_steps,
                   help=f"longest window simulated as one event with --num-scheduler-steps 1 (default {d.window_steps})")
    add_cost_model_args(g, cm)
    g = p.add_argument_group("the live system's delays")
    g.add_argument("--event-batch-ms", type=float, default=d.event_batch_s * 1000,
                   help="kv publisher message period (default 20)")
    g.add_argument("--event-delay-ms", type=float, default=d.event_delay_s * 1000,
                   help="event message worker -> index (default 2)")
    g.add_argument("--heartbeat-s", type=float, default=d.heartbeat_s, help="heartbeat period (default 3.33)")
    g.add_argument("--load-reports", choices=["events", "heartbeat"], default="events",
                   help="events: event messages carry the load and a changed load goes out alone (the live "
                        "worker); heartbeat: only heartbeats report it (the worker until 2026-11-22) (default events)")
    g.add_argument("--lease-ttl-s", type=float, default=d.lease_ttl_s, help="worker lease (default 10)")
    g.add_argument("--discovery-s", type=float, default=d.discovery_s, help="routers' ListWorkers period (default 1)")
    g.add_argument("--lookup-latency-ms", type=float, default=d.lookup_latency_s * 1000,
                   help="Lookup round trip (default 2)")
    g.add_argument("--lookup-timeout-ms", type=float, default=d.lookup_timeout_s * 1000,
                   help="router's Lookup deadline: slower Lookups fail (default 50)")
    g.add_argument("--index-retry-s", type=float, default=d.index_retry_s, help="breaker open time (default 1)")
    g.add_argument("--network-ms", type=float, default=d.network_s * 1000, help="router <-> worker hop (default 1)")
    g.add_argument("--speculative-ttl-s", type=float, default=d.speculative_ttl_s, help="(default 2)")
    g.add_argument("--max-attempts", type=int, default=d.max_attempts, help="workers tried per request (default 3)")
    g = p.add_argument_group("policy knobs (router/policies/ PolicyConfig)")
    g.add_argument("--decode-cost", type=int, default=pc.decode_cost_tokens)
    g.add_argument("--overlap-weight", type=float, default=pc.overlap_weight)
    g.add_argument("--decode-harm-weight", type=float, default=pc.decode_harm_weight)
    g.add_argument("--work-weight", type=float, default=pc.work_weight)
    g.add_argument("--router-temperature", type=float, default=pc.temperature,
                   help="kv-aware: softmax sampling temperature over normalized scores (default 0 = best wins)")
    g.add_argument("--balance-factor", type=float, default=pc.balance_factor)
    g.add_argument("--balance-min-tokens", type=int, default=pc.balance_min_tokens)
    g = p.add_argument_group("faults")
    g.add_argument("--event-loss", type=float, default=0.0, help="share of event messages lost (default 0)")
    g.add_argument("--restart-at", default="",
                   help="kill worker 0 at these fractions of the arrival span, e.g. 0.5 (default none)")
    g.add_argument("--restart-down-s", type=float, default=d.restart_down_s, help="seconds it stays down (default 2)")
    p.set_defaults(func=run)


def config_from(args: argparse.Namespace):
    from kvmesh.model_worker.sim_runner import CostModel
    from kvmesh.router.policies.base import PolicyConfig
    from kvmesh.sim.mesh import SimConfig

    cost = CostModel(**{f: getattr(args, f"sim_{f}") for f in CostModel.__dataclass_fields__})
    return SimConfig(
        workers=args.workers, routers=args.routers, seed=args.seed, block_size=args.block_size,
        num_blocks=args.num_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        num_scheduler_steps=args.num_scheduler_steps, window_steps=args.window_steps, cost=cost,
        event_batch_s=args.event_batch_ms / 1000, event_delay_s=args.event_delay_ms / 1000,
        heartbeat_s=args.heartbeat_s, load_on_events=args.load_reports == "events",
        lease_ttl_s=args.lease_ttl_s, discovery_s=args.discovery_s,
        lookup_latency_s=args.lookup_latency_ms / 1000, lookup_timeout_s=args.lookup_timeout_ms / 1000,
        index_retry_s=args.index_retry_s, network_s=args.network_ms / 1000, speculative_ttl_s=args.speculative_ttl_s,
        max_attempts=args.max_attempts,
        policy_config=PolicyConfig(decode_cost_tokens=args.decode_cost, overlap_weight=args.overlap_weight,
                                   decode_harm_weight=args.decode_harm_weight, work_weight=args.work_weight,
                                   temperature=args.router_temperature,
                                   balance_factor=args.balance_factor, balance_min_tokens=args.balance_min_tokens),
        event_loss=args.event_loss, restart_at=tuple(_floats(args.restart_at)), restart_down_s=args.restart_down_s,
        slo_ttft_s=args.slo_ttft, slo_ttft_prefill_x=args.slo_ttft_prefill_x, slo_tpot_s=args.slo_tpot,
        slo_target=args.slo_target)


def run(args: argparse.Namespace) -> int:
    from kvmesh.router.policies import POLICIES, policy_names
    from kvmesh.sim import report
    from kvmesh.sim.run import Sim, dump, sweep
    from kvmesh.sim.workload import load_trace, make_workload

    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        print(f"unknown policy {unknown[0]!r}; choose from {', '.join(policy_names())}", file=sys.stderr)
        return 2
    try:
        rates, relative = _floats(args.rates), _floats(args.relative_rates)
        restart = _floats(args.restart_at)
    except ValueError as exc:
        print(f"--rates / --relative-rates / --restart-at take comma-separated numbers: {exc}", file=sys.stderr)
        return 2
    if any(r <= 0 for r in rates + relative) or not all(0 <= f <= 1 for f in restart):
        print("rates must be > 0 and --restart-at fractions in [0, 1]", file=sys.stderr)
        return 2
    if not 0 <= args.event_loss < 1 or args.workers < 1 or args.routers < 1 or args.jobs < 1:
        print("--event-loss must be in [0, 1); --workers, --routers and --jobs >= 1", file=sys.stderr)
        return 2
    if args.skip_requests < 0 or (args.skip_requests and not args.trace):
        print("--skip-requests takes a count >= 0, with --trace", file=sys.stderr)
        return 2
    capacity = not args.no_capacity
    if relative and (not capacity or args.baseline not in policies):
        relative = []  # NOTE: nothing to scale by
    if args.trace:
        try:
            workload = load_trace(args.trace, args.max_requests, args.seed, skip=args.skip_requests)
        except (OSError, ValueError, KeyError) as exc:
            print(f"cannot read trace {args.trace}: {exc}", file=sys.stderr)
            return 2
    else:
        workload = make_workload(args.workload, args.max_requests, args.seed)
    if not workload.requests:
        print("the workload has no requests", file=sys.stderr)
        return 2
    sim = Sim(workload, config_from(args))
    doc = sweep(sim, policies, rates, capacity=capacity, relative=relative, baseline=args.baseline,
                jobs=args.jobs, progress=not args.no_progress)
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
