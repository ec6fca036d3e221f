"""Lookup's search against the walk it replaced, side by side in one run, on one redis-server.

Both Lua scripts run against the same data in the same Redis: ``--lookup-walk linear`` is the walk
down the chain with its reply of before issue 37 (lua/lookup_linear.lua), the default is the
binary search per worker (lua/lookup.lua, docs/kv-service.md "Lookup"). Every answer of one is
checked equal to the other's (each scenario keeps the prefix invariant).

1. Redis CPU per Lookup (RedisIndex.lookup, the kv_service's call), per scenario and walk: the
   commands' own time from INFO commandstats (usec of EVALSHA, or of MULTI + EXEC, which counts the
   commands inside it), and the whole process' CPU from INFO cpu (used_cpu_user + used_cpu_sys:
   also reading, parsing and answering the request) over ``--lookups`` calls, after CONFIG RESETSTAT;
   the two walks alternate, twice each, and the lower figure of each is kept.
2. gRPC Lookup through `kvmesh kv-service`: one process per walk on the same Redis and namespace,
   Lookups interleaved call by call from one grpc.aio client: p50 and p99, new / old.

Scenarios (``--background`` more blocks per worker, held by nobody else, fill the holders hash):
  A  a 250-block chain held by 1 of 4 workers (the issue's first goal row);
  B  859 blocks (the traces' mean 12-15k-token prompt in 16-token blocks), 128 workers, 8 of them
     holding its first 389..396 blocks (the traces' hit rate), as benchmarks/index_sizing.py costs it;
  C  B, and every worker holds the first 16 blocks (a shared system prompt);
  D  859 blocks, 128 workers each holding a different depth (3, 9, ... 765): the search's worst case;
  E  B with 1,024 workers;
  F  B, and the 8 holders' host KV tiers continue their device prefixes to block 800 (issue 36: the
     host tier's continuation search runs after the device's; compare with B).

    python benchmarks/lookup_bench.py [--lookups 2000] [--grpc-lookups 2000] [--background 1000] [--json OUT]
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

import redis

from kvmesh.bench.processes import start_kv_service
from kvmesh.contract.index_protocol import Registration
from kvmesh.contract.types import BlockStored, Load, Tier
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import RedisServer
from kvmesh.replay.records import percentile as pct
from kvmesh.transport.channels import dial_aio
from kvmesh.transport.loop import new_event_loop
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

TTL = 3_600_000
WALKS = ("linear", "search")


def scenarios() -> dict[str, tuple[int, int, dict[int, int], int, dict[int, tuple[int, int]]]]:
    """name -> (workers, chain blocks, {worker: blocks of the chain it holds}, system prompt blocks every worker
    holds, {worker: (first, end) blocks of the chain in its host tier})."""
    deep = {w: 396 - w for w in range(8)}
    return {
        "A: 250 blocks, 1 of 4 workers holds them": (4, 250, {1: 250}, 0, {}),
        "B: 859 blocks, 128 workers, 8 hold 389-396": (128, 859, deep, 0, {}),
        "C: B + all 128 hold a 16-block system prompt": (128, 859, deep, 16, {}),
        "D: 859 blocks, 128 workers at 128 depths": (128, 859, {w: 3 + 6 * w for w in range(128)}, 0, {}),
        "E: B with 1,024 workers": (1024, 859, deep, 0, {}),
        "F: B + the 8 holders' host tiers continue to block 800": (128, 859, deep, 0,
                                                                    {w: (d, 800) for w, d in deep.items()}),
    }


async def populate(url: str, ns: str, workers: int, chain: list[bytes], holders: dict[int, int], system: int,
                   background: int, host: dict[int, tuple[int, int]]) -> None:
    idx = RedisIndex(url, ns, max_connections=16)
    now = int(time.time() * 1000)

    async def one(w: int) -> None:
        wid = f"w{w:04d}"
        await idx.register_worker(Registration(wid, f"10.0.{w // 256}.{w % 256}:50061", "m", 16, "sha256_128",
                                               10_000_000, 1), TTL, now)
        seq = 1
        events = [BlockStored(chain[:max(system, holders.get(w, 0))])] if max(system, holders.get(w, 0)) else []
        if w in host:
            events.append(BlockStored(chain[host[w][0]:host[w][1]], tier=Tier.HOST))
        await idx.publish(wid, 1, seq, events, now, Load(num_running=w % 5, num_free_blocks=1000,
                                                         num_total_blocks=27_648))
        own = [os.urandom(16) for _ in range(background)]
        for i in range(0, len(own), 4096):
            seq += 1
            await idx.publish(wid, 1, seq, [BlockStored(own[i:i + 4096])], now)

    for first in range(0, workers, 16):
        await asyncio.gather(*(one(w) for w in range(first, min(workers, first + 16))))
    await idx.close()


def redis_figures(r: redis.Redis) -> tuple[float, int, float]:
    """(commands' usec, calls of the outermost command, process CPU-s) since CONFIG RESETSTAT / now."""
    stats = r.info("commandstats")
    if "cmdstat_exec" in stats:  # NOTE: EXEC's usec includes the commands it ran
        usec = stats["cmdstat_exec"]["usec"] + stats.get("cmdstat_multi", {}).get("usec", 0)
        calls = stats["cmdstat_exec"]["calls"]
    else:
        usec = sum(v["usec"] for k, v in stats.items() if k.startswith("cmdstat_evalsha"))
        calls = sum(v["calls"] for k, v in stats.items() if k.startswith("cmdstat_evalsha"))
    cpu = r.info("cpu")
    return usec, calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def store_costs(url: str, ns: str, chain: list[bytes], n: int) -> dict[str, dict]:
    r = redis.Redis.from_url(url)
    stores = {w: RedisIndex(url, ns, lookup_walk=w) for w in WALKS}
    now = int(time.time() * 1000)
    answers = {w: sorted((m.worker_id, m.matched_blocks + m.host_blocks)
                         for m in await stores[w].lookup("m", chain, now)) for w in WALKS}
    if answers["linear"] != answers["search"]:
        raise AssertionError(f"the walks disagree: {answers}")
    out: dict[str, dict] = {w: {"commands_us": [], "process_us": []} for w in WALKS}
    for _ in range(2):
        for w in WALKS:
            for _ in range(20):
                await stores[w].lookup("m", chain, now)
            r.config_resetstat()
            _, _, cpu0 = redis_figures(r)
            for _ in range(n):
                await stores[w].lookup("m", chain, now)
            usec, calls, cpu1 = redis_figures(r)
            assert calls == n, (w, calls, n)
            out[w]["commands_us"].append(usec / n)
            out[w]["process_us"].append(1e6 * (cpu1 - cpu0) / n)
    for w in WALKS:
        await stores[w].close()
        out[w] = {k: min(v) for k, v in out[w].items()}
    out["matched"] = dict(answers["search"])
    return out


async def grpc_latency(addrs: dict[str, str], chain: list[bytes], n: int, workers: int) -> dict[str, list[float]]:
    chans = {w: dial_aio(a) for w, a in addrs.items()}
    stubs = {w: pb_grpc.KVServiceStub(c) for w, c in chans.items()}
    req = pb.LookupRequest(model_id="m", block_hashes=chain)
    lat: dict[str, list[float]] = {w: [] for w in addrs}
    for k in range(n + 200):  # the first 200 warm up
        order = WALKS if k % 2 else WALKS[::-1]  # NOTE: alternate who goes first
        for w in order:
            t0 = time.perf_counter()
            reply = await stubs[w].Lookup(req, timeout=5)
            dt = (time.perf_counter() - t0) * 1e6
            assert len(reply.workers) == workers
            if k >= 200:
                lat[w].append(dt)
    for c in chans.values():
        await c.close()
    return lat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lookups", type=int, default=2000, help="Lookups per walk and measure in 1. (default 2000)")
    ap.add_argument("--grpc-lookups", type=int, default=2000, help="timed gRPC Lookups per walk in 2. (default 2000)")
    ap.add_argument("--grpc-scenarios", default="A,B", help="scenarios measured over gRPC (default A,B)")
    ap.add_argument("--background", type=int, default=1000, help="blocks per worker outside the chain (default 1000)")
    ap.add_argument("--only", default="", help="scenarios to run, e.g. A,B (default all)")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    fig: dict = {"when": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "background": a.background,
                 "scenarios": {}}
    grpc_keys = set(a.grpc_scenarios.split(","))
    loop = new_event_loop()
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        print(f"lookup benchmark {fig['when']}: one redis-server ({r.info('server')['redis_version']}), "
              f"{fig['cpus']} CPUs, Python {sys.version.split()[0]}; {a.background} background blocks per worker")
        print("1. Redis CPU per Lookup (us): commands (INFO commandstats) / whole process (INFO cpu)")
        for k, (name, (workers, n, holders, system, host)) in enumerate(scenarios().items()):
            key = name[0]
            if a.only and key not in a.only.split(","):
                continue
            ns = f"lk{k}"
            chain = [os.urandom(16) for _ in range(n)]
            loop.run_until_complete(populate(server.url, ns, workers, chain, holders, system, a.background, host))
            costs = loop.run_until_complete(store_costs(server.url, ns, chain, a.lookups))
            row = {"workers": workers, "chain_blocks": n, "best_match": max(costs["matched"].values()),
                   **{w: costs[w] for w in WALKS}}
            lin, new = costs["linear"], costs["search"]
            row["commands_ratio"] = new["commands_us"] / lin["commands_us"]
            print(f"   {name}: linear {lin['commands_us']:7.1f} / {lin['process_us']:7.1f}   search "
                  f"{new['commands_us']:6.1f} / {new['process_us']:6.1f}   search / linear "
                  f"{row['commands_ratio']:.3f} (commands), {new['process_us'] / lin['process_us']:.3f} (process)",
                  flush=True)
            if key in grpc_keys:
                procs, addrs = [], {}
                try:
                    for w in WALKS:
                        p, addr = start_kv_service("--redis-url", server.url, "--namespace", ns, "--lookup-walk", w)
                        procs.append(p)
                        addrs[w] = addr
                    lat = loop.run_until_complete(grpc_latency(addrs, chain, a.grpc_lookups, workers))
                finally:
                    for p in procs:
                        p.terminate()
                        p.wait(10)
                g = {w: {"p50_us": statistics.median(v), "p99_us": pct(v, 99)} for w, v in lat.items()}
                row["grpc"] = g
                row["grpc_p50_ratio"] = g["search"]["p50_us"] / g["linear"]["p50_us"]
                row["grpc_p99_ratio"] = g["search"]["p99_us"] / g["linear"]["p99_us"]
                print(f"      gRPC Lookup (interleaved, {a.grpc_lookups} each): linear p50 {g['linear']['p50_us']:.0f} "
                      f"p99 {g['linear']['p99_us']:.0f} us; search p50 {g['search']['p50_us']:.0f} p99 "
                      f"{g['search']['p99_us']:.0f} us; search / linear p50 {row['grpc_p50_ratio']:.2f}, "
                      f"p99 {row['grpc_p99_ratio']:.2f} (goal <= 0.7 / 0.7)", flush=True)
            fig["scenarios"][name] = row
            r.flushall()
    if a.json:
        Path(a.json).write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
