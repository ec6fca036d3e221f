"""Sizing the index's Redis from figures: what 128 / 512 / 1,024 workers of one model send the
kv_service at capacity (the simulator; 4,096 extrapolated from 1,024), what each operation costs a
real redis-server running the project's Lua scripts (Redis CPU from INFO cpu), and the Redis nodes
one model needs, with and without Lookups read from replicas (--read-replicas).

    python benchmarks/index_sizing.py sim   [--out benchmarks/results/sizing]   # the simulator runs (~30 min)
    python benchmarks/index_sizing.py costs [--out ...]                         # Redis CPU per operation (~3 min)
    python benchmarks/index_sizing.py table [--out ...] [--markdown]            # the sizing table from both

**sim.** Per trace (conversation, synthetic; /work/shared/traces or --traces), kv-aware routing:
1. the capacity at 128 workers (highest rate with SLO attainment >= 0.9, bisection to 2 %),
   starting from the 8-worker capacity times 16 (docs/benchmarks.md), with the simulator's fast
   settings (64-token blocks, 64-step decode windows);
2. the same 128 workers at that capacity with the live settings (16-token blocks, one step per
   scheduling pass, as a GPU worker runs): the per-worker figures of the table, and the factors
   from fast to live settings (blocks x4.0, event messages ~x3, Lookups x1);
3. 512 and 1,024 workers at 4x and 8x that rate with the fast settings (live settings at 1,024
   workers would take ~20 GB of memory), scaled by the factors of 2.
Every run is the whole trace. JSON per run in --out (the summary of kvmesh/sim/run.py with
``index_traffic``).

**costs.** A private redis-server with one replica (--replicaof); the kv_service's store
(RedisIndex, --lookup-walk as given: search by default) as client, one operation kind at a time,
Redis CPU = used_cpu_user + used_cpu_sys of each node before and after, divided by the
operations: a block stored (64-block messages, fresh blocks), a block removed, one event message
with no block (the fixed cost of a publish script call), a heartbeat, on the master (feeding its
replica) and on the replica (applying the replication stream); a Lookup of the traces' mean chain
with W = 32 .. 1,024 live workers of the model (its fixed and per-worker parts), on the master and
(--read-replicas) on the replica.

**table.** Per index: script calls/s and Redis CPU-s/s = sum of figures x costs. A layout is N
shards (masters), each with R replicas: a master carries 1/N of the workers' events; with R = 0 it
also answers every Lookup for its W/N workers (sharding by worker: each shard searches the chain
for its own workers); with R >= 1 its replicas apply its events' replication stream and share its
Lookups. Nodes per model = the layout with the fewest nodes N x (1 + R) whose every node is under
--target of one core. 4,096 workers: the 1,024-worker run's figures per worker, Lookups x4 (the
rate x32 of 128 workers'), not simulated (the simulator would need ~80 GB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "sizing"
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
CAP8 = {"conversation": 1.861, "synthetic": 1.598}
"""kv-aware's capacity with 8 workers (docs/benchmarks.md, first 3,000 / all requests)."""
LIVE_BLOCK = 16
FAST = {"block_size": 64, "window_steps": 64}
LIVE = {"block_size": LIVE_BLOCK, "window_steps": 1}


# -- sim ----------------------------------------------------------------------------------------
def _run(sim, rate: float) -> dict:
    res = sim.run("kv-aware", rate)
    res.pop("_wall_s", None)
    return res


