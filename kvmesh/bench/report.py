"""Per-request records (kvmesh/replay/records.py) -> the serving report (vLLM `bench serve` layout), its
JSON and plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from kvmesh.replay.records import RequestRecord, stats
from kvmesh.replay.records import summarize as summarize_records


def summarize(records: Sequence[RequestRecord], duration_s: float, time_scale: float = 1.0,
              workers: Sequence[str] = ()) -> dict:
    """The report as a dict (the `--save-result` JSON): kvmesh/replay/records.py's summary in vLLM's
    units (ms, per second of the run).

    Args:
        records: one per request sent.
        duration_s: wall time from the first send to the last response.
        time_scale: wall seconds per reported second (a simulated stack running ``1/time_scale``
            times faster than its GPU model reports modelled times); 1 for real stacks.
        workers: every worker that could serve (zero-load workers count in the load share).
    """
    s = summarize_records(records, workers)
    k = 1.0 / time_scale
    duration = duration_s * k
    total_served = sum(s.served.values())
    return {
        "completed": s.completed,
        "failed": s.requests - s.completed,
        "duration_s": duration,
        "total_input_tokens": s.prompt_tokens,
        "total_output_tokens": s.output_tokens,
        "request_throughput": s.completed / duration if duration else 0.0,
        "output_throughput": s.output_tokens / duration if duration else 0.0,
        "total_token_throughput": (s.prompt_tokens + s.output_tokens) / duration if duration else 0.0,
        "ttft_ms": stats([t * k for t in s.ttft], 1000.0),
        "tpot_ms": stats([t * k for t in s.tpot], 1000.0),
        "itl_ms": stats([g * k for g in s.itl], 1000.0),
        "e2el_ms": stats([t * k for t in s.e2e], 1000.0),
        "prefix_hit_rate": s.hit_rate,
        "worker_load_share": {w: n / total_served for w, n in sorted(s.served.items())} if total_served else {},
        "max_mean_load": s.max_mean_load,
        "errors": s.errors,
        "time_scale": time_scale,
    }


def format_report(s: dict, title: str = "Serving Benchmark Result") -> str:
    """The report as text, in vLLM's layout plus the prefix and worker sections."""
    lines = [f"{title:=^50}"]

    def row(name: str, value: float | int, fmt: str = ".2f") -> None:
        lines.append(f"{name:<40}{value:<10{fmt}}")

    row("Successful requests:", s["completed"], "d")
    row("Failed requests:", s["failed"], "d")
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"], "d")
    row("Total generated tokens:", s["total_output_tokens"], "d")
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total Token throughput (tok/s):", s["total_token_throughput"])
    for key, head, label in (("ttft_ms", "Time to First Token", "TTFT"),
                             ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl_ms", "Inter-token Latency", "ITL"), ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append(f"{head:-^50}")
        row(f"Mean {label} (ms):", s[key]["mean"])
        row(f"Median {label} (ms):", s[key]["median"])
        row(f"P99 {label} (ms):", s[key]["p99"])
    lines.append(f"{'Prefix cache and workers':-^50}")
    row("Prefix hit rate (cached/prompt):", s["prefix_hit_rate"], ".4f")
    row("Max/mean worker load (tokens):", s["max_mean_load"], ".3f")
    for w, share in s["worker_load_share"].items():
        row(f"  load share {w}:", share, ".4f")
    if s.get("time_scale", 1.0) != 1.0:
        lines.append(f"(simulated: times and rates in modelled seconds, wall x {1 / s['time_scale']:g})")
    lines.append("=" * 50)
    return "\n".join(lines)


def save_result(path: str | Path, summary: dict, config: dict, records: Sequence[RequestRecord] = ()) -> None:
    """Writes the summary, the run's settings and (optionally) per-request records as JSON."""
    doc = {"config": config, **summary}
    if records:
        doc["requests"] = [asdict(r) for r in records]
    Path(path).write_text(json.dumps(doc, indent=1))


def load_timeline(records: Sequence[RequestRecord], step_s: float = 1.0) -> tuple[list[float], dict[str, list[int]]]:
    """Per worker, requests in flight at each ``step_s`` tick (the load-over-time plot's data)."""
    ok = [r for r in records if r.success]
    if not ok:
        return [], {}
    end = max(r.finish for r in ok)
    ticks = [i * step_s for i in range(int(end / step_s) + 2)]
    out: dict[str, list[int]] = {}
    for w in sorted({r.worker for r in ok}):
        mine = [(r.arrival, r.finish) for r in ok if r.worker == w]
        out[w] = [sum(1 for a, b in mine if a <= t < b) for t in ticks]
    return ticks, out


def write_plots(records: Sequence[RequestRecord], out_dir: str | Path, time_scale: float = 1.0,
                title: str = "") -> list[Path]:
    """TTFT CDF and per-worker in-flight requests over time as PNGs; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    k = 1.0 / time_scale
    ttft = np.sort([r.ttft * k * 1000 for r in records if r.success and r.ttft is not None])
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    if len(ttft):
        ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF {title}".strip())
    ax.grid(True, alpha=0.3)
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    duration = max((r.finish for r in records if r.success), default=1.0)
    ticks, load = load_timeline(records, max(duration / 200, 0.05))
    fig, ax = plt.subplots(figsize=(7, 4))
    for w, series in load.items():
        ax.plot([t * k for t in ticks], series, label=w, linewidth=0.8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests in flight")
    ax.set_title(f"Per-worker load {title}".strip())
    if load:
        ax.legend(fontsize=6, ncol=2)
    paths.append(out / "worker_load.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return paths
