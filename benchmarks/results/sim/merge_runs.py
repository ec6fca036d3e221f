"""One folder of `kvmesh simulate --json` documents from several runs of the same shapes (issue 51).

    .venv/bin/python benchmarks/results/sim/merge_runs.py OUT BASE [OVER ...]

For every ``*.json`` in BASE, writes OUT/<same name>: BASE's document with, for each OVER folder in order
that has a file of the same name (or, for BASE's catalog files ``catalog/<w>.json``, ``<w>.json``), that
run's policies put in place of BASE's: their capacities, capacity searches and full runs, and its limits
when it ran them (the information limit follows kv-aware's rule). Files only an OVER folder has are copied.
The runs must agree on the workload and on every setting both record (but the rates of their full runs).
``merged_from`` records, per policy, the folder its figures come from.

Why: a change to kv-aware's rule is rerun for kv-aware alone (the peers' code and inputs did not change: a
peer's capacity rerun on the new code is compared with its old figure to show it), and the goal table
(benchmarks/sim_goal_table.py --fleet) reads one folder. Workload and settings must agree, or it stops.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SAME_RUN = {"routing", "rates", "relative"}
"""Settings two runs may differ in: the policy's (each run's own) and the rates of the full runs beside the
capacity search."""


def differing(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The settings both runs record with different values (a setting added since one of them ran is left out:
    it held its default then)."""
    out = []
    for k in sorted(a.keys() & b.keys()):
        if not prefix and k in SAME_RUN:
            continue
        if isinstance(a[k], dict) and isinstance(b[k], dict):
            out += differing(a[k], b[k], f"{prefix}{k}.")
        elif a[k] != b[k]:
            out.append(prefix + k)
    return out


def merge(base: dict, over: dict, label: str) -> dict:
    if base["workload"] != over["workload"]:
        raise SystemExit(f"{label}: a different workload ({over['workload']} vs {base['workload']})")
    diff = differing(base["settings"], over["settings"])
    if diff:
        raise SystemExit(f"{label}: different settings {diff}")
    out = dict(base)
    policies = list(over["capacity"])
    out["capacity"] = {**base["capacity"], **over["capacity"]}
    out["capacity_search"] = {**base.get("capacity_search", {}), **over.get("capacity_search", {})}
    out["runs"] = [r for r in base.get("runs", []) if r.get("policy") not in policies] + list(over.get("runs", []))
    if over.get("limits"):
        out["limits"] = over["limits"]
    frm = dict(base.get("merged_from") or dict.fromkeys(base["capacity"], "base"))
    frm.update(dict.fromkeys(policies, label))
    out["merged_from"] = frm
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, base, overs = Path(argv[0]), Path(argv[1]), [Path(a) for a in argv[2:]]
    out.mkdir(parents=True, exist_ok=True)
    names = sorted({p.name for p in base.glob("*.json")} | {p.name for o in overs for p in o.glob("*.json")})
    for name in names:
        doc = json.loads((base / name).read_text()) if (base / name).is_file() else None
        for o in overs:
            f = o / name
            if f.is_file():
                run = json.loads(f.read_text())
                doc = run if doc is None else merge(doc, run, f"{o.name}/{name}")
                if "merged_from" not in doc:
                    doc["merged_from"] = dict.fromkeys(doc["capacity"], o.name)
        if doc is not None:
            (out / name).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
            print(f"{out / name}: " + ", ".join(f"{p} {doc['capacity'][p]:.3f} ({doc['merged_from'].get(p, 'base')})"
                                                for p in sorted(doc["capacity"])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
