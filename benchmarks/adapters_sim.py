"""Issue 52's simulator goals: the multi-adapter workload (64 LoRA adapters, Zipf 1.1, 4 GPU slots per worker,
8 workers), each policy's capacity at the SLO (`kvmesh simulate`'s capacity search), kv-aware / the best peer;
with a CPU cache of 16 adapters per worker and with every load from disk (--max-cpu-loras 0). Goals >= 1.15 each.

Usage: .venv/bin/python benchmarks/adapters_sim.py [--max-requests N] [--out DIR]
(results: benchmarks/results/sim/adapters/{cpu16,disk}.json and summary.json; docs/adapters.md has the figures)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("kv-aware-no-residency", "round-robin", "dynamo", "llm-d-lora-affinity", "llm-d-lora-load-state")
GOAL = 1.15


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-requests", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/sim/adapters")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for label, cpu in (("cpu16", 16), ("disk", 0)):
        out = args.out / f"{label}.json"
        subprocess.run([str(ROOT / ".venv/bin/kvmesh"), "simulate", "--workload", "multi-adapter",
                        "--max-requests", str(args.max_requests), "--workers", "8", "--max-loras", "4",
                        "--max-cpu-loras", str(cpu), "--policies", ",".join(("kv-aware", *PEERS)),
                        "--relative-rates", "", "--no-limits", "--no-progress", "--jobs", str(args.jobs),
                        "--json", str(out)], check=True, cwd=ROOT)
        caps = json.loads(out.read_text())["capacity"]
        best = max(PEERS, key=lambda p: caps[p])
        ratio = caps["kv-aware"] / caps[best] if caps[best] else float("inf")
        summary[label] = {"max_cpu_loras": cpu, "capacity": caps, "best_peer": best, "ratio": round(ratio, 3),
                          "goal": GOAL, "met": ratio >= GOAL}
        print(f"{label}: kv-aware {caps['kv-aware']:.3g} / {best} {caps[best]:.3g} = {ratio:.2f} "
              f"(goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'})", flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
