"""Runs of the simulated mesh: one (policy, rate), a rate sweep, the capacity search, the oracle.

Results are plain dicts of rounded numbers (no wall clock in them), so the same seed gives the same
JSON byte for byte. Sweeps can run in several processes (``jobs``); results are assembled in a fixed
order, so the JSON does not depend on ``jobs`` either.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from kvmesh.contract.block_hash import XXH3_128, BlockHasher
from kvmesh.model_worker.simulated.step_time import gpu_spec
from kvmesh.replay.records import RequestRecord, stats
from kvmesh.replay.records import summarize as summarize_records
from kvmesh.sim import information_limit
from kvmesh.sim.config import MODEL_ID, SimConfig, fleet_capacity_blocks
from kvmesh.sim.fleet import fleet_counts, fleet_spec
from kvmesh.sim.goodput import goodput
from kvmesh.sim.information_limit import INFORMATION_LIMIT, ZERO_DELAYS
from kvmesh.sim.mesh import Mesh
from kvmesh.sim.oracle import lru_hit_rate
from kvmesh.sim.pd import parse_policy
from kvmesh.sim.work_bound import work_bound
from kvmesh.sim.workload import Workload

ROUND = 6
"""Decimals kept in the JSON (virtual times are exact; rounding keeps the file readable)."""


def _r(x: float) -> float:
    return round(float(x), ROUND)


def sim_model_dir() -> Path:
    """A config-only model directory (vocabulary and EOS ids; no weights, no tokenizer to load)."""
    from kvmesh.make_model import cache_dir, ensure_default_model

    target = cache_dir() / "models" / "sim-config"
    if (target / "config.json").is_file():
        return target
    src = ensure_default_model()
    tmp = Path(tempfile.mkdtemp(prefix="sim-config.", dir=target.parent))
    for name in ("config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, tmp / name)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def chains_for(workload: Workload, block_size: int) -> list[list[bytes]]:
    """The workload's block chains under the simulated workers' hash spec (xxh3_128, cached)."""
    return workload.chains(BlockHasher(MODEL_ID, block_size, XXH3_128))


def oracle_hit_rate(workload: Workload, cfg: SimConfig) -> float:
    """Cached / prompt tokens through one LRU cache of all workers' blocks (no policy can beat it).

    The same rule as kvmesh/sim/oracle.py, on the simulated block size: only leading hits count,
    the last prompt token is always computed, a chain's tail is evicted before its head.
    """
    chains = chains_for(workload, cfg.block_size)
    return lru_hit_rate(((r.prompt_len, chain) for r, chain in zip(workload.requests, chains, strict=True)),
                        fleet_capacity_blocks(cfg), cfg.block_size)


def summarize(mesh: Mesh, records: Sequence[RequestRecord]) -> dict:
    """One run's figures (virtual seconds)."""
    cfg = mesh.cfg
    s = summarize_records(records, [w.worker_id for w in mesh.workers])
    ttft, tpot, e2e = stats(s.ttft), stats(s.tpot), stats(s.e2e)
    start = records[0].arrival if records else 0.0
    end = max((r.finish for r in records if r.success), default=start)
    span = max(end - start, 1e-9)
    met = sum(1 for r in records if r.slo_ok)
    decisions: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    for router in mesh.routers:
        for k, v in router.observer.decisions.items():
            decisions[k] = decisions.get(k, 0) + v
        for k, v in router.observer.fallbacks.items():
            fallbacks[k] = fallbacks.get(k, 0) + v
    return {
        "policy": cfg.policy, "rate": _r(cfg.rate),
        "ttft_mean_s": _r(ttft["mean"]), "ttft_p50_s": _r(ttft["p50"]),
        "ttft_p90_s": _r(ttft["p90"]), "ttft_p99_s": _r(ttft["p99"]),
        "tpot_p50_s": _r(tpot["p50"]), "tpot_p99_s": _r(tpot["p99"]),
        "e2e_mean_s": _r(e2e["mean"]), "e2e_p50_s": _r(e2e["p50"]), "e2e_p99_s": _r(e2e["p99"]),
        "input_tok_s": _r(s.prompt_tokens / span), "output_tok_s": _r(s.output_tokens / span),
        "hit_rate": _r(s.hit_rate),
        "slo_attainment": _r(met / len(records)) if records else 0.0,
        "max_mean_load": _r(s.max_mean_load),
        "completed": s.completed, "failed": s.failed, "unfinished": s.unfinished,
        "stopped_early": mesh.stopped_early,
        "busy_s_per_worker": _r(sum(w.busy_s for w in mesh.workers) / len(mesh.workers)),
        "virtual_s": _r(mesh.q.now),
        "decisions": dict(sorted(decisions.items())), "index_fallbacks": dict(sorted(fallbacks.items())),
        "lost_event_batches": mesh.lost_batches, "resyncs": sum(w.resyncs for w in mesh.workers),
        # NOTE: added after the results of 2026-11-22; every key above keeps its meaning
        "index_traffic": mesh.index.traffic.as_dict(),
    } | (pd_summary(mesh, records) if cfg.pd or cfg.slo_itl_s else {}) | (
        {k: {a: _r(b) for a, b in v.items()} if isinstance(v, dict) else _r(v)
         for k, v in goodput(records, mesh.objectives, span).items()} if mesh.objectives else {})


