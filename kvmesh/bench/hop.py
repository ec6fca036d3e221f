"""What the router adds to a request's time to first token, measured as a client sees it (issue 45;
docs/router.md "The hop in bare hops"), and what a Lookup costs Redis.

The stack is `kvmesh up --simulate`'s (LocalStack): a private Redis, a kv_service, simulated workers,
one or more routers, each its own process; every worker publishes its blocks as it stores them, so a
request's Lookup meets the index's ingest of the requests before it, as in a live mesh. One grpc.aio
client sends pairs: a fresh 4,096-id prompt through a router, then one straight to the worker that
served it; then it times a bare grpc.aio hop (a health Check of that worker) in the same loop. The
router's share is the difference of the two TTFT medians, and its length in hops that share over the
hop's median. Several routers (arms: today's code, this code, this code tracing) take turns pair by
pair, in a new random order each round, so the host's load drifts over all of them alike and none is
always the one that follows a quiet spell.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis as redis_lib
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.transport.channels import dial, dial_aio
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.v1 import kv_service_pb2 as kv_pb
from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc


@dataclass
class Arm:
    """One router's pairs: routed and direct TTFTs and bare hops, in ms."""

    name: str
    routed: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)
    hops: list[float] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)

    def pooled(self, *others: Arm, name: str = "") -> Arm:
        """This arm's pairs and the others' as one arm (several routers of one treatment)."""
        out = Arm(name or self.name, list(self.routed), list(self.direct), list(self.hops), dict(self.served))
        for o in others:
            out.routed += o.routed
            out.direct += o.direct
            out.hops += o.hops
            for w, n in o.served.items():
                out.served[w] = out.served.get(w, 0) + n
        return out

    @property
    def share_ms(self) -> float:
        return statistics.median(self.routed) - statistics.median(self.direct)

    @property
    def hop_ms(self) -> float:
        return statistics.median(self.hops)

    @property
    def in_hops(self) -> float:
        return self.share_ms / self.hop_ms

    def line(self) -> str:
        return (f"{self.name:<16} routed p50 {statistics.median(self.routed):7.2f} ms  direct p50 "
                f"{statistics.median(self.direct):7.2f} ms  hop p50 {self.hop_ms:5.3f} ms  share {self.share_ms:6.2f} ms "
                f"= {self.in_hops:5.2f} hops  (served by {len(self.served)} workers)")


async def _first(call) -> tuple[float, object]:
    t0 = time.perf_counter()
    first, last = None, None
    async for msg in call:
        if first is None:
            first = (time.perf_counter() - t0) * 1e3
        last = msg
    if first is None:
        raise RuntimeError("empty stream")
    return first, last


async def measure_arms(arms: dict[str, tuple[str, dict[str, str]]], pairs: int, *, tokens: int = 4096,
                       warmup: int = 10, seed: int = 7,
                       between: Callable[[int], Awaitable[None]] | None = None) -> dict[str, Arm]:
    """``pairs`` pairs per arm (``arms``: name -> (router address, its workers: id -> address)), the
    arms taking turns pair by pair; fresh prompts of ``tokens`` random ids, max_tokens 1. ``between(k)``
    runs after each round (another measurement interleaved with these)."""
    rng = random.Random(seed)
    rstubs = {n: router_pb2_grpc.RouterStub(dial_aio(a)) for n, (a, _) in arms.items()}
    wchans = {(n, w): dial_aio(a) for n, (_, ws) in arms.items() for w, a in ws.items()}
    wstubs = {k: worker_pb2_grpc.WorkerStub(c) for k, c in wchans.items()}
    health = {k: health_pb2_grpc.HealthStub(c) for k, c in wchans.items()}
    sampling = common_pb2.SamplingParams(max_tokens=1, ignore_eos=True)
    out = {n: Arm(n) for n in arms}

    def prompt() -> list[int]:
        return [rng.randrange(3, 500) for _ in range(tokens)]

    names = list(rstubs)
    order = random.Random(seed + 1)
    for k in range(warmup + pairs):
        # NOTE: a new order each round: the arm that follows a quiet spell (its index idle, its workers
        # done) would otherwise always be the same one; a round's first pair read 4 ms faster direct TTFTs.
        order.shuffle(names)
        for name in names:
            stub = rstubs[name]
            ttft, last = await _first(stub.Generate(router_pb2.GenerateRequest(
                token_ids=router_pb2.TokenIds(ids=prompt()), sampling=sampling), timeout=60))
            served = last.served_by  # type: ignore[attr-defined]
            direct, _ = await _first(wstubs[name, served].Generate(worker_pb2.WorkerGenerateRequest(
                request_id=f"direct-{name}-{k}", prompt_token_ids=prompt(), sampling=sampling), timeout=60))
            t0 = time.perf_counter()
            await health[name, served].Check(health_pb2.HealthCheckRequest(), timeout=10)
            hop = (time.perf_counter() - t0) * 1e3
            if k >= warmup:
                arm = out[name]
                arm.routed.append(ttft)
                arm.direct.append(direct)
                arm.hops.append(hop)
                arm.served[served] = arm.served.get(served, 0) + 1
        if between is not None and k >= warmup:
            await between(k - warmup)
    for c in wchans.values():
        await c.close()
    return out