def cmd_sim(a: argparse.Namespace) -> int:
    from kvmesh.sim.config import SimConfig
    from kvmesh.sim.run import Sim
    from kvmesh.sim.workload import trace_workload

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in a.trace:
        workload = trace_workload(Path(a.traces) / TRACES[name])
        t0 = time.perf_counter()
        fast = Sim(workload, SimConfig(workers=128, **FAST))
        cap, tried = fast.capacity("kv-aware", start=CAP8[name] * 16)
        for r in tried:
            r.pop("_wall_s", None)
        (out / f"{name}_capacity_w128.json").write_text(json.dumps({"capacity": cap, "runs": tried}, indent=1))
        print(f"{name}: capacity at 128 workers {cap:g}x ({time.perf_counter() - t0:.0f} s)", flush=True)
        for workers, settings, tag in ((128, FAST, "fast"), (128, LIVE, "live"), (512, FAST, "fast"),
                                       (1024, FAST, "fast")):
            t0 = time.perf_counter()
            sim = Sim(workload, SimConfig(workers=workers, **settings))
            res = _run(sim, cap * workers / 128)
            res["settings"] = {"workers": workers, **settings}
            (out / f"{name}_w{workers}_{tag}.json").write_text(json.dumps(res, indent=1))
            print(f"  {workers} workers, {tag}: attainment {res['slo_attainment']}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    return 0


# -- costs --------------------------------------------------------------------------------------
def _cpu1(url: str) -> float:
    import redis

    info = redis.Redis.from_url(url).info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _replicated(master: str, replica: str) -> None:
    """Waits until the replica has the master's whole replication stream (so its CPU is counted)."""
    import redis

    m, r = redis.Redis.from_url(master), redis.Redis.from_url(replica)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if r.info("replication").get("slave_repl_offset") == m.info("replication")["master_repl_offset"]:
            return
        time.sleep(0.05)
    raise RuntimeError("the replica did not catch up")


async def _costs(url: str, chain_blocks: int, depth: int, reps: int, replica_url: str, lookup_walk: str) -> dict:
    from kvmesh.contract.index_protocol import Registration
    from kvmesh.contract.types import BlockRemoved, BlockStored, Load
    from kvmesh.kv_service.store_redis import RedisIndex

    def _cpu() -> dict[str, float]:
        """Each node's CPU-s, once the replica has applied everything (it counts the same operations)."""
        _replicated(url, replica_url)
        return {"master": _cpu1(url), "replica": _cpu1(replica_url)}

    def _sub(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: a[k] - b[k] for k in a}

    idx = RedisIndex(url, "sizing", max_connections=16, lookup_walk=lookup_walk)
    ridx = RedisIndex(url, "sizing", max_connections=16, lookup_walk=lookup_walk, read_replicas=True)
    now = int(time.time() * 1000)
    ttl = 3_600_000
    out: dict = {}
    # events: 64 workers, 64-block messages, 16 concurrent callers (the kv_service's shape)
    workers = [f"ev{w:03d}" for w in range(64)]
    for w in workers:
        await idx.register_worker(Registration(w, "10.0.0.1:50061", "ev", LIVE_BLOCK, "sha256_128", 1_000_000, 1),
                                  ttl, now)
    per_msg, msgs = 64, reps
    blocks = {w: [os.urandom(16) for _ in range(per_msg * msgs // len(workers))] for w in workers}
    seq = dict.fromkeys(workers, 0)

    async def drive(kind: str) -> tuple[float, int, int]:
        async def one(w: str) -> int:
            n = 0
            for i in range(0, len(blocks[w]), per_msg):
                seq[w] += 1
                part = blocks[w][i:i + per_msg]
                ev = [] if kind == "empty" else [BlockStored(part) if kind == "stored" else BlockRemoved(part)]
                await idx.publish(w, 1, seq[w], ev, now, Load(num_running=i % 7))
                n += 1
            return n

        c0 = _cpu()
        calls = sum(await asyncio.gather(*(one(w) for w in workers)))
        return _sub(_cpu(), c0), calls, calls * (0 if kind == "empty" else per_msg)

    cpus = {}
    for kind in ("stored", "removed", "empty"):
        cpu, calls, n = await drive(kind)
        cpus[kind] = cpu
        out[f"{kind}_calls"], out[f"{kind}_blocks"], out[f"{kind}_cpu_s"] = calls, n, cpu["master"]
        out[f"{kind}_replica_cpu_s"] = cpu["replica"]
    # NOTE: a message's fixed cost (the script call, order checks, the load) is counted per message;
    # a block's cost is what a message of 64 costs beyond that, per block. The replica's: the same
    # operations' replication stream applied (no script: the commands the scripts ran).
    for node, pre in (("master", ""), ("replica", "replica_")):
        out[f"{pre}us_per_event_message"] = 1e6 * cpus["empty"][node] / out["empty_calls"]
        for kind in ("stored", "removed"):
            fixed = out[f"{kind}_calls"] * out[f"{pre}us_per_event_message"] / 1e6
            out[f"{pre}us_per_block_{kind}"] = 1e6 * (cpus[kind][node] - fixed) / out[f"{kind}_blocks"]
    c0 = _cpu()
    for k in range(reps):
        await idx.heartbeat(workers[k % len(workers)], 1, Load(num_running=k % 5), ttl, now)
    hb = _sub(_cpu(), c0)
    out["us_per_heartbeat"] = 1e6 * hb["master"] / reps
    out["replica_us_per_heartbeat"] = 1e6 * hb["replica"] / reps
    # lookups: W live workers of one model; 8 of them hold the first `depth` blocks of the chain
    chain = [os.urandom(16) for _ in range(chain_blocks)]
    lookups: dict[int, float] = {}
    on_replica: dict[int, float] = {}
    registered = 0
    model = "lk"
    for w_live in (32, 128, 512, 1024):
        while registered < w_live:
            wid = f"lk{registered:04d}"
            await idx.register_worker(Registration(wid, "10.0.0.2:50061", model, LIVE_BLOCK, "sha256_128",
                                                   1_000_000, 1), ttl, now)
            if registered < 8:
                await idx.publish(wid, 1, 1, [BlockStored(chain[:depth - registered])], now)
            registered += 1
        for store, node, got in ((idx, "master", lookups), (ridx, "replica", on_replica)):
            await store.lookup(model, chain, now)  # scripts loaded, loads parsed
            await store.redis.check_replicas()
            c0 = _cpu()
            for _ in range(reps // 4):
                await store.lookup(model, chain, now)
            got[w_live] = 1e6 * _sub(_cpu(), c0)[node] / (reps // 4)
    if ridx.redis.replica_lookups < 4 * (reps // 4):
        raise RuntimeError(f"the replica answered {ridx.redis.replica_lookups} Lookups, not every one")
    out["us_per_lookup"], out["replica_us_per_lookup"] = lookups, on_replica
    for key, points in (("lookup_fit_us", lookups), ("replica_lookup_fit_us", on_replica)):
        # fit: cost = fixed + per_worker * W (least squares over the points)
        xs, ys = list(points), list(points.values())
        mx, my = statistics.mean(xs), statistics.mean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        out[key] = {"fixed": my - slope * mx, "per_live_worker": slope}
    out["lookup_chain_blocks"], out["lookup_depth_blocks"], out["lookup_walk"] = chain_blocks, depth, lookup_walk
    # the same 1,024 workers, a chain nobody holds (a miss at block 1)
    miss = [os.urandom(16) for _ in range(chain_blocks)]
    await idx.lookup(model, miss, now)
    c0 = _cpu()
    for _ in range(reps // 4):
        await idx.lookup(model, miss, now)
    out["us_per_lookup_miss_at_1024"] = 1e6 * _sub(_cpu(), c0)["master"] / (reps // 4)
    await idx.close()
    await ridx.close()
    return out


def cmd_costs(a: argparse.Namespace) -> int:
    from kvmesh.loopback import RedisServer

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    traffic = _load_runs(out)
    # the Lookup measured: the traces' mean chain (live block size) and the mean depth walked
    chain = round(statistics.mean(_chain_blocks(traffic[t]["w128_live"]) for t in traffic)) if traffic else 800
    depth = max(1, round(chain * (statistics.mean(traffic[t]["w128_live"]["hit_rate"] for t in traffic)
                                  if traffic else 0.3)))
    with RedisServer() as master, RedisServer(extra_args=("--replicaof", "127.0.0.1", str(master.port))) as replica:
        costs = asyncio.run(_costs(master.url, chain, depth, a.reps, replica.url, a.lookup_walk))
    costs["host"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "when": time.strftime("%Y-%m-%d %H:%M")}
    name = "costs.json" if a.lookup_walk == "search" else f"costs_{a.lookup_walk}.json"
    (out / name).write_text(json.dumps(costs, indent=1))
    print(json.dumps(costs, indent=1))
    return 0


# -- table --------------------------------------------------------------------------------------
def _load_runs(out: Path) -> dict[str, dict[str, dict]]:
    runs: dict[str, dict[str, dict]] = {}
    for name in TRACES:
        files = {f"w{w}_{t}": out / f"{name}_w{w}_{t}.json" for w, t in ((128, "fast"), (128, "live"), (512, "fast"),
                                                                        (1024, "fast"))}
        if all(p.is_file() for p in files.values()):
            runs[name] = {k: json.loads(p.read_text()) for k, p in files.items()}
    return runs


def _chain_blocks(run: dict) -> float:
    t = run["index_traffic"]
    return t["lookup_chain_blocks"] / max(1, t["lookups"])


def trace_rate(traces: Path, name: str) -> float:
    """Requests per second of the trace at rate 1."""
    times = [json.loads(line)["timestamp"] for line in (traces / TRACES[name]).read_text().splitlines() if line.strip()]
    return len(times) / ((times[-1] - times[0]) / 1000)


def per_worker(runs: dict[str, dict], key: str, req_per_s_at_1: float) -> dict:
    """Per worker per busy second, in live terms (16-token blocks, one step per pass): live runs as
    measured; fast runs times the live / fast factors of the two runs at 128 workers.

    NOTE: per *busy* second (the modelled busy time of a worker): a run's virtual span includes the
    drain after the last arrival, and the shorter runs at 512 and 1,024 workers are mostly the
    warm-up of idle workers; a worker at capacity is busy nearly all the time, and the sizing
    assumes every worker is."""
    run = runs[key]
    workers, busy = run["settings"]["workers"], run["busy_s_per_worker"]
    t = run["index_traffic"]
    if key.endswith("_live"):
        f = {"blocks": 1.0, "messages": 1.0, "lookups": 1.0}
    else:
        # NOTE: lookups too: a prompt shorter than one 64-token block has no chain, hence no Lookup
        live, fast = runs["w128_live"]["index_traffic"], runs["w128_fast"]["index_traffic"]
        f = {"blocks": live["blocks_stored"] / fast["blocks_stored"],
             "messages": live["event_messages"] / fast["event_messages"],
             "lookups": live["lookups"] / fast["lookups"]}
    stored = t["blocks_stored"] * f["blocks"] / workers / busy
    removed = t["blocks_removed"] * f["blocks"] / workers / busy
    lookups_per_request = t["lookups"] * f["lookups"] / max(1, t["routed_requests"])
    return {
        "workers": workers, "rate": run["rate"], "attainment": run["slo_attainment"],
        "busy_share": busy / run["virtual_s"],
        "stored": stored, "removed": removed,
        # NOTE: steady state: a full cache removes a block for every one it stores; a run short
        # of the cache's size removes fewer, so the sizing takes max(removed, stored)
        "events_steady": stored + max(stored, removed),
        "messages": t["event_messages"] * f["messages"] / workers / busy,
        "heartbeats": t["heartbeats"] / workers / run["virtual_s"],
        "lookups_per_request": lookups_per_request,
        "lookups_per_s": lookups_per_request * req_per_s_at_1 * run["rate"],
        "chain_blocks": t["lookup_chain_blocks"] * f["blocks"] / max(1, t["lookups"]),
        "factors": f,
    }


def scaled(fig: dict, workers: int) -> dict:
    """A row at ``workers`` from a bigger run's: the same figures per worker, Lookups/s in proportion
    (the rate grows with the workers: x workers / 128 of the 128-worker capacity)."""
    return {**fig, "workers": workers, "rate": fig["rate"] * workers / fig["workers"],
            "lookups_per_s": fig["lookups_per_s"] * workers / fig["workers"], "extrapolated": True}


MAX_REPLICAS = 8


def sizing(fig: dict, costs: dict, target: float) -> dict:
    """Redis per index: calls/s, CPU-s/s, and the cheapest layout at ``target`` of a core per node:
    N masters (shards) with R replicas each (R = 0: the masters answer Lookups)."""
    w = fig["workers"]

    def ingest(pre: str) -> float:  # CPU-s/s of every event and heartbeat, on a master ("") or replica
        return w * (fig["stored"] * costs[f"{pre}us_per_block_stored"] + max(fig["removed"], fig["stored"])
                    * costs[f"{pre}us_per_block_removed"] + fig["messages"] * costs[f"{pre}us_per_event_message"]
                    + fig["heartbeats"] * costs[f"{pre}us_per_heartbeat"]) / 1e6

    events, replicated = ingest(""), ingest("replica_")
    lk, rlk = costs["lookup_fit_us"], costs["replica_lookup_fit_us"]

    def lookup_cpu(n: int, fit: dict) -> float:  # one shard's CPU-s/s for every Lookup: its W/n workers
        return fig["lookups_per_s"] * (fit["fixed"] + fit["per_live_worker"] * w / n) / 1e6

    def nodes_cpu(n: int, r: int) -> tuple[float, float]:
        """(a master's, a replica's) CPU-s/s with n shards of r replicas each."""
        if r == 0:
            return events / n + lookup_cpu(n, lk), 0.0
        return events / n, replicated / n + lookup_cpu(n, rlk) / r

    def cheapest(max_replicas: int) -> tuple[int, int] | None:
        # NOTE: the fewest nodes; of as many, the fewest replicas (masters that answer Lookups themselves)
        fits = [(n * (1 + r), r, n) for n in range(1, 257) for r in range(max_replicas + 1)
                if max(nodes_cpu(n, r)) <= target]
        return (min(fits)[2], min(fits)[1]) if fits else None

    return {"calls_per_s": w * (fig["messages"] + fig["heartbeats"]) + fig["lookups_per_s"],
            "ingest_cpu": events, "lookup_cpu": lookup_cpu(1, lk), "cpu_one_node": events + lookup_cpu(1, lk),
            "masters_only": cheapest(0), "with_replicas": cheapest(MAX_REPLICAS),
            "shard_cpu": {n: sum(nodes_cpu(n, 0)) for n in (1, 2, 4, 8, 16)},
            "nodes_cpu": nodes_cpu, "lookup_floor": fig["lookups_per_s"] * lk["fixed"] / 1e6}


def _layout(lay: tuple[int, int] | None, s: dict) -> str:
    if lay is None:
        return "none"
    n, r = lay
    m, rep = s["nodes_cpu"](n, r)
    if r == 0:
        return f"{n} ({m:.2f})"
    return f"{n * (1 + r)}: {n} + {n * r} replicas ({m:.2f} / {rep:.2f})"


def cmd_table(a: argparse.Namespace) -> int:
    out = Path(a.out)
    rates = {name: trace_rate(Path(a.traces), name) for name in TRACES}
    runs = _load_runs(out)
    costs = json.loads((out / a.costs).read_text())
    if not runs:
        print(f"no simulator runs in {out}: run `index_sizing.py sim` first", file=sys.stderr)
        return 2
    lk, rlk = costs["lookup_fit_us"], costs["replica_lookup_fit_us"]
    print(f"Redis CPU per operation (one redis-server with a replica, {costs['host']['when']}, "
          f"{costs['host']['cpus']} CPUs; master / replica): block stored {costs['us_per_block_stored']:.2f} / "
          f"{costs['replica_us_per_block_stored']:.2f} us, block removed {costs['us_per_block_removed']:.2f} / "
          f"{costs['replica_us_per_block_removed']:.2f} us, event message {costs['us_per_event_message']:.1f} / "
          f"{costs['replica_us_per_event_message']:.1f} us (fixed, per script call), heartbeat "
          f"{costs['us_per_heartbeat']:.1f} / {costs['replica_us_per_heartbeat']:.1f} us; Lookup "
          f"({costs.get('lookup_walk', 'linear')}) of a {costs['lookup_chain_blocks']}-block chain, best match "
          f"{costs['lookup_depth_blocks']} blocks, on the master: "
          + ", ".join(f"{v:.0f} us with {k}" for k, v in costs["us_per_lookup"].items())
          + f" live workers (fit {lk['fixed']:.0f} + {lk['per_live_worker']:.3f} x W us); on the replica: "
          + ", ".join(f"{v:.0f}" for v in costs["replica_us_per_lookup"].values())
          + f" (fit {rlk['fixed']:.0f} + {rlk['per_live_worker']:.3f} x W us); the same chain missed at "
          f"block 1, 1,024 workers: {costs['us_per_lookup_miss_at_1024']:.0f} us")
    figs = {(name, key): per_worker(rs, key, rates[name]) for name, rs in runs.items()
            for key in ("w128_live", "w512_fast", "w1024_fast")}
    for name in runs:
        figs[(name, "w4096")] = scaled(figs[(name, "w1024_fast")], 4096)
    figs = dict(sorted(figs.items(), key=lambda kv: (kv[0][0], kv[1]["workers"])))
    print("\nFrom the simulator (kv-aware, at 128 workers' capacity x workers / 128; per worker per busy second, "
          "16-token blocks; 4,096: the 1,024 run's per-worker figures, Lookups x4):\n")
    head = ["trace", "workers", "rate (x trace)", "SLO attained", "busy", "blocks stored/s", "removed/s (run)",
            "block events/s (steady)", "event messages/s", "Lookups / routed request", "index: Lookups/s",
            "index: event script calls/s"]
    print("| " + " | ".join(head) + " |\n|" + "|".join(["---"] * len(head)) + "|")
    for (name, _), f in figs.items():
        x = f.get("extrapolated")
        print(f"| {name} | {f['workers']:,}{' (x)' if x else ''} | {f['rate']:.1f} | "
              f"{'-' if x else format(f['attainment'], '.3f')} | {'-' if x else format(f['busy_share'], '.0%')} | "
              f"{f['stored']:.0f} | {f['removed']:.0f} | {f['events_steady']:.0f} | {f['messages']:.1f} | "
              f"{f['lookups_per_request']:.2f} | {f['lookups_per_s']:,.0f} | "
              f"{f['workers'] * (f['messages'] + f['heartbeats']):,.0f} |")
    for target in (a.target, a.target_high):
        print(f"\nRedis CPU-s per second of one model's index, every worker busy, and the nodes at {target:.0%} of a "
              "core each: N masters (shards) answering Lookups themselves, or N masters with R replicas each that "
              "answer them (--read-replicas); in brackets each node's share of a core (master / replica):\n")
        head = ["trace", "workers", "events, all shards", "Lookups, 1 shard", "one node", "per shard: N=2", "N=4",
                "N=8", "N=16", "nodes: masters only", "nodes: with replicas"]
        print("| " + " | ".join(head) + " |\n|" + "|".join(["---"] * len(head)) + "|")
        for (name, _), f in figs.items():
            z = sizing(f, costs, target)
            print(f"| {name} | {f['workers']:,} | {z['ingest_cpu']:.2f} | {z['lookup_cpu']:.2f} | "
                  f"{z['cpu_one_node']:.2f} | " + " | ".join(f"{z['shard_cpu'][n]:.2f}" for n in (2, 4, 8, 16))
                  + f" | {_layout(z['masters_only'], z)} | {_layout(z['with_replicas'], z)} |")
    print("\nThe most workers of one model masters alone can serve (Lookups per worker as at 1,024 workers; every "
          "shard pays a Lookup's fixed part, so past this no N fits; with replicas, Lookups spread over R):")
    for name in runs:
        f = figs[(name, "w4096")]
        per_worker_lookups = f["lookups_per_s"] / f["workers"]
        print(f"   {name}: " + ", ".join(
            f"{t:.0%} of a core: {t / (per_worker_lookups * lk['fixed'] / 1e6):,.0f} workers "
            f"({t:.2f} / ({per_worker_lookups:.3f} Lookups/s per worker x {lk['fixed']:.0f} us))"
            for t in (a.target, a.target_high)))
    print("\nfast -> live settings at 128 workers (same trace and rate): " + "; ".join(
        f"{n}: blocks x{figs[(n, 'w512_fast')]['factors']['blocks']:.2f}, "
        f"messages x{figs[(n, 'w512_fast')]['factors']['messages']:.2f}, "
        f"Lookups x{figs[(n, 'w512_fast')]['factors']['lookups']:.2f}" for n in runs))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sim")
    s.add_argument("--traces", default=str(ROOT.parent / "shared" / "traces"))
    s.add_argument("--trace", nargs="+", choices=sorted(TRACES), default=list(TRACES))
    c = sub.add_parser("costs")
    c.add_argument("--reps", type=int, default=4000, help="operations per measure (default 4000)")
    c.add_argument("--lookup-walk", choices=["search", "linear"], default="search",
                   help="the Lookup measured (linear: the walk before issue 37, into costs_linear.json)")
    t = sub.add_parser("table")
    t.add_argument("--target", type=float, default=0.5,
                   help="share of one core a Redis node may spend on the index (default 0.5: Lookups queue little)")
    t.add_argument("--target-high", type=float, default=0.8, help="a second, busier target (default 0.8)")
    t.add_argument("--traces", default=str(ROOT.parent / "shared" / "traces"))
    t.add_argument("--costs", default="costs.json", help="the costs' file in --out (default costs.json)")
    for p in (s, c, t):
        p.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    return {"sim": cmd_sim, "costs": cmd_costs, "table": cmd_table}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