def pd_summary(mesh: Mesh, records: Sequence[RequestRecord]) -> dict:
    """A P/D fleet's or an ITL SLO's figures (issue 44): inter-token gaps and what the split requests did."""
    done = [r for r in records if r.finish is not None and not r.failed and r.completion_tokens > 1]
    itl = stats([r.max_itl for r in done])
    return {"max_itl_p50_s": _r(itl["p50"]), "max_itl_p99_s": _r(itl["p99"]),
            "pd": mesh.pd_stats.as_dict()}


class RunFailed(Exception):
    """One simulated run raised: which policy, rate and seed, and the error with its traceback."""

    def __init__(self, policy: str, rate: float, seed: int, error: str, trace: str = "") -> None:
        super().__init__(policy, rate, seed, error, trace)
        self.policy, self.rate, self.seed, self.error, self.trace = policy, rate, seed, error, trace

    def __str__(self) -> str:
        return f"policy {self.policy} at rate {self.rate:g} (seed {self.seed}) failed: {self.error}"

    def as_dict(self, kind: str) -> dict:
        return {"kind": kind, "policy": self.policy, "rate": _r(self.rate), "seed": self.seed, "error": self.error}


BRACKET_STEPS = 12
"""Runs the capacity search's bracket makes at most (up or down by 1.5x from its start)."""


