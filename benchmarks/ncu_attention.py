"""Nsight Compute on the Triton attention: where a decode batch's time goes, per head shape.

Runs ``kernel_bench.py --launch-once`` (each shape's decode-heavy batch, one launch each) under
``ncu`` with the SpeedOfLight, MemoryWorkloadAnalysis, Occupancy and LaunchStats sections, keeps
the attention kernel's launches, and prints and writes the figures that say whether it is at the
memory roofline: DRAM throughput (% of peak), memory and compute throughput, duration, achieved
occupancy, registers per thread, grid and block. Needs ``ncu`` (on PATH, or under /usr/local/cuda
or /opt/nvidia/nsight-compute) and permission to read the GPU's counters; without either it says
which and exits 3 (``make gpu-check`` reports the part as skipped with that reason).

Run: python benchmarks/ncu_attention.py [--shapes 32/8x128,14/2x64] [--scenarios decode-heavy] [--json OUT]
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

KERNEL = "_ragged_paged_attention_kernel"
KEEP = ("DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Duration", "Achieved Occupancy",
        "Registers Per Thread", "Grid Size", "Block Size", "L1/TEX Hit Rate", "L2 Hit Rate", "Theoretical Occupancy")


def find_ncu() -> str | None:
    """The ncu binary: on PATH, else where the CUDA toolkit or Nsight Compute installs it."""
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/usr/local/cuda-*/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def parse_details(text: str, labels: list[str]) -> list[dict]:
    """``ncu --csv --page details`` output -> one dict per attention launch, in launch order, each
    labelled with ``labels[i]`` (the shape/scenario that launched it) and the kept metrics."""
    start = text.find('"ID"')
    if start < 0:
        return []
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        if KERNEL not in row.get("Kernel Name", ""):
            continue
        launch = launches.setdefault(row["ID"], {"kernel": KERNEL, "grid": row.get("Grid Size"),
                                                 "block": row.get("Block Size"), "metrics": {}})
        name = row.get("Metric Name", "")
        if name in KEEP:
            unit = row.get("Metric Unit", "")
            launch["metrics"][name] = f"{row.get('Metric Value', '')} {unit}".strip()
    out = [launches[k] for k in sorted(launches, key=int)]
    for launch, label in zip(out, labels, strict=False):
        launch["label"] = label
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32/8x128,14/2x64")
    ap.add_argument("--scenarios", default="decode-heavy")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ncu = find_ncu()
    if ncu is None:
        print("ncu_attention: Nsight Compute (ncu) not found on PATH, /usr/local/cuda or /opt/nvidia/nsight-compute; "
              "nothing profiled", file=sys.stderr)
        return 3
    labels = [f"{shape} {sc}" for shape in args.shapes.split(",") for sc in args.scenarios.split(",")]
    bench = Path(__file__).with_name("kernel_bench.py")
    cmd = [ncu, "--target-processes", "all", "--kernel-name", f"regex:{KERNEL}", "--launch-count", str(len(labels)),
           "--section", "SpeedOfLight", "--section", "MemoryWorkloadAnalysis", "--section", "Occupancy",
           "--section", "LaunchStats", "--csv", "--page", "details",
           sys.executable, str(bench), "--shapes", args.shapes, "--scenarios", args.scenarios, "--launch-once"]
    print(" ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    launches = parse_details(done.stdout, labels)
    if done.returncode != 0 or not launches:
        why = (done.stderr + done.stdout)[-2500:]
        print(f"ncu_attention: ncu exited {done.returncode} with {len(launches)} attention launches profiled:\n{why}",
              file=sys.stderr)
        if "ERR_NVGPUCTRPERM" in why:
            print("ncu_attention: this user may not read the GPU's performance counters (ERR_NVGPUCTRPERM): run as "
                  "root or with NVreg_RestrictProfilingToAdminUsers=0", file=sys.stderr)
        return 1
    for launch in launches:
        m = launch["metrics"]
        print(f"{launch.get('label', '?'):<28} grid {launch['grid']:<14} " +
              ", ".join(f"{k} {m[k]}" for k in KEEP if k in m))
    if args.json:
        Path(args.json).write_text(json.dumps({"ncu": ncu, "launches": launches}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
