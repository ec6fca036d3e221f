"""Concurrent streams through one router with default flags: how many of N are served.

Starts `kvmesh up`'s stack on free loopback ports (private Redis, kv_service, one simulated worker
host, router; every server with its default limits), then opens ``--streams`` Generate streams at
once from one grpc.aio client and keeps them all open: each asks for ``--max-tokens`` tokens and
the worker's scheduler runs at most 128 at a time, so the others wait in its queue with their
streams open. Reports streams served to the end, refused (RESOURCE_EXHAUSTED) and failed, and the
most streams the router had open at once (its kvmesh_router_inflight_requests gauge, sampled).

    python benchmarks/router_streams.py [--streams 1000] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path

import grpc

from kvmesh.bench.scrape import gauge, scrape
from kvmesh.loopback import free_port
from kvmesh.make_model import ensure_default_model
from kvmesh.stack import LocalStack, StackConfig
from kvmesh.transport.channels import dial_aio
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc


async def run(router: str, n: int, max_tokens: int, prompt_len: int, metrics_port: int) -> dict:
    channel = dial_aio(router)
    stub = router_pb2_grpc.RouterStub(channel)
    outcomes: Counter[str] = Counter()
    peak = 0.0
    done = asyncio.Event()

    async def one(k: int) -> None:
        ids = [(k * 7919 + 13 * i) % 500 + 3 for i in range(prompt_len)]
        req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, ignore_eos=True), request_id=f"s{k}")
        try:
            tokens = 0
            async for msg in stub.Generate(req, timeout=600):
                tokens += len(msg.token_ids)
            outcomes["ok" if tokens == max_tokens else "short"] += 1
        except grpc.aio.AioRpcError as err:
            outcomes[err.code().name + ": " + (err.details() or "")[:120]] += 1

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            page = await asyncio.to_thread(scrape, metrics_port)
            peak = max(peak, gauge(page, "kvmesh_router_inflight_requests"))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(n)))
    wall = time.perf_counter() - t0
    done.set()
    await sampler
    await channel.close()
    return {"streams": n, "outcomes": dict(outcomes), "peak_open": peak, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (default 64)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per stream (default 64)")
    ap.add_argument("--sim-time-scale", type=float, default=1.0,
                    help="the simulated worker's wall seconds per modelled second (default 1)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    base = free_port()
    cfg = StackConfig(model=str(ensure_default_model()), workers=1, router_port=free_port(),
                      kv_service_port=free_port(), worker_port=free_port(), metrics_port=base, simulate=True,
                      router_tokenizer=False, worker_args=["--sim-time-scale", str(a.sim_time_scale)])
    # NOTE: metrics ports are base (kv_service), base+1 (router), base+2 (worker): free_port() gave
    # base only, the next two are very likely free on a test host; the stack fails loudly if not.
    stack = LocalStack(cfg).start()
    try:
        r = asyncio.run(run(stack.endpoints["router"], a.streams, a.max_tokens, a.prompt_len, base + 1))
    finally:
        stack.stop()
    ok = r["outcomes"].get("ok", 0)
    print(f"router streams {time.strftime('%Y-%m-%d %H:%M')}: {a.streams} concurrent Generate streams into one "
          f"router (default flags), one simulated worker host (default flags), {a.max_tokens} tokens each")
    for outcome, count in sorted(r["outcomes"].items(), key=lambda kv: -kv[1]):
        print(f"  {count:6}  {outcome}")
    print(f"  most streams open at once at the router: {r['peak_open']:.0f}; wall {r['wall_s']:.1f} s")
    verdict = "met" if ok == a.streams else "NOT met"
    print(f"goal {a.streams}/{a.streams} served: {verdict} ({ok}/{a.streams})")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0 if ok == a.streams else 1


if __name__ == "__main__":
    sys.exit(main())
