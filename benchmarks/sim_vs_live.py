"""The simulator checked against the live stack: one configuration the host can carry, replayed by
`kvmesh bench routing` (real processes: Redis, kv_service, router, simulated workers sleeping their
modelled step times) and by `kvmesh simulate` (one process, virtual time), side by side.

    flock /tmp/kvmesh-heavy.lock .venv/bin/python benchmarks/sim_vs_live.py

Defaults: 4 workers, the first 300 conversation-trace requests at half the trace's rate (for 4
workers about what the trace's own rate is for 8), policies kv-aware and round-robin, 16-token
blocks and 8-step decode windows on both sides. The live workers run at time scale 1 (a modelled
second is a wall second, so host latency is not magnified), the router gets a 500 ms Lookup
deadline (the simulator's Lookup never misses its deadline; on a 2-core host the live one does at
50 ms, docs/benchmarks.md). Goals: hit rate within 10 % and TTFT mean within 20 % of each other.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"


def run(cmd: list[str]) -> None:
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:4])} failed:\n{proc.stdout}\n{proc.stderr}")
    print(f"  ({' '.join(cmd[2:4])}: {time.time() - t0:.0f} s wall)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=0.5, help="x the trace's own rate (default 0.5)")
    p.add_argument("--time-scale", type=float, default=1.0, help="live workers' wall s per modelled s (default 1)")
    p.add_argument("--policies", default="kv-aware,round-robin")
    p.add_argument("--lookup-timeout-ms", type=float, default=500.0)
    p.add_argument("--block-size", type=int, default=16, help="the simulator's block size (the live bench uses 16)")
    p.add_argument("--num-scheduler-steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", metavar="DIR", help="keep both sides' JSON here (live.json, sim.json)")
    args = p.parse_args()
    py = [sys.executable, "-m", "kvmesh.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        live_json, sim_json = out / "live.json", out / "sim.json"
        print(f"live: kvmesh bench routing, {args.workers} workers, {args.max_requests} requests, rate {args.rate:g}x "
              f"(speedup {args.rate / args.time_scale:g} x time scale {args.time_scale:g})", flush=True)
        run([*py, "bench", "routing", "--trace", args.trace, "--workers", str(args.workers),
             "--policies", args.policies, "--max-requests", str(args.max_requests),
             "--speedup", str(args.rate / args.time_scale), "--sim-time-scale", str(args.time_scale),
             "--num-scheduler-steps", str(args.num_scheduler_steps), "--seed", str(args.seed),
             "--router-args", f"--lookup-timeout-ms {args.lookup_timeout_ms:g}",
             "--json", str(live_json), "--no-progress"])
        print("simulated: kvmesh simulate, same workload and engine settings", flush=True)
        run([*py, "simulate", "--trace", args.trace, "--workers", str(args.workers), "--policies", args.policies,
             "--max-requests", str(args.max_requests), "--rates", str(args.rate), "--relative-rates", "",
             "--no-capacity", "--block-size", str(args.block_size),
             "--num-scheduler-steps", str(args.num_scheduler_steps), "--lookup-timeout-ms", str(args.lookup_timeout_ms),
             "--seed", str(args.seed), "--json", str(sim_json), "--no-progress"])
        live, sim = json.loads(live_json.read_text()), json.loads(sim_json.read_text())
    runs = {r["policy"]: r for r in sim["runs"]}
    print(f"\n{'policy':<13}{'':>6}{'hit':>8}{'TTFT mean ms':>14}{'TTFT p90 ms':>13}{'out tok/s':>11}")
    ok = True
    for policy in args.policies.split(","):
        lv, sm = live[policy], runs[policy]
        rows = {"live": (lv["hit_rate"], lv["ttft_mean_ms"], lv["ttft_p90_ms"], lv["output_tok_s"]),
                "sim": (sm["hit_rate"], sm["ttft_mean_s"] * 1000, sm["ttft_p90_s"] * 1000, sm["output_tok_s"])}
        for side, (hit, mean, p90, tok) in rows.items():
            print(f"{policy:<13}{side:>6}{hit:>8.3f}{mean:>14.0f}{p90:>13.0f}{tok:>11.0f}")
        hit_ratio = rows["sim"][0] / rows["live"][0] if rows["live"][0] else float("nan")
        ttft_ratio = rows["sim"][1] / rows["live"][1] if rows["live"][1] else float("nan")
        good = abs(hit_ratio - 1) <= 0.10 and abs(ttft_ratio - 1) <= 0.20
        ok &= good
        print(f"{policy:<13}{'sim/live':>6}{hit_ratio:>8.2f}{ttft_ratio:>14.2f}"
              f"{rows['sim'][2] / rows['live'][2] if rows['live'][2] else float('nan'):>13.2f}"
              f"{rows['sim'][3] / rows['live'][3] if rows['live'][3] else float('nan'):>11.2f}"
              f"   {'within' if good else 'NOT within'} the goal (hit +-10 %, TTFT mean +-20 %)")
    for policy in args.policies.split(","):
        # NOTE: routing decisions made without the index (Lookup past its deadline, breaker open)
        # are the live host's, not the policy's: the simulator's Lookup never misses.
        print(f"{policy}: decisions live {live[policy].get('decisions')} (without the index: "
              f"{live[policy].get('index_fallbacks')}), simulated {runs[policy]['decisions']} "
              f"(without the index: {runs[policy]['index_fallbacks']})")
    print(f"oracle hit rate: live bench {live['oracle_hit_rate']:.3f} (16-token blocks), simulator "
          f"{sim['oracle_hit_rate']:.3f} ({args.block_size}-token blocks)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
