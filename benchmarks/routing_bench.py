"""Routing-policy comparison on a Mooncake trace with the issue's goal settings, goals checked.

    .venv/bin/python benchmarks/routing_bench.py [--trace ../shared/traces/conversation_trace.jsonl]
        [--max-requests 1500] [--workers 8] [--speedup 4] [--sim-time-scale 0.25] [--policies P,...] [--json OUT]

Runs `kvmesh bench routing` (kvmesh/bench/routing.py) with every policy and prints its table,
then each goal against round-robin: mean TTFT >= 25x lower, output tok/s >= 2x, hit rate >= 0.95x
the oracle's, max/mean worker load <= 1.5, round-robin utilisation >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvmesh.bench.routing import DEFAULT_POLICIES, RoutingBenchConfig, format_table, run_routing_bench
from kvmesh.make_model import ensure_default_model

ROOT = Path(__file__).resolve().parents[1]


def goals(result: dict, policy: str = "kv-aware", baseline: str = "round-robin") -> list[tuple[str, float, str, bool]]:
    """(goal, measured, target, met) rows."""
    p, b, oracle = result[policy], result[baseline], result["oracle_hit_rate"]
    ttft_x = b["ttft_mean_ms"] / p["ttft_mean_ms"] if p["ttft_mean_ms"] else 0.0
    tok_x = p["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"] else 0.0
    hit_x = p["hit_rate"] / oracle if oracle else 0.0
    return [
        ("mean TTFT lower vs round-robin", ttft_x, ">= 25x", ttft_x >= 25),
        ("output tok/s vs round-robin", tok_x, ">= 2x", tok_x >= 2),
        ("hit rate / oracle", hit_x, ">= 0.95", hit_x >= 0.95),
        ("max/mean worker load", p["max_mean_load"], "<= 1.5", p["max_mean_load"] <= 1.5),
        ("round-robin utilisation", b["utilisation_mean"], ">= 0.9", b["utilisation_mean"] >= 0.9),
    ]


def main() -> int:
    d = RoutingBenchConfig(trace="", model="")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"))
    ap.add_argument("--max-requests", type=int, default=1500)
    ap.add_argument("--workers", type=int, default=d.workers)
    ap.add_argument("--speedup", type=float, default=d.speedup)
    ap.add_argument("--sim-time-scale", type=float, default=d.time_scale)
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = RoutingBenchConfig(trace=args.trace, model=str(ensure_default_model()), workers=args.workers,
                             policies=args.policies.split(","), max_requests=args.max_requests,
                             speedup=args.speedup, time_scale=args.sim_time_scale)
    result = run_routing_bench(cfg)
    print(format_table(result))
    print(json.dumps(result["settings"]))
    if "kv-aware" in result and "round-robin" in result:
        for name, value, target, met in goals(result):
            print(f"{name:<34}{value:>8.2f}  {target:<8}{'met' if met else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