@dataclass
class Sim:
    """A workload and the settings every run of a sweep shares."""

    workload: Workload
    base: SimConfig

    def config(self, policy: str, rate: float, **changes) -> SimConfig:
        """One run's settings; the information limit's are kv-aware's with no delays."""
        if policy == INFORMATION_LIMIT:
            policy, changes = "kv-aware", {**ZERO_DELAYS, **changes}
        # NOTE: a P/D mode rides on the policy's name (kvmesh/sim/pd.py): kv-aware+auto, llm-d+pd, ...
        policy, split = parse_policy(policy)
        if split:
            changes = {**changes, "pd_split": split}
        routing = dataclasses.replace(self.base.routing, policy=policy)
        return dataclasses.replace(self.base, routing=routing, rate=rate, **changes)

    def run(self, policy: str, rate: float, *, stop_early: bool = False,
            progress: Callable[[float], None] | None = None) -> dict:
        """One run; with ``stop_early`` it ends once attainment can no longer reach the SLO target.
        ``policy`` is a registered policy, or :data:`INFORMATION_LIMIT` (kvmesh/sim/information_limit.py)."""
        cfg = self.config(policy, rate, stop_when_slo_lost=stop_early)
        chains = chains_for(self.workload, cfg.block_size)
        gc.collect()
        gc.freeze()  # NOTE: the chains and the workload never die: keep the collector off them
        thresholds = gc.get_threshold()
        # NOTE: a run allocates millions of short-lived objects; frequent young collections cost
        # ~20 % of its time and find little (the engines' objects live for the whole run).
        gc.set_threshold(100_000, 50, 50)
        t0 = time.perf_counter()
        try:
            mesh = Mesh(cfg, self.workload, sim_model_dir(), chains, progress)
            if policy == INFORMATION_LIMIT:
                information_limit.install(mesh)
            records = mesh.run()
        except Exception as exc:  # NOTE: one run's defect must not lose a sweep's finished runs
            raise RunFailed(policy, rate, cfg.seed, f"{type(exc).__name__}: {exc}",
                            traceback.format_exc()) from exc
        finally:
            gc.set_threshold(*thresholds)
        out = summarize(mesh, records)
        out["policy"] = policy
        out["_wall_s"] = time.perf_counter() - t0  # NOTE: dropped from the JSON (not deterministic)
        return out

    def passes(self, result: dict) -> bool:
        return not result["stopped_early"] and result["slo_attainment"] >= self.base.slo_target

    def capacity(self, policy: str, start: float = 1.0, precision: float = 0.02,
                 on_run: Callable[[dict], None] | None = None) -> tuple[float, list[dict]]:
        """The highest rate with attainment >= the target, by bisection (in log rate) to ``precision``.

        Returns the capacity (0.0 when even the lowest rate tried fails) and every run made.

        After two failures (``start`` and ``start / 1.5``) it tries the lowest rate the bracket can reach
        (``start / 1.5 ** (BRACKET_STEPS - 1)``) before stepping further down: when that fails as well the capacity
        is 0 after three runs, not after up to twelve ever longer ones (a policy whose misses no rate spreads);
        when it passes, the descent goes on as before (one run more).
        """
        runs: list[dict] = []
        passed: dict[float, bool] = {}  # NOTE: runs are deterministic: the floor's is not made twice

        def ok(rate: float) -> bool:
            if rate in passed:
                return passed[rate]
            res = self.run(policy, rate, stop_early=True)
            runs.append(res)
            if on_run is not None:
                on_run(res)
            passed[rate] = self.passes(res)
            return passed[rate]

        def bracket(k: int) -> float:  # start x 1.5 ** k, one rounding (the floor's rate is met again exactly)
            return start * 1.5 ** k if k >= 0 else start / 1.5 ** -k

        lo = hi = None
        k = 0
        for step in range(BRACKET_STEPS):  # bracket: up or down by 1.5x
            if step == 2 and lo is None and not ok(bracket(1 - BRACKET_STEPS)):
                return 0.0, runs  # the lowest rate the bracket reaches fails too: no rate on the way down passes
            rate = bracket(k)
            if ok(rate):
                lo = rate
                if hi is not None:
                    break
                k += 1
            else:
                hi = rate
                if lo is not None:
                    break
                k -= 1
        if lo is None:
            return 0.0, runs
        if hi is None:
            return lo, runs
        while hi / lo > 1 + precision:
            mid = math.sqrt(lo * hi)
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return _r(lo), runs


# -- sweeps in worker processes ------------------------------------------------------------------
_SIM: Sim | None = None


def _init(sim: Sim) -> None:
    global _SIM
    _SIM = sim


def _job(kind: str, policy: str, rate: float) -> tuple[str, str, float, object]:
    assert _SIM is not None
    return _attempt(_SIM, kind, policy, rate)


def _attempt(sim: Sim, kind: str, policy: str, rate: float,
             on_run: Callable[[dict], None] | None = None) -> tuple[str, str, float, object]:
    """One sweep item; a failed run comes back as its :class:`RunFailed`, not raised."""
    try:
        if kind == "capacity":
            return kind, policy, rate, sim.capacity(policy, start=rate, on_run=on_run)
        res = sim.run(policy, rate)
        if on_run is not None:
            on_run(res)
        return kind, policy, rate, res
    except RunFailed as exc:
        return kind, policy, rate, exc


