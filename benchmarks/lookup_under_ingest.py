"""A Lookup while the kv_service ingests event batches, against a bare gRPC hop (issue 49).

Arms (``--arm NAME=FLAGS``, each its own `kvmesh kv-service` with those flags and its own private
redis-server; default: ``shared`` = ``--ingest-loop shared``, today's one event loop, and ``apart`` =
``--ingest-loop apart``, docs/kv-service.md "Reads apart from ingest"). Each arm's index holds
``--workers`` lookup workers, each with 8 prompts of ``--blocks`` blocks (a Lookup asks for one of
them: one worker matches it whole), and ``--workers`` ingest workers that an ingest client (a
process of its own) drives: ``--rate`` PublishEvents batches a second in all, each ``--blocks``
blocks (stored, then the oldest prompt removed once a worker holds 8), with a load report, over one
stream per worker, as a live publisher sends them.

One grpc.aio client (this process, uvloop) alternates, call by call, a bare hop (a health Check of
an idle `kvmesh kv-service --store memory`: a unary call that does nothing, on the same stack) and a
Lookup of a ``--blocks``-block chain on the arm's kv_service. A round runs every arm, in a new
random order, each for ``--phase-s`` seconds quiet, then ``--phase-s`` seconds while its ingest
client publishes; the host's drift falls on every arm alike. Prints, per arm and phase, Lookup and
hop p50 / p99 (ms), Lookup ÷ hop, ingest p99 ÷ quiet p99, and what ingest cost: batches acked, their
ack p50 / p99, the kv_service's CPU per batch and Redis's command time per publish call.

    python benchmarks/lookup_under_ingest.py [--rounds 12] [--phase-s 2] [--rate 50] [--blocks 256] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shlex
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.bench.processes import start_kv_service
from kvmesh.loopback import RedisServer
from kvmesh.replay.records import percentile as pct
from kvmesh.transport.channels import dial, dial_aio
from kvmesh.transport.loop import new_event_loop
from kvmesh.v1 import common_pb2
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

MODEL = "m"
PROMPTS = 8
"""Prompts a worker holds: the lookup workers' fixed ones; the ingest workers' window."""
PHASES = ("quiet", "ingest", "snapshot")
DEFAULT_ARMS = ("shared=--ingest-loop shared", "apart=--ingest-loop apart")


def prompt(tag: str, blocks: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{j}".encode(), digest_size=16).digest() for j in range(blocks)]


def register(stub: pb_grpc.KVServiceStub, wid: str, i: int) -> None:
    stub.RegisterWorker(pb.RegisterWorkerRequest(
        worker_id=wid, address=f"10.0.0.{i}:50061", model_id=MODEL, block_size=16,
        hash_algorithm=pb.HASH_ALGORITHM_SHA256_128, num_blocks=1_000_000, epoch=1), timeout=10)


def load(k: int) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(num_running=k % 7, num_waiting=k % 3, num_free_blocks=20_000,
                                 num_total_blocks=27_648, queued_prefill_tokens=4096 * (k % 3))


def populate(address: str, workers: int, blocks: int) -> list[list[bytes]]:
    """The lookup workers and their prompts; returns the chains a Lookup asks for."""
    stub = pb_grpc.KVServiceStub(dial(address))
    chains = []
    for w in range(workers):
        wid = f"lk{w}"
        register(stub, wid, w)
        mine = [prompt(f"{wid}/{p}", blocks) for p in range(PROMPTS)]
        chains += mine
        reqs = [pb.PublishEventsRequest(worker_id=wid, epoch=1, seq=p + 1, load=load(p), events=[
            pb.KVEvent(stored=pb.BlockStored(block_hashes=c))]) for p, c in enumerate(mine)]
        acks = [r.action for r in stub.PublishEvents(iter(reqs), timeout=30)]
        assert acks == [pb.PUBLISH_ACTION_ACK] * PROMPTS, acks
    return chains


# -- the ingest client (a process of its own: `--ingest ADDRESS`) ----------------------------------------
async def ingest_main(address: str, workers: int, blocks: int, rate: float) -> None:
    """Registers the ingest workers, then on each stdin line ``run SECONDS`` publishes ``rate`` batches a
    second for that long and prints one JSON line (batches sent, acked, ack latencies in ms)."""
    stub = pb_grpc.KVServiceStub(dial_aio(address))
    wids = [f"in{w}" for w in range(workers)]
    for i, wid in enumerate(wids):
        await stub.RegisterWorker(pb.RegisterWorkerRequest(
            worker_id=wid, address=f"10.0.1.{i}:50061", model_id=MODEL, block_size=16,
            hash_algorithm=pb.HASH_ALGORITHM_SHA256_128, num_blocks=1_000_000, epoch=1), timeout=10)
    queues: dict[str, asyncio.Queue] = {w: asyncio.Queue() for w in wids}
    sent_at: dict[tuple[str, int], float] = {}
    acks: list[float] = []
    bad: list[str] = []

    async def requests(wid: str):
        while True:
            req = await queues[wid].get()
            sent_at[wid, req.seq] = time.perf_counter()
            yield req

    async def reader(wid: str) -> None:
        async for r in stub.PublishEvents(requests(wid)):
            acks.append((time.perf_counter() - sent_at.pop((wid, r.seq))) * 1e3)
            if r.action != pb.PUBLISH_ACTION_ACK:
                bad.append(r.reason)

    readers = [asyncio.ensure_future(reader(w)) for w in wids]
    seq = dict.fromkeys(wids, 0)
    window: dict[str, deque[list[bytes]]] = {w: deque() for w in wids}
    made = dict.fromkeys(wids, 0)
    loop = asyncio.get_running_loop()
    k = 0
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        words = line.split()
        seconds = float(words[1])
        acks.clear()
        snapshot = int(words[2]) if words[0] == "snap" else 0
        # NOTE: a resync's snapshot (a worker's whole cache) once a second, or event batches at `rate`
        every = 1.0 if snapshot else 1 / rate
        n = max(1, int(seconds / every))
        t0 = time.perf_counter()
        late = 0.0
        for i in range(n):
            due = t0 + i * every
            now = time.perf_counter()
            if due > now:
                await asyncio.sleep(due - now)
            else:
                late = max(late, now - due)
            wid = wids[k % len(wids)]
            k += 1
            seq[wid] += 1
            if snapshot:
                made[wid] += 1
                queues[wid].put_nowait(pb.PublishEventsRequest(
                    worker_id=wid, epoch=1, seq=seq[wid], snapshot=True, load=load(k),
                    snapshot_hashes=prompt(f"{wid}/snap{made[wid]}", snapshot)))
                window[wid].clear()
                continue
            win = window[wid]
            # NOTE: a full worker evicts a prompt before it stores the next one: every batch is `blocks` blocks
            if len(win) >= PROMPTS and (seq[wid] % 2 == 0):
                ev = pb.KVEvent(removed=pb.BlockRemoved(block_hashes=win.popleft()))
            else:
                chain = prompt(f"{wid}/{made[wid]}", blocks)
                made[wid] += 1
                win.append(chain)
                ev = pb.KVEvent(stored=pb.BlockStored(block_hashes=chain))
            queues[wid].put_nowait(pb.PublishEventsRequest(worker_id=wid, epoch=1, seq=seq[wid], events=[ev],
                                                           load=load(k)))
        deadline = time.perf_counter() + 30
        while len(acks) < n and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        print(json.dumps({"sent": n, "acked": len(acks), "ack_p50_ms": pct(acks, 50), "ack_p99_ms": pct(acks, 99),
                          "behind_ms": late * 1e3, "not_acked": bad[:3]}), flush=True)
    for r in readers:
        r.cancel()


# -- the measuring client ---------------------------------------------------------------------------
class Arm:
    def __init__(self, name: str, flags: list[str], a: argparse.Namespace) -> None:
        self.name, self.flags = name, flags
        self.redis = RedisServer()
        self.r = redis.Redis.from_url(self.redis.url)
        self.kv, self.address = start_kv_service("--redis-url", self.redis.url, *flags)
        self.chains = populate(self.address, a.workers, a.blocks)
        self.ingest = subprocess.Popen([sys.executable, __file__, "--ingest", self.address, "--workers",
                                        str(a.workers), "--blocks", str(a.blocks), "--rate", str(a.rate)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lat: dict[str, dict[str, list[float]]] = {p: {"lookup": [], "hop": []} for p in PHASES}
        self.ingest_runs: list[dict] = []
        self.cpu: dict[str, list[float]] = {p: [] for p in PHASES}
        self.redis_pub: list[tuple[int, int]] = []

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.kv.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.ingest.stdin.close()
        self.ingest.wait(10)
        self.kv.terminate()
        self.kv.wait(10)
        self.redis.stop()


def redis_publish_stats(r: redis.Redis) -> tuple[int, int]:
    """(calls, usec) of the plain EVALSHA calls: the event-apply scripts (a Lookup's EVALSHA runs in EXEC)."""
    st = r.info("commandstats")
    ev, ex = st.get("cmdstat_evalsha", {}), st.get("cmdstat_exec", {})
    # NOTE: commands inside EXEC are counted in their own stats too: a Lookup is one EVALSHA in one EXEC
    return ev.get("calls", 0) - ex.get("calls", 0), ev.get("usec", 0)


async def measure(arm: Arm, hop: health_pb2_grpc.HealthStub, seconds: float, phase: str, rng: random.Random) -> None:
    channel = dial_aio(arm.address)
    stub = pb_grpc.KVServiceStub(channel)
    check = health_pb2.HealthCheckRequest()
    out = arm.lat[phase]
    for chain in rng.sample(arm.chains, 4):  # NOTE: warm the channel
        await stub.Lookup(pb.LookupRequest(model_id=MODEL, block_hashes=chain), timeout=5)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        req = pb.LookupRequest(model_id=MODEL, block_hashes=rng.choice(arm.chains))
        t0 = time.perf_counter()
        await hop.Check(check, timeout=5)
        t1 = time.perf_counter()
        r = await stub.Lookup(req, timeout=5)
        t2 = time.perf_counter()
        assert r.workers and r.workers[0].matched_blocks == len(req.block_hashes), r
        out["hop"].append((t1 - t0) * 1e3)
        out["lookup"].append((t2 - t1) * 1e3)
    await channel.close()


def run_phase(loop, arm: Arm, hop, seconds: float, phase: str, rng: random.Random, snapshot: int = 0) -> None:
    cpu0 = arm.cpu_s()
    pub0 = redis_publish_stats(arm.r)
    if phase != "quiet":
        arm.ingest.stdin.write(f"snap {seconds} {snapshot}\n" if phase == "snapshot" else f"run {seconds}\n")
        arm.ingest.stdin.flush()
    loop.run_until_complete(measure(arm, hop, seconds, phase, rng))
    if phase == "snapshot":
        arm.ingest.stdout.readline()
    elif phase == "ingest":
        arm.ingest_runs.append(json.loads(arm.ingest.stdout.readline()))
        pub1 = redis_publish_stats(arm.r)
        arm.redis_pub.append((pub1[0] - pub0[0], pub1[1] - pub0[1]))
    arm.cpu[phase].append(arm.cpu_s() - cpu0)


def summary(arm: Arm, a: argparse.Namespace) -> dict:
    out: dict = {"flags": " ".join(arm.flags)}
    for phase, lat in arm.lat.items():
        lk, hp = lat["lookup"], lat["hop"]
        if not lk:
            continue
        diff = [x - h for x, h in zip(lk, hp, strict=True)]
        out[phase] = {"lookups": len(lk), "lookup_p50_ms": pct(lk, 50), "lookup_p90_ms": pct(lk, 90),
                      "lookup_p99_ms": pct(lk, 99), "over_hop_p50_ms": pct(diff, 50), "over_hop_p99_ms": pct(diff, 99),
                      "hop_p50_ms": pct(hp, 50), "hop_p99_ms": pct(hp, 99),
                      "p50_in_hops": pct(lk, 50) / pct(hp, 50), "p99_in_hops": pct(lk, 99) / pct(hp, 99),
                      "lookup_max_ms": max(lk), "kv_cpu_s": sum(arm.cpu[phase])}
    out["ingest_p99_over_quiet_p99"] = out["ingest"]["lookup_p99_ms"] / out["quiet"]["lookup_p99_ms"]
    if "snapshot" in out:
        out["snapshot_p99_over_quiet_p99"] = out["snapshot"]["lookup_p99_ms"] / out["quiet"]["lookup_p99_ms"]
    sent = sum(r["sent"] for r in arm.ingest_runs)
    acked = sum(r["acked"] for r in arm.ingest_runs)
    calls = sum(c for c, _ in arm.redis_pub)
    # NOTE: the kv_service's CPU of an ingest phase less what its Lookups cost in the quiet phases
    per_lookup = out["quiet"]["kv_cpu_s"] / max(1, out["quiet"]["lookups"])
    extra = out["ingest"]["kv_cpu_s"] - per_lookup * out["ingest"]["lookups"]
    out["ingest_runs"] = arm.ingest_runs
    out["batches"] = {"sent": sent, "acked": acked, "kv_cpu_ms_per_batch": 1e3 * extra / max(1, acked),
                      "redis_publish_calls": calls,
                      "redis_us_per_publish_call": sum(u for _, u in arm.redis_pub) / max(1, calls)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", default=None, metavar="NAME=FLAGS",
                    help=f"a kv_service to measure and its flags (repeatable; default: {'; '.join(DEFAULT_ARMS)})")
    ap.add_argument("--rounds", type=int, default=12, help="rounds over every arm (default 12)")
    ap.add_argument("--phase-s", type=float, default=2.0, help="seconds of each phase of a round (default 2)")
    ap.add_argument("--rate", type=float, default=50.0, help="ingest batches a second, all workers (default 50)")
    ap.add_argument("--blocks", type=int, default=256, help="blocks per batch and per Lookup chain (default 256)")
    ap.add_argument("--workers", type=int, default=4, help="lookup workers, and as many ingest workers (default 4)")
    ap.add_argument("--snapshot-blocks", type=int, default=0,
                    help="also a phase of one snapshot of this many hashes a second (a resync; default 0: none)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--ingest", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.ingest:
        loop = new_event_loop()
        loop.run_until_complete(ingest_main(a.ingest, a.workers, a.blocks, a.rate))
        return 0
    specs = [s.split("=", 1) for s in (a.arm or DEFAULT_ARMS)]
    rng = random.Random(a.seed)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    hop_proc, hop_addr = start_kv_service("--store", "memory")
    arms: list[Arm] = []
    load0 = os.getloadavg()
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    try:
        for name, flags in specs:
            arms.append(Arm(name, shlex.split(flags), a))
        hop = health_pb2_grpc.HealthStub(dial_aio(hop_addr))
        for rnd in range(a.rounds):
            order = list(arms)
            rng.shuffle(order)
            for arm in order:
                for phase in PHASES if a.snapshot_blocks else PHASES[:2]:
                    run_phase(loop, arm, hop, a.phase_s, phase, rng, a.snapshot_blocks)
            print(f"round {rnd + 1}/{a.rounds} done (load {os.getloadavg()[0]:.1f})", flush=True)
        figures = {"when": when, "cpus": os.cpu_count(), "load_before": load0, "load_after": os.getloadavg(),
                   "rate": a.rate, "blocks": a.blocks, "workers": a.workers, "rounds": a.rounds, "phase_s": a.phase_s,
                   "arms": {arm.name: summary(arm, a) for arm in arms}}
    finally:
        for arm in arms:
            arm.close()
        hop_proc.terminate()
        hop_proc.wait(10)
    print(f"Lookup under ingest, {when}: {a.rounds} rounds of {a.phase_s:g} s quiet + {a.phase_s:g} s ingest per arm; "
          f"{a.rate:g} batches/s of {a.blocks} blocks; {a.workers} + {a.workers} workers; {a.blocks}-block Lookups; "
          f"{os.cpu_count()} CPUs, load {load0[0]:.1f} before, {figures['load_after'][0]:.1f} after")
    print(f"{'arm':<10}{'phase':<9}{'lookups':>8}{'lookup p50':>11}{'p90':>7}{'p99':>7}{'hop p50':>9}{'p99':>7}"
          f"{'p50 / hop':>10}{'p99 / hop':>10}{'  lookup - hop p50':>18}{'p99':>7}")
    for name, s in figures["arms"].items():
        for phase in (p for p in PHASES if p in s):
            f = s[phase]
            print(f"{name:<10}{phase:<9}{f['lookups']:>8}{f['lookup_p50_ms']:>11.3f}{f['lookup_p90_ms']:>7.3f}"
                  f"{f['lookup_p99_ms']:>7.3f}{f['hop_p50_ms']:>9.3f}{f['hop_p99_ms']:>7.3f}{f['p50_in_hops']:>10.2f}"
                  f"{f['p99_in_hops']:>10.2f}{f['over_hop_p50_ms']:>18.3f}{f['over_hop_p99_ms']:>7.3f}")
        b = s["batches"]
        acks = [r["ack_p50_ms"] for r in s["ingest_runs"]]
        print(f"{'':<10}ingest p99 / quiet p99 {s['ingest_p99_over_quiet_p99']:.2f} (goal <= 1.2); batches "
              f"{b['acked']}/{b['sent']} acked, ack p50 {min(acks):.2f}-{max(acks):.2f} ms; kv_service CPU "
              f"{b['kv_cpu_ms_per_batch']:.2f} ms/batch; Redis {b['redis_us_per_publish_call']:.0f} us per publish call")
        if "snapshot" in s:
            print(f"{'':<10}snapshot p99 / quiet p99 {s['snapshot_p99_over_quiet_p99']:.2f}; slowest Lookup "
                  + ", ".join(f"{p} {s[p]['lookup_max_ms']:.1f} ms" for p in PHASES))
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
