"""Issue 45's goal table in one run: the router's hop as a client sees it, Redis's time per Lookup,
`kvmesh epp` (added time, 1,000 concurrent streams, the same pick as the router over a replayed
trace), and tracing's cost (off vs today's code, on and exporting vs off) and completeness.

Two `kvmesh up --simulate` stacks (LocalStack: a fresh Redis, the kv_service, 4 simulated workers at
time scale 0.05, each a process; kvmesh/bench/hop.py):

- stack OFF: this code's router, today's router (``--baseline-ref``, default main: that commit's
  kvmesh built as a wheel and run first on PYTHONPATH, beside this one) and `kvmesh epp`, tracing off;
- stack ON: this code with ``--otlp-endpoint`` on every process, exporting to an OTLP receiver in
  this process (kvmesh/bench/otlp_receiver.py).

Measures, in order:
1. Redis per Lookup: INFO commandstats around 300 Lookups of a 250-block chain one worker of stack OFF
   holds, on its fresh index (the EXEC of the Lookup's transaction);
2. pairs: each round, one 4,096-id request through each router (today, this code off, this code on)
   then one straight to the worker that served it and a bare hop; after each round one ext_proc
   request to the picker (BUFFERED, the same kind of 4,096-id completion body). The hop per router;
   tracing off ÷ today, on ÷ off; the picker's round trip (what the gateway waits) ÷ this code's
   router's own pick time (its decision latency, the router's metrics, over the same rounds);
3. traces complete: of stack ON's routed requests, those whose trace holds spans of the router, the
   kv_service and the worker;
4. 1,000 concurrent ext_proc streams to the picker: how many are answered with a pick;
5. the same pick: an in-process router and picker over their own kv_service (4 registered workers),
   the same seed, neither holding private state (no speculative map, no shared view: its reservations
   would make their states differ by construction), replaying the Mooncake conversation trace's first
   ``--trace-requests`` requests (one 16-token block per hash id), each request's blocks then stored
   on the picked worker as its engine would; share of requests where both picked the same worker.

    python benchmarks/epp_bench.py [--pairs 200] [--baseline-ref main] [--trace-requests 300]

No Envoy runs: the picker is driven by kvmesh/bench/gateway.py over a real gRPC stream (docs/epp.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from pathlib import Path

from kvmesh.bench.gateway import GatewayClient
from kvmesh.bench.hop import baseline_site, lookup_redis_time, run_arms, spawn_router, wait_grpc
from kvmesh.bench.otlp_receiver import OtlpReceiver
from kvmesh.bench.processes import start_kv_service
from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.modelinfo import model_id_for
from kvmesh.contract.types import SamplingParams
from kvmesh.loopback import free_port, free_port_run
from kvmesh.make_model import ensure_default_model
from kvmesh.router.api.gateway import endpoint_of
from kvmesh.router.config import EppConfig, RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.epp import EppServer
from kvmesh.router.generate_types import GenerateInput
from kvmesh.router.server import RouterServer
from kvmesh.stack import LocalStack, StackConfig, kvmesh_cmd
from kvmesh.transport.channels import dial
from kvmesh.transport.loop import LoopThread
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from kvmesh.v1 import kv_service_pb2 as kv_pb
from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
COMPLETIONS = "/v1/completions"
GOALS = {"hops": 4.0, "redis_us": 100.0, "epp_ratio": 1.2, "streams": 1000, "same_pick": 1.0, "off_ratio": 1.02,
         "on_ratio": 1.10, "traces": 1.0}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def decision_mean_ms(port: int) -> tuple[float, float]:
    return (metric(port, "kvmesh_router_decision_latency_seconds_sum"),
            metric(port, "kvmesh_router_decision_latency_seconds_count"))


def stack_config(model: str, otlp: str | None) -> StackConfig:
    return StackConfig(model=model, workers=4, router_port=free_port(), kv_service_port=free_port(),
                       worker_port=free_port(), metrics_port=free_port_run(8), simulate=True, otlp_endpoint=otlp,
                       worker_args=["--sim-time-scale", "0.05", "--max-model-len", "16384"],
                       router_args=["--max-prompt-tokens", "16000", "--log-level", "warning"],
                       log_dir=tempfile.mkdtemp(prefix="kvmesh-epp-bench-"))


def spawn(args: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - lives as long as the child
    return subprocess.Popen(args, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)


def redis_per_lookup(stack: LocalStack, model: str) -> dict[str, float]:
    rng = random.Random(3)
    ids = [rng.randrange(3, 500) for _ in range(250 * 16)]
    stub = router_pb2_grpc.RouterStub(dial(stack.endpoints["router"]))
    list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                  sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=60))
    time.sleep(1.0)
    chain = BlockHasher(model_id_for(model), 16, "sha256_128").hash_prompt(ids)
    return lookup_redis_time(stack.endpoints["redis"], stack.endpoints["kv_service"], model_id_for(model), chain)


# -- the same pick over a replayed trace --------------------------------------------------------------
def trace_prompts(n: int) -> list[list[int]]:
    """The trace's first ``n`` requests as token ids: each hash id one 16-token block of its own (equal
    ids, equal blocks: the trace's shared prefixes), plus a 5-token tail."""
    out = []
    with TRACE.open() as f:
        for line in f:
            req = json.loads(line)
            ids: list[int] = []
            for h in req["hash_ids"]:
                r = random.Random(h)
                ids += [r.randrange(3, 500) for _ in range(16)]
            out.append(ids + [7, 8, 9, 10, 11])
            if len(out) == n:
                break
    return out