class Progress:
    """One line on stderr: a bar over the runs done, the last run's figures."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def add_total(self, n: int) -> None:
        self.total += n

    def tick(self, res: dict) -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        verdict = "stopped" if res["stopped_early"] else f"attain {res['slo_attainment']:.3f}"
        sys.stderr.write(f"\r[{bar}] {self.done:>3} runs  {time.perf_counter() - self.t0:6.0f}s  "
                         f"{res['policy']:<13} rate {res['rate']:<8.4g} {verdict:<14}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


Item = tuple[str, str, float]
"""One sweep item: ("capacity", policy, start rate) or ("run", policy, rate)."""


def execute(sim: Sim, jobs: int, bar: Progress, searches: list[Item], runs: list[Item],
            scaled: Callable[[object], list[Item]] | None = None, baseline: str = "") -> tuple[dict[Item, object], list[Item]]:
    """Runs ``searches`` and ``runs`` (in ``jobs`` processes), then the runs ``scaled`` makes of the
    ``baseline``'s search result, as soon as that is known. Returns every item's result (a search's
    ``(capacity, runs)``, a run's dict, or its RunFailed) and the runs made, in the serial order.

    NOTE: in processes there is no barrier between the searches and the runs: the baseline's search
    goes first, the runs scaled by its capacity follow when it is done, while the runs at fixed
    rates fill the pool; callers assemble results in the serial order, so the JSON is the same.
    """
    done: dict[Item, object] = {}
    key = ("capacity", baseline, 1.0)
    runs = list(runs)
    if jobs <= 1:
        for it in searches:
            done[it] = _attempt(sim, *it, on_run=bar.tick)[3]
        runs += scaled(done[key]) if scaled is not None else []
        for it in runs:
            done[it] = _attempt(sim, *it, on_run=bar.tick)[3]
        return done, runs
    pool = ProcessPoolExecutor(jobs, initializer=_init, initargs=(sim,))
    try:
        futures = {pool.submit(_job, *it): it for it in sorted(searches, key=lambda it: it[1] != baseline) + runs}
        while futures:
            finished, _ = wait(futures, return_when=FIRST_COMPLETED)
            for f in finished:
                it = futures.pop(f)
                res = done[it] = f.result()[3]
                if not isinstance(res, RunFailed):
                    for r in res[1] if it[0] == "capacity" else [res]:  # type: ignore[index]
                        bar.tick(r)  # type: ignore[arg-type]
            if scaled is not None and key in done:
                extra, scaled = scaled(done[key]), None
                runs += extra
                futures.update({pool.submit(_job, *it): it for it in extra})
    finally:
        pool.shutdown()
    return done, runs


def sweep(sim: Sim, policies: Sequence[str], rates: Sequence[float] = (), *, capacity: bool = True,
          relative: Sequence[float] = (), baseline: str = "round-robin", jobs: int = 1,
          progress: bool = True, limits: bool = True) -> dict:
    """Every policy's capacity, full runs at ``rates`` and at ``relative`` x the baseline's capacity;
    with ``limits``, the information limit's capacity (with ``capacity``) and the work bound.

    Returns the JSON document (see docs/cli.md, ``kvmesh simulate --json``). A run that raises is
    listed under ``failures`` (kind, policy, rate, seed, error; the traceback goes to stderr) and
    the sweep goes on; that policy has no capacity, and the caller decides the exit code.
    """
    if relative and not (capacity and baseline in policies):
        raise ValueError(f"relative rates need the capacity of {baseline!r}: add it to --policies")
    searched = [*policies, INFORMATION_LIMIT] if capacity and limits else list(policies)
    bar = Progress(len(searched) * (8 if capacity else 0) + len(policies) * (len(rates) + len(relative)),
                   progress)
    chains_for(sim.workload, sim.base.block_size)  # NOTE: once, before the workers fork: they share it
    searches: list[Item] = [("capacity", p, 1.0) for p in searched] if capacity else []

    def scaled(res: object) -> list[Item]:
        """The runs at ``relative`` x the baseline's capacity (none when its search failed)."""
        return [] if isinstance(res, RunFailed) else [("run", p, _r(x * res[0])) for p in policies  # type: ignore[index]
                                                      for x in relative]

    try:
        done, full = execute(sim, jobs, bar, searches, [("run", p, r) for p in policies for r in rates],
                             scaled if relative else None, baseline)
    finally:
        bar.close()
    if relative and isinstance(done[("capacity", baseline, 1.0)], RunFailed):
        relative = ()  # NOTE: the baseline's search failed: nothing was scaled by it
    runs: list[dict] = []
    caps: dict[str, float] = {}
    info: float | None = None
    search: dict[str, list[dict]] = {}
    failures: list[dict] = []
    for it in searches + full:  # NOTE: in the serial order, whichever finished first
        res = done[it]
        if isinstance(res, RunFailed):
            failures.append(res.as_dict(it[0]))
            sys.stderr.write(f"\n{res}\n{res.trace}")
        elif it[0] == "run":
            runs.append(res)  # type: ignore[arg-type]
        elif it[1] == INFORMATION_LIMIT:
            info, search[it[1]] = res  # type: ignore[misc]
        else:
            caps[it[1]], search[it[1]] = res  # type: ignore[misc]
    wall = sum(r.pop("_wall_s", 0.0) for r in runs) + sum(r.pop("_wall_s", 0.0) for t in search.values() for r in t)
    doc = {
        "oracle_hit_rate": _r(oracle_hit_rate(sim.workload, sim.base)),
        "capacity": caps,
        "routers": sim.base.routers,
    }
    if limits:
        bound = work_bound(sim.workload, sim.base, chains_for(sim.workload, sim.base.block_size))
        doc["limits"] = {"information": info, "work_bound": bound.rate, "saturation": bound.saturation}
    doc |= {
        "runs": runs,
        "capacity_search": search,
        "workload": {"name": sim.workload.name, "requests": len(sim.workload), "description": sim.workload.description,
                     "duration_s_at_rate_1": _r(sim.workload.duration_s)},
        "settings": settings_of(sim.base, baseline=baseline, relative=list(relative)),
    }
    if failures:
        doc["failures"] = failures
    doc["_wall_s"] = wall
    return doc


def _settings(obj: object, top: bool = False) -> dict:
    out = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if top and f.name in ("rate", "stop_when_slo_lost"):
            continue  # NOTE: per run, not a setting of the sweep
        v = getattr(obj, f.name)
        if callable(v) or (not top and f.name == "seed") or f.name.startswith("_"):
            continue  # a clock; a policy's seed (the simulator derives it per router)
        out[f.name] = _settings(v) if dataclasses.is_dataclass(v) else list(v) if isinstance(v, tuple) else v
    return out


def settings_of(cfg: SimConfig, **extra) -> dict:
    out = _settings(cfg, top=True)
    gpus = cfg.worker_gpus()
    out["workers"] = len(gpus)
    out["fleet"] = fleet_spec(gpus)
    out.pop("routing", None)
    out["routing"] = {k: v for k, v in _settings(cfg.routing).items() if k != "policy"}
    out["blocks_per_worker"] = {gpu: cfg.blocks_per_worker(gpu) for gpu in fleet_counts(gpus)}
    if cfg.cost is None and cfg.step_time.cost_model == "roofline":
        out["gpus"] = {gpu: dataclasses.asdict(gpu_spec(gpu)) for gpu in fleet_counts(gpus)}
    out.update(extra)
    return out


def dump(doc: dict) -> str:
    """The JSON text (keys in a fixed order, no wall-clock fields)."""
    return json.dumps({k: v for k, v in doc.items() if not k.startswith("_")}, indent=1, sort_keys=False) + "\n"


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
