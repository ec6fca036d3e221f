"""`kvmesh bench serve` (load a running router) and `kvmesh bench routing` (compare policies)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="serving benchmark and routing-policy comparison",
                       description="Benchmarks; see docs/benchmarks.md.")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    bsub.required = True
    _register_serve(bsub)
    _register_routing(bsub)


def _register_serve(bsub: argparse._SubParsersAction) -> None:
    s = bsub.add_parser("serve", help="load a running router and report latency/throughput (vLLM layout)")
    s.add_argument("--router", default="127.0.0.1:50051", help="router host:port, or several routers spread by gRPC's round_robin: 'ipv4:127.0.0.1:50051,127.0.0.1:50053' or 'h1:p1,h2:p2' (default 127.0.0.1:50051)")
    s.add_argument("--dataset", default="random", choices=["random", "prefix-repetition", "multi-turn", "trace"])
    s.add_argument("--model", default=None, help="model dir for the vocabulary (default: the tiny demo model)")
    s.add_argument("--num-prompts", type=int, default=100)
    s.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, inf = all at once")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 = Poisson")
    s.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    s.add_argument("--random-input-len", type=int, default=1024)
    s.add_argument("--random-output-len", type=int, default=128)
    s.add_argument("--random-prefix-len", type=int, default=0)
    s.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    s.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    s.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    s.add_argument("--multi-turn-turns", type=int, default=5)
    s.add_argument("--multi-turn-system-len", type=int, default=512)
    s.add_argument("--multi-turn-user-len", type=int, default=128)
    s.add_argument("--trace", default=None, help="Mooncake JSONL trace (--dataset trace)")
    s.add_argument("--speedup", type=float, default=1.0, help="trace time compression (--dataset trace)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    s.add_argument("--time-scale", type=float, default=1.0,
                   help="wall s per reported s (simulated stacks with --sim-time-scale; default 1)")
    s.add_argument("--save-result", default=None, metavar="FILE.json", help="write the summary (+ requests) here")
    s.add_argument("--plot-dir", default=None, help="write ttft_cdf.png and worker_load.png here")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=run_serve)


def _register_routing(bsub: argparse._SubParsersAction) -> None:
    from kvmesh.bench.routing import DEFAULT_POLICIES, RoutingBenchConfig
    from kvmesh.contract.types import H100_8B_KV_BLOCKS

    d = RoutingBenchConfig(trace="", model="")
    r = bsub.add_parser("routing", help="replay a trace through a simulated stack per policy and compare")
    r.add_argument("--trace", required=True, help="Mooncake JSONL trace")
    r.add_argument("--workers", type=int, default=d.workers)
    r.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    r.add_argument("--max-requests", type=int, default=None)
    r.add_argument("--speedup", type=float, default=d.speedup,
                   help=f"trace time compression in wall time (default {d.speedup:g})")
    r.add_argument("--sim-time-scale", type=float, default=d.time_scale,
                   help=f"workers' wall s per modelled s (default {d.time_scale:g}); modelled load = "
                        "speedup x time scale x the trace's rate")
    r.add_argument("--num-blocks", type=int, default=None, help=f"KV blocks per worker (default: H100 8B, {H100_8B_KV_BLOCKS})")
    r.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    r.add_argument("--num-scheduler-steps", type=int, default=d.num_scheduler_steps,
                   help=f"workers' multi-step decode window (default {d.num_scheduler_steps}): fewer scheduling "
                        "passes per token, so this host can keep up with many simulated GPUs")
    r.add_argument("--stream-interval", type=int, default=d.stream_interval,
                   help=f"workers' tokens per stream message after the first (default {d.stream_interval})")
    r.add_argument("--store", choices=["redis", "memory"], default=d.store)
    r.add_argument("--router-args", default="", metavar='"FLAGS"',
                   help='extra `kvmesh router` flags for every policy, one quoted string '
                        '(e.g. "--lookup-timeout-ms 200 --overlap-weight 2")')
    r.add_argument("--model", default=None, help="model dir for vocabulary/tokenizer (default: tiny demo model)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", default=None, metavar="OUT", help="write the results JSON here")
    r.add_argument("--log-dir", default=None, help="keep the stacks' logs here")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(func=run_routing)


def _model(arg: str | None) -> str:
    if arg:
        return arg
    from kvmesh.make_model import ensure_default_model

    return str(ensure_default_model())


def run_serve(args: argparse.Namespace) -> int:
    from kvmesh.bench import datasets as ds
    from kvmesh.bench import serve
    from kvmesh.bench.report import format_report, save_result, summarize, write_plots
    from kvmesh.model_worker.config import ModelConfig

    tokens = ds.TokenRange.for_vocab(ModelConfig.from_dir(_model(args.model)).vocab_size)
    n = args.num_prompts
    if args.dataset == "random":
        reqs = ds.random_dataset(n, args.random_input_len, args.random_output_len, args.random_prefix_len,
                                 args.seed, tokens)
    elif args.dataset == "prefix-repetition":
        reqs = ds.prefix_repetition_dataset(n, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                            args.prefix_repetition_num_prefixes, args.random_output_len,
                                            args.seed, tokens)
    elif args.dataset == "multi-turn":
        reqs = ds.multi_turn_dataset(n, args.multi_turn_turns, args.multi_turn_system_len,
                                     args.multi_turn_user_len, args.random_output_len, args.seed, tokens)
    else:
        if not args.trace:
            print("kvmesh bench serve: --dataset trace needs --trace FILE", file=sys.stderr)
            return 2
        from kvmesh.bench.trace import TraceSynthesizer
        from kvmesh.replay.trace import load_trace

        reqs = TraceSynthesizer(args.seed, tokens).requests(load_trace(args.trace, n), args.speedup)
    if args.dataset != "trace":
        reqs = list(ds.iter_with_arrivals(reqs, ds.poisson_arrivals(len(reqs), args.request_rate,
                                                                    args.burstiness, args.seed)))
    records, duration = serve.run(args.router, reqs, max_concurrency=args.max_concurrency,
                                  ignore_eos=args.ignore_eos, progress=not args.no_progress)
    summary = summarize(records, duration, args.time_scale)
    print(format_report(summary))
    if args.save_result:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        save_result(args.save_result, summary, config, records)
    if args.plot_dir:
        for path in write_plots(records, args.plot_dir, args.time_scale, args.dataset):
            print(f"wrote {path}")
    return 0 if summary["completed"] else 1


def run_routing(args: argparse.Namespace) -> int:
    from kvmesh.bench.routing import RoutingBenchConfig, format_table, run_routing_bench

    cfg = RoutingBenchConfig(
        trace=args.trace, model=_model(args.model), workers=args.workers,
        policies=[p.strip() for p in args.policies.split(",") if p.strip()], max_requests=args.max_requests,
        speedup=args.speedup, time_scale=args.sim_time_scale, num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens, num_scheduler_steps=args.num_scheduler_steps,
        stream_interval=args.stream_interval, router_args=shlex.split(args.router_args),
        store=args.store, seed=args.seed, progress=not args.no_progress, log_dir=args.log_dir)
    from kvmesh.router.core.policies import POLICIES, policy_names

    unknown = [p for p in cfg.policies if p not in POLICIES]
    if unknown:
        print(f"kvmesh bench routing: unknown policies {unknown}; choose from {policy_names()}", file=sys.stderr)
        return 2
    result = run_routing_bench(cfg)
    print(format_table(result))
    s = result["settings"]
    print(f"settings: {s['requests']} requests of {s['trace']}, {s['workers']} workers, speedup {s['speedup']:g}, "
          f"sim time scale {s['time_scale']:g} (modelled load {s['modelled_load_factor']:g}x the trace), "
          f"{s['num_blocks']} blocks/worker; {s['host']} {s['date']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(result[p]["failed"] == 0 for p in cfg.policies) else 1
