"""Soak: N concurrent streams for M minutes through the whole stack; errors, RSS, leaked blocks.

    python benchmarks/soak.py --streams 16 --minutes 2 --simulate
    python benchmarks/soak.py --streams 1000 --minutes 10      # the issue-16 soak: default flags

Starts `kvmesh up`'s stack (private Redis, kv_service, workers, router; `--simulate` workers by
default, `--tiny` for the tiny model; every server with its default flags), runs ``--streams``
concurrent client loops (coroutines of one grpc.aio client) that each stream requests back to back (prompts from a few shared-prefix families, random suffixes and lengths),
samples VmRSS of every process, then drains and checks for leaks:

- **worker blocks:** after drain every worker's pool is free again: GetLoad's ``num_free_blocks``
  equals ``num_total_blocks - 1`` (block 0 is the pool's reserved null block);
- **index:** the per-worker block sets the index built from events (Redis ``l:<worker>``) equal
  the workers' own holdings. Workers do not expose their cached hashes, so the soak makes them
  say: it drops the index's keys, the workers' next heartbeat answers NOT_FOUND, and each
  re-registers and sends a snapshot of its cache. Any difference between the event-built set
  and the snapshot is a leaked (index only) or lost (worker only) block. The holders of every
  block (the index's refcount) must be exactly the workers whose set holds it.

Exit status 0 when there were no failed requests and no leaks, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import redis

from kvmesh.bench.processes import rss_kib
from kvmesh.client import make_request
from kvmesh.kv_service.store_redis import BH_TABLE_FIELD
from kvmesh.loopback import free_port
from kvmesh.make_model import ensure_default_model
from kvmesh.stack import LocalStack, StackConfig
from kvmesh.transport.channels import dial, dial_aio
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from kvmesh.v1 import router_pb2_grpc, worker_pb2, worker_pb2_grpc

NAMESPACE = "kvmesh"  # the kv_service default, which LocalStack uses
PREFIX = f"kvm:{{{NAMESPACE}}}:"


class Load:
    """``streams`` concurrent request loops (coroutines of one grpc.aio client on a thread of its
    own) streaming requests back to back until ``end``; each request has a 60 s deadline."""

    def __init__(self, router: str, streams: int, seconds: float, seed: int) -> None:
        self.router = router
        self.streams = streams
        self.seconds = seconds
        self.seed = seed
        self.end = time.monotonic() + seconds
        self.ok = 0
        self.tokens = 0
        self.errors: Counter[str] = Counter()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        channel = dial_aio(self.router)
        stub = router_pb2_grpc.RouterStub(channel)
        await asyncio.gather(*(self._run(stub, random.Random(self.seed + i)) for i in range(self.streams)))
        await channel.close()

    async def _run(self, stub: router_pb2_grpc.RouterStub, rng: random.Random) -> None:
        families = [[(97 * f + 13 * i) % 600 + 3 for i in range(rng.choice((32, 64, 128)))] for f in range(6)]
        while time.monotonic() < self.end:
            ids = rng.choice(families) + [rng.randrange(3, 600) for _ in range(rng.randrange(1, 200))]
            n = 0
            try:
                async for msg in stub.Generate(make_request(ids, max_tokens=rng.randrange(1, 48), ignore_eos=True),
                                               timeout=60):
                    n += len(msg.token_ids)
            except grpc.aio.AioRpcError as err:
                self.errors[f"{err.code().name}: {(err.details() or '')[:120]}"] += 1
                continue
            self.ok += 1
            self.tokens += n

    def start(self) -> None:
        self.end = time.monotonic() + self.seconds
        self.thread.start()

    def join(self) -> None:
        self.thread.join(max(1.0, self.end - time.monotonic() + 70))


def worker_loads(stack: LocalStack) -> dict[str, worker_pb2.GetLoadResponse]:
    out = {}
    for name, addr in stack.endpoints.items():
        if name.startswith("worker-"):
            out[name] = worker_pb2_grpc.WorkerStub(dial(addr)).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
    return out


def wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def index_sets(r: redis.Redis, workers: list[str]) -> tuple[dict[str, set[bytes]], int]:
    """Per worker its block set in the index; and the blocks whose holders disagree with those sets."""
    sets = {w: set(r.zrange(PREFIX + "l:" + w, 0, -1)) for w in workers}
    holders: dict[bytes, set[str]] = {}
    for w, hs in sets.items():
        for h in hs:
            holders.setdefault(h, set()).add(w)
    # NOTE: the holders of every block are one Redis hash `bh`: field = block hash, value =
    # ",n1,n2," (worker numbers; `nw` maps a number to its worker id). See kv_service/lua/common.lua.
    ids = {n.decode(): w.decode() for n, w in r.hgetall(PREFIX + "nw").items()}
    bad = 0
    seen = 0
    for h, v in r.hscan_iter(PREFIX + "bh", count=1000):
        if h == BH_TABLE_FIELD.encode():
            continue  # no block: it keeps the hash a hash table (kv_service/lua/common.lua)
        seen += 1
        if {ids.get(n, "?" + n) for n in v.decode().strip(",").split(",") if n} != holders.get(h, set()):
            bad += 1
    return sets, bad + abs(len(holders) - seen)


def stable_counts(kv: kpb_grpc.KVServiceStub, workers: list[str]) -> dict[str, int] | None:
    """Per worker blocks_indexed once two reads 0.5 s apart agree and every worker is live."""
    def read() -> dict[str, int]:
        return {w.worker_id: w.blocks_indexed for w in kv.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers
                if w.live}
    last: dict[str, int] = {}
    for _ in range(60):
        now = read()
        if set(now) == set(workers) and now == last:
            return now
        last = now
        time.sleep(0.5)
    return None


def check_leaks(stack: LocalStack) -> dict:
    kv = kpb_grpc.KVServiceStub(dial(stack.endpoints["kv_service"]))
    workers = sorted(w for w in stack.endpoints if w.startswith("worker-"))
    drained = wait(lambda: all(x.load.num_running == 0 and x.load.num_waiting == 0
                               for x in worker_loads(stack).values()), 30)
    loads = worker_loads(stack)
    pool = {w: {"free": x.load.num_free_blocks, "total": x.load.num_total_blocks,
                "leaked": x.load.num_total_blocks - 1 - x.load.num_free_blocks} for w, x in loads.items()}
    assert stack.redis is not None
    r = redis.Redis(port=stack.redis.port)
    stable_counts(kv, workers)
    events, bad_refcounts = index_sets(r, workers)
    # Drop the index: each worker's next heartbeat gets NOT_FOUND, it registers again and snapshots.
    keys = list(r.scan_iter(match=PREFIX + "*", count=1000))
    for i in range(0, len(keys), 500):
        r.delete(*keys[i:i + 500])
    rebuilt = wait(lambda: set(w.worker_id for w in kv.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers
                               if w.live) == set(workers), 30)
    stable_counts(kv, workers)
    snaps, _ = index_sets(r, workers)
    index = {w: {"events": len(events[w]), "snapshot": len(snaps[w]),
                 "index_only": len(events[w] - snaps[w]), "worker_only": len(snaps[w] - events[w])} for w in workers}
    return {"drained": drained, "rebuilt": rebuilt, "pool": pool, "index": index, "bad_refcounts": bad_refcounts,
            "leaked_blocks": sum(p["leaked"] for p in pool.values())
            + sum(i["index_only"] + i["worker_only"] for i in index.values()) + bad_refcounts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=16, help="concurrent client streams (default 16)")
    p.add_argument("--minutes", type=float, default=2.0, help="how long the load runs (default 2)")
    p.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--simulate", action="store_true", default=True, help="simulated workers (default)")
    mode.add_argument("--tiny", action="store_true", help="the tiny model on CPU instead of simulated workers")
    p.add_argument("--model", default=None, help="model dir (default: the tiny demo model)")
    p.add_argument("--sample-s", type=float, default=5.0, help="RSS sample period (default 5 s)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="RSS growth is counted from the first sample after this (default: a fifth of the run, "
                        "at most 120 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)

    model = args.model or str(ensure_default_model())
    # NOTE: a 512-block pool fills within seconds, so eviction (BlockRemoved) is part of the soak.
    worker_args = ["--num-blocks=512", *(["--max-model-len=1024"] if args.tiny else [])]
    cfg = StackConfig(model=model, workers=args.workers, router_port=free_port(), kv_service_port=free_port(),
                      worker_port=free_port(), metrics_port=0, simulate=not args.tiny, worker_args=worker_args)
    seconds = args.minutes * 60
    stack = LocalStack(cfg).start()
    try:
        names = ["redis"] + [n for n, _ in stack.procs]
        pids = [stack.redis.proc.pid if stack.redis else 0] + [proc.pid for _, proc in stack.procs]
        samples: list[tuple[float, list[int]]] = []
        load = Load(stack.endpoints["router"], args.streams, seconds, args.seed)
        t0 = time.monotonic()
        load.start()
        while True:
            samples.append((time.monotonic() - t0, [rss_kib(pid) for pid in pids]))
            if time.monotonic() - t0 >= seconds:
                break
            time.sleep(min(args.sample_s, max(0.0, seconds - (time.monotonic() - t0))))
        load.join()
        elapsed = time.monotonic() - t0
        samples.append((elapsed, [rss_kib(pid) for pid in pids]))
        leaks = check_leaks(stack)
        dead = stack.failed()
    finally:
        stack.stop()

    failed = sum(load.errors.values())
    print(f"soak: {args.streams} streams x {args.minutes:g} min, {args.workers} "
          f"{'tiny-model' if args.tiny else 'simulated'} workers, {datetime.date.today()}, "
          f"{platform.node()} ({os.cpu_count()} cores), load average {os.getloadavg()[0]:.1f}")
    print(f"requests: {load.ok} ok, {failed} failed, {load.tokens} tokens streamed, "
          f"{load.ok / elapsed:.1f} req/s; processes that died: {dead or 'none'}")
    for err, n in load.errors.most_common(5):
        print(f"  {n} x {err}")
    cols = samples if len(samples) <= 8 else [samples[round(i * (len(samples) - 1) / 7)] for i in range(8)]
    warmup = args.warmup_s if args.warmup_s is not None else min(120.0, seconds / 5)
    base = next((smp for smp in samples if smp[0] >= warmup), samples[-1])
    growth = {n: (samples[-1][1][i] - base[1][i]) / max(1, base[1][i]) * 100 for i, n in enumerate(names)}
    print("RSS MiB     " + "".join(f"{f't={t:.0f}s':>9}" for t, _ in cols) + f"   growth after t={base[0]:.0f}s")
    for i, name in enumerate(names):
        print(f"{name:<12}" + "".join(f"{s[i] / 1024:9.1f}" for _, s in cols) + f"  {growth[name]:+6.1f} %")
    for w, pl in leaks["pool"].items():
        ix = leaks["index"][w]
        print(f"{w}: pool free {pl['free']}/{pl['total']} (leaked {pl['leaked']}); index from events {ix['events']} "
              f"blocks, worker snapshot {ix['snapshot']} (index only {ix['index_only']}, worker only "
              f"{ix['worker_only']})")
    print(f"refcount mismatches: {leaks['bad_refcounts']}; drained: {leaks['drained']}; "
          f"index rebuilt from snapshots: {leaks['rebuilt']}")
    print(f"blocks leaked: {leaks['leaked_blocks']}")
    print(f"largest RSS growth after warm-up: {max(growth.values()):+.1f} % (goal <= 5 %)")
    result = {"ok": load.ok, "failed": failed, "errors": dict(load.errors), "tokens": load.tokens,
              "rss_growth_after_warmup_pct": growth,
              "seconds": elapsed, "dead": dead, "rss_kib": {n: [s[i] for _, s in samples] for i, n in enumerate(names)},
              **leaks}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    clean = failed == 0 and not dead and leaks["leaked_blocks"] == 0 and leaks["drained"] and leaks["rebuilt"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