def same_pick(n: int, window: int = 16) -> tuple[int, int]:
    """(agreeing picks, requests) over the replayed trace (see the module's docstring, step 5). The last
    ``window`` requests stay in flight on both sides (the picker's streams open, the router's tickets
    started, as forwarding would), so the picks weigh load against the cached prefix."""
    kv_proc, kv_address = start_kv_service("--store", "memory")
    model = "trace-model"
    stub = kv_grpc.KVServiceStub(dial(kv_address))
    workers = {f"w{i}": f"127.0.0.1:{40000 + i}" for i in range(4)}
    for w, addr in workers.items():
        stub.RegisterWorker(kv_pb.RegisterWorkerRequest(
            worker_id=w, address=addr, model_id=model, block_size=16, hash_algorithm=kv_pb.HASH_ALGORITHM_SHA256_128,
            num_blocks=1_000_000, epoch=1), timeout=5)
    routing = RoutingConfig(discovery_interval_s=0.2, speculative_ttl_s=0.0, shared_view=False,
                            policy_config=PolicyConfig(seed=0))
    cfg = RouterConfig(host="127.0.0.1", port=0, kv_service=kv_address, model_id=model, max_prompt_tokens=0,
                       routing=routing)
    router = RouterServer(cfg).start()
    epp = EppServer(RouterConfig(host="127.0.0.1", kv_service=kv_address, model_id=model, max_prompt_tokens=0,
                                 routing=RoutingConfig(discovery_interval_s=0.2, speculative_ttl_s=0.0,
                                                       shared_view=False, policy_config=PolicyConfig(seed=0))),
                    EppConfig(port=0)).start()
    loop = LoopThread("gateway-client")
    client = loop.run(_client(epp.port))
    hasher = BlockHasher(model, 16, "sha256_128")
    by_endpoint = {endpoint_of(a): w for w, a in workers.items()}
    seqs = dict.fromkeys(workers, 0)
    agree = prefix = 0
    spread: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 20
        while len(epp.pool.endpoints()) < 4 or len(router.pool.endpoints()) < 4:
            if time.monotonic() > deadline:
                raise TimeoutError("the router and the picker never saw the 4 workers")
            time.sleep(0.1)
        prompts = trace_prompts(n)
        held: deque = deque()

        def in_flight(r: RouterServer) -> int:
            return sum(r.router.inflight.of(w).requests for w in workers)

        for ids in prompts:
            body = json.dumps({"model": model, "prompt": ids, "max_tokens": 16}).encode()
            exchange = client.exchange("full-duplex")
            ex = loop.run(exchange.__aenter__())
            answer = loop.run(ex.request(COMPLETIONS, body, chunks=3))
            plan, decision = router.run(router.router.decide(GenerateInput(None, ids, SamplingParams(max_tokens=16))))
            held.append((exchange, router.router.core.start(plan, decision.worker_id)))
            if len(held) > window:  # the oldest ends on both sides before the next pick
                exchange, ticket = held.popleft()
                loop.run(exchange.__aexit__(None, None, None))
                router.router.core.finish(ticket)
                deadline = time.monotonic() + 10
                while in_flight(epp) != in_flight(router) and time.monotonic() < deadline:
                    time.sleep(0.002)
            picked = by_endpoint.get(answer.endpoints[0]) if answer.endpoints else None
            agree += picked == decision.worker_id
            spread[decision.worker_id] = spread.get(decision.worker_id, 0) + 1
            prefix += plan.candidate(decision.worker_id).matched_blocks > 0
            # the picked worker's engine now holds the prompt's blocks
            w = decision.worker_id
            seqs[w] += 1
            list(stub.PublishEvents(iter([kv_pb.PublishEventsRequest(
                worker_id=w, epoch=1, seq=seqs[w],
                events=[kv_pb.KVEvent(stored=kv_pb.BlockStored(block_hashes=hasher.hash_prompt(ids)))])]),
                timeout=10))
        print(f"same pick: the router's picks by worker {dict(sorted(spread.items()))}, {prefix} on a cached prefix")
        while held:
            loop.run(held.popleft()[0].__aexit__(None, None, None))
        return agree, len(prompts)
    finally:
        loop.run(client.close())
        loop.stop()
        epp.stop(0.5)
        router.stop(0.5)
        kv_proc.terminate()
        kv_proc.wait(10)


