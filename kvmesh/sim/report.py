"""`kvmesh simulate` output: the table, and the PNGs (TTFT p90 and SLO attainment vs rate)."""

from __future__ import annotations

from pathlib import Path


def format_table(doc: dict) -> str:
    """Capacities (with the ratio to the best other policy) and every full run."""
    lines: list[str] = []
    w = doc["workload"]
    lines.append(f"workload {w['name']}: {w['requests']} requests, {w['duration_s_at_rate_1']:.0f} s at rate 1 "
                 f"({w['description']})")
    lines.append(f"oracle hit rate (one LRU cache of all workers' blocks): {doc['oracle_hit_rate']:.3f}")
    caps = doc.get("capacity") or {}
    if caps:
        lines.append("")
        lines.append(f"{'policy':<14}{'capacity':>10}{'÷ best other':>14}")
        for p, c in caps.items():
            others = [v for k, v in caps.items() if k != p]
            best = max(others, default=0.0)
            ratio = f"{c / best:.3f}" if best else "-"
            lines.append(f"{p:<14}{c:>10.4g}{ratio:>14}")
    limits = doc.get("limits")
    if limits:
        info, bound = limits.get("information"), limits.get("work_bound")
        ours = caps.get("kv-aware")
        lines.append("")
        lines.append("limits (docs/benchmarks.md, \"Limits\"):")
        if info is not None:
            ratio = f"   kv-aware / it: {ours / info:.3f}" if ours is not None and info else ""
            lines.append(f"  information limit (kv-aware's rule on exact engine state and step cost, no delays) "
                         f"{info:.4g}{ratio}")
        shown = "none (no rate is too high)" if bound is None else f"{bound:.4g}"
        lines.append(f"  work bound (oracle hits, perfect balance, SLO deadlines: no policy exceeds it) {shown}")
        if limits.get("saturation") is not None:
            lines.append(f"  saturation (the least work fills every GPU over the arrival span; not a bound: a finite "
                         f"run drains after its last arrival) {limits['saturation']:.4g}")
    runs = doc.get("runs") or []
    if runs:
        lines.append("")
        head = (f"{'policy':<14}{'rate':>8}{'TTFT mean':>10}{'p50':>8}{'p90':>8}{'p99':>8}{'TPOT p50':>9}"
                f"{'p99':>7}{'out tok/s':>10}{'hit':>7}{'hit/orc':>8}{'max/mean':>9}{'SLO':>7}{'ok':>6}{'fail':>5}")
        lines.append(head)
        lines.append("-" * len(head))
        oracle = doc["oracle_hit_rate"]
        for r in sorted(runs, key=lambda r: (r["rate"], list(caps).index(r["policy"]) if r["policy"] in caps else 0)):
            lines.append(f"{r['policy']:<14}{r['rate']:>8.4g}{r['ttft_mean_s']:>10.3f}{r['ttft_p50_s']:>8.3f}"
                         f"{r['ttft_p90_s']:>8.3f}{r['ttft_p99_s']:>8.2f}{r['tpot_p50_s'] * 1000:>8.1f}m"
                         f"{r['tpot_p99_s'] * 1000:>6.0f}m{r['output_tok_s']:>10.0f}{r['hit_rate']:>7.3f}"
                         f"{r['hit_rate'] / oracle if oracle else 0:>8.2f}{r['max_mean_load']:>9.2f}"
                         f"{r['slo_attainment']:>7.3f}{r['completed']:>6d}{r['failed']:>5d}")
        lines.append("times in virtual seconds (TPOT in ms); SLO = share of requests with TTFT <= "
                     f"{doc['settings']['slo_ttft_s']:g} s + {doc['settings']['slo_ttft_prefill_x']:g} x cold prefill "
                     f"and mean TPOT <= {doc['settings']['slo_tpot_s'] * 1000:g} ms")
    lines += goodput_lines(doc, caps)
    for f in doc.get("failures") or []:
        lines.append(f"FAILED: {f['kind']} of {f['policy']} at rate {f['rate']:g} (seed {f['seed']}): {f['error']}")
    return "\n".join(lines)


def goodput_lines(doc: dict, caps: dict) -> list[str]:
    """With --objectives: each full run's requests/s, goodput (requests/s meeting both objectives), the share, and
    kv-aware's goodput at the same rate ÷ the run's."""
    runs = [r for r in doc.get("runs") or [] if "goodput_rps" in r]
    if not runs:
        return []
    o = runs[0]["objectives"]
    lines = ["", f"goodput at the requests' objectives (TTFT <= {o['ttft_s']:g} s, mean TPOT <= "
                 f"{o['tpot_s'] * 1000:g} ms; --objectives):",
             f"{'policy':<20}{'rate':>8}{'req/s':>9}{'goodput':>9}{'met':>7}{'kv-aware ÷':>12}"]
    ours = {r["rate"]: r["goodput_rps"] for r in runs if r["policy"] == "kv-aware"}
    order = list(caps) or list(dict.fromkeys(r["policy"] for r in runs))
    for r in sorted(runs, key=lambda r: (r["rate"], order.index(r["policy"]) if r["policy"] in order else 0)):
        k = ours.get(r["rate"])
        ratio = f"{k / r['goodput_rps']:.3f}" if k is not None and r["goodput_rps"] else "-"
        lines.append(f"{r['policy']:<20}{r['rate']:>8.4g}{r['request_rps']:>9.3f}{r['goodput_rps']:>9.3f}"
                     f"{r['objectives_met']:>7.3f}{ratio:>12}")
    return lines


def plot(doc: dict, out_dir: str | Path, note: str = "") -> list[Path]:
    """ttft_p90_vs_rate.png and slo_vs_rate.png, one line per policy (full runs only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_policy: dict[str, list[dict]] = {}
    for r in doc.get("runs") or []:
        by_policy.setdefault(r["policy"], []).append(r)
    for tried in (doc.get("capacity_search") or {}).values():
        for r in tried:
            if not r["stopped_early"]:
                by_policy.setdefault(r["policy"], []).append(r)
    title = f"{doc['workload']['name']}, {doc['settings']['workers']} workers"
    paths = []
    for key, ylabel, name, log in (("ttft_p90_s", "TTFT p90 (s)", "ttft_p90_vs_rate.png", True),
                                   ("slo_attainment", "SLO attainment", "slo_vs_rate.png", False)):
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
        for policy, rows in by_policy.items():
            pts = sorted({r["rate"]: r[key] for r in rows}.items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=policy)
        if key == "slo_attainment":
            ax.axhline(doc["settings"]["slo_target"], color="grey", linestyle=":", linewidth=1)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("rate (x the workload's own arrival rate)")
        ax.set_ylabel(ylabel)
        ax.set_title(title + (f"\n{note}" if note else ""), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out / f"{doc['workload']['name']}_{name}"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