def run_arms(arms: dict[str, tuple[str, dict[str, str]]], pairs: int, **kw) -> dict[str, Arm]:
    return asyncio.run(measure_arms(arms, pairs, **kw))


# -- Redis's own time per Lookup --------------------------------------------------------------------
def commandstats(r: redis_lib.Redis) -> dict[str, tuple[int, int]]:
    return {k: (v["calls"], v["usec"]) for k, v in r.info("commandstats").items()}


def lookup_redis_time(redis_url: str, kv_address: str, model_id: str, chain: list[bytes], n: int = 300,
                      warmup: int = 30) -> dict[str, float]:
    """µs of Redis command time per Lookup (INFO commandstats read around ``n`` Lookups of ``chain``
    through the kv_service), by command; ``cmdstat_exec`` is a Lookup's whole transaction."""
    r = redis_lib.Redis.from_url(redis_url)
    stub = kv_grpc.KVServiceStub(dial(kv_address))
    req = kv_pb.LookupRequest(model_id=model_id, block_hashes=chain)
    for _ in range(warmup):
        stub.Lookup(req, timeout=10)
    before = commandstats(r)
    for _ in range(n):
        stub.Lookup(req, timeout=10)
    after = commandstats(r)
    r.close()
    return {k.removeprefix("cmdstat_"): (after[k][1] - before.get(k, (0, 0))[1]) / n
            for k in after if after[k][0] > before.get(k, (0, 0))[0]}


# -- today's router, for an A/B in one run ------------------------------------------------------------
def baseline_site(ref: str, repo: Path) -> Path:
    """``ref``'s kvmesh built as a wheel and unpacked into a fresh directory: put it first on
    PYTHONPATH to run that commit's code beside this one (the dependencies are this environment's)."""
    root = Path(tempfile.mkdtemp(prefix="kvmesh-baseline-"))
    tree = root / "tree"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), ref], check=True,
                   capture_output=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(root / "wheel"), str(tree)], check=True, capture_output=True)
        wheel = next((root / "wheel").glob("kvmesh-*.whl"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(root / "site"),
                        str(wheel)], check=True, capture_output=True)
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return root / "site"


def spawn_router(kv_address: str, model: str, *flags: str, env: dict[str, str] | None = None,
                 timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """One more `kvmesh router` process on a stack's kv_service (another arm: other flags, or another
    commit's code through ``env``'s PYTHONPATH), SERVING; returns (process, address)."""
    import os

    from kvmesh.loopback import free_port
    from kvmesh.stack import kvmesh_cmd

    port = free_port()
    proc = subprocess.Popen(kvmesh_cmd("router", "--host", "127.0.0.1", "--port", str(port), "--kv-service", kv_address,
                                       "--model", model, "--max-prompt-tokens", "16000", "--metrics-port", "0",
                                       "--log-level", "warning", *flags),
                            env={**os.environ, **(env or {})})
    try:
        wait_grpc(f"127.0.0.1:{port}", proc, timeout)
    except Exception:
        proc.kill()
        raise
    return proc, f"127.0.0.1:{port}"


def wait_grpc(address: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    from kvmesh.stack import wait_serving

    wait_serving(address, proc, timeout)


def health_ok(address: str) -> bool:
    try:
        stub = health_pb2_grpc.HealthStub(dial(address))
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