async def _client(port: int) -> GatewayClient:
    return GatewayClient(f"127.0.0.1:{port}")


async def flood(port: int, n: int, tokens: int) -> int:
    client = GatewayClient(f"127.0.0.1:{port}")
    rng = random.Random(11)
    bodies = [json.dumps({"prompt": [rng.randrange(3, 500) for _ in range(tokens)], "max_tokens": 1}).encode()
              for _ in range(n)]
    answers = await asyncio.gather(*(client.pick(COMPLETIONS, b, "full-duplex", chunks=2) for b in bodies),
                                   return_exceptions=True)
    await client.close()
    return sum(1 for a in answers if not isinstance(a, BaseException) and a.status is None and a.endpoints)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=200, help="routed/direct pairs per router (default 200)")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length in token ids (default 4096)")
    ap.add_argument("--baseline-ref", default="main", help="today's code for the tracing-off A/B ('' = skip)")
    ap.add_argument("--streams", type=int, default=1000, help="concurrent ext_proc streams (default 1000)")
    ap.add_argument("--trace-requests", type=int, default=300, help="requests of the trace replayed (default 300)")
    args = ap.parse_args()
    print(f"epp_bench: load average at start {load()}", flush=True)
    model = str(ensure_default_model())
    site = baseline_site(args.baseline_ref, ROOT) if args.baseline_ref else None
    rows: dict[str, tuple[str, str, bool]] = {}

    with OtlpReceiver() as receiver:
        off = LocalStack(stack_config(model, None)).start()
        on = None
        procs: list[subprocess.Popen] = []
        try:
            redis_us = redis_per_lookup(off, model)
            exec_us = redis_us.get("exec", 0.0)
            print("Redis per Lookup (µs): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(redis_us.items())), flush=True)
            rows["redis_us"] = (f"{exec_us:.1f} µs", f"≤ {GOALS['redis_us']:g} µs", exec_us <= GOALS["redis_us"])
            on = LocalStack(stack_config(model, receiver.address)).start()
            kv = off.endpoints["kv_service"]
            mp = free_port_run(3)
            epp_port = free_port()
            procs.append(spawn([*kvmesh_cmd("epp", "--host", "127.0.0.1", "--port", str(epp_port), "--kv-service", kv,
                                            "--model", model, "--max-prompt-tokens", "16000", "--metrics-port",
                                            str(mp), "--log-level", "warning")]))
            wait_grpc(f"127.0.0.1:{epp_port}", procs[-1])
            fold_proc, fold_addr = spawn_router(kv, model, "--fold-reserve")
            procs.append(fold_proc)
            # NOTE: three routers on each stack, so in a shuffled round each stack's pairs follow its own as
            # often as the other's (the ingest of the previous requests is part of what the hop meets).
            on_more = [spawn_router(on.endpoints["kv_service"], model, "--otlp-endpoint", receiver.address)
                       for _ in range(2)]
            procs += [p for p, _ in on_more]
            arms = {"this, off": (off.endpoints["router"], {}), "this, folded": (fold_addr, {}),
                    "on 1": (on.endpoints["router"], {}), "on 2": (on_more[0][1], {}), "on 3": (on_more[1][1], {})}
            if site is not None:
                today_port = free_port()
                procs.append(spawn(kvmesh_cmd("router", "--host", "127.0.0.1", "--port", str(today_port),
                                              "--kv-service", kv, "--model", model, "--max-prompt-tokens", "16000",
                                              "--metrics-port", str(mp + 1), "--log-level", "warning"),
                                   env={"PYTHONPATH": str(site)}))
                wait_grpc(f"127.0.0.1:{today_port}", procs[-1])
                arms = {"today": (f"127.0.0.1:{today_port}", {}), **arms}
            for name, (_addr, ws) in arms.items():
                stack = on if name.startswith("on ") else off
                ws.update({f"worker-{i}": stack.endpoints[f"worker-{i}"] for i in range(4)})

            epp_rtt: list[float] = []
            rng = random.Random(5)
            gateways: list[GatewayClient] = []

            async def one_epp(k: int) -> None:
                if not gateways:  # made on the pairs' loop, as grpc.aio channels must be
                    gateways.append(GatewayClient(f"127.0.0.1:{epp_port}"))
                gateway = gateways[0]
                body = json.dumps({"prompt": [rng.randrange(3, 500) for _ in range(args.tokens)],
                                   "max_tokens": 1}).encode()
                t0 = time.perf_counter()
                answer = await gateway.pick(COMPLETIONS, body, "buffered")
                epp_rtt.append((time.perf_counter() - t0) * 1e3)
                assert answer.status is None, answer.error
                if k == args.pairs - 1:
                    await gateway.close()

            router_mp = off.cfg.metrics_port + 1
            s0, c0 = decision_mean_ms(router_mp)
            print(f"pairs: {args.pairs} per router, load average {load()}", flush=True)
            measured = run_arms({n: (a, w) for n, (a, w) in arms.items()}, args.pairs, tokens=args.tokens,
                                between=one_epp)
            s1, c1 = decision_mean_ms(router_mp)
            print(f"  (load average after the pairs {load()})")
            measured["this, tracing on"] = measured.pop("on 1").pooled(measured.pop("on 2"), measured.pop("on 3"),
                                                                         name="this, tracing on")
            for arm in measured.values():
                print("  " + arm.line())
            this = measured["this, off"]
            fold = measured["this, folded"]
            rows["hops"] = (f"{this.in_hops:.2f} hops ({this.share_ms:.2f} ms / {this.hop_ms:.3f} ms); --fold-reserve "
                            f"{fold.in_hops:.2f}", f"≤ {GOALS['hops']:g}", min(this.in_hops, fold.in_hops) <= GOALS["hops"])
            if "today" in measured:
                r = this.share_ms / measured["today"].share_ms
                rows["off_ratio"] = (f"{r:.3f} ({this.share_ms:.2f} / {measured['today'].share_ms:.2f} ms)",
                                     f"≤ {GOALS['off_ratio']:g}", r <= GOALS["off_ratio"])
            traced = measured["this, tracing on"]
            r = traced.share_ms / this.share_ms
            rows["on_ratio"] = (f"{r:.3f} ({traced.share_ms:.2f} / {this.share_ms:.2f} ms)", f"≤ {GOALS['on_ratio']:g}",
                                r <= GOALS["on_ratio"])
            pick_ms = (s1 - s0) / max(1.0, c1 - c0) * 1e3
            rtt = statistics.mean(epp_rtt)
            rows["epp_ratio"] = (f"{rtt / pick_ms:.2f} (round trip mean {rtt:.2f} ms, p50 {statistics.median(epp_rtt):.2f}"
                                 f" ms / router's pick mean {pick_ms:.2f} ms)", f"≤ {GOALS['epp_ratio']:g}",
                                 rtt / pick_ms <= GOALS["epp_ratio"])
            # traces complete: every routed request of stack ON
            time.sleep(3.0)
            traces = receiver.traces()
            roots = [t for t, spans in traces.items() if any(s.name == "router.request" for s in spans)]
            need = {"kvmesh-router", "kvmesh-kv-service", "kvmesh-worker"}
            complete = sum(1 for t in roots if {s.service for s in traces[t]} >= need)
            share = complete / max(1, len(roots))
            rows["traces"] = (f"{complete} / {len(roots)}", "100 %", share >= GOALS["traces"])
            answered = asyncio.run(flood(epp_port, args.streams, args.tokens))
            rows["streams"] = (f"{answered} / {args.streams}", f"{GOALS['streams']} / {GOALS['streams']}",
                               answered == args.streams)
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
            off.stop()
            if on is not None:
                on.stop()
    agree, n = same_pick(args.trace_requests)
    rows["same_pick"] = (f"{agree} / {n} ({100 * agree / n:.1f} %)", "100 %", agree == n)

    labels = {
        "hops": "router hop (router TTFT − direct) ÷ bare gRPC hop, 4,096-id prompts",
        "redis_us": "Redis time per Lookup, 250-block chain, INFO commandstats (EXEC)",
        "epp_ratio": "EPP: ext_proc round trip (buffered 4k-token body) ÷ the router's own pick time",
        "streams": "EPP: 1,000 concurrent ext_proc streams answered",
        "same_pick": "EPP vs router: same pick, replayed trace",
        "off_ratio": "tracing off: router hop ÷ today's (same run, A/B)",
        "on_ratio": "tracing on, exporting: router hop ÷ off",
        "traces": "traces complete (router, kv_service and worker spans)",
    }
    print(f"\nissue 45 goal table (load average at the end {load()}):")
    print(f"| {'measure':<84} | {'goal':<12} | {'measured':<66} | met |")
    for key, label in labels.items():
        if key in rows:
            value, goal, ok = rows[key]
            print(f"| {label:<84} | {goal:<12} | {value:<66} | {'yes' if ok else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
