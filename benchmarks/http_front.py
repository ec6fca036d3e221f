"""What the router's OpenAI HTTP front costs a request, one request at a time (issue 49's first goal:
the HTTP front's added p50 over a direct worker call, 4 KB prompt, ≤ 3 ms).

A `kvmesh up --simulate` stack (kvmesh/stack.py's LocalStack: a private Redis, the kv_service, one
simulated worker at ``--sim-time-scale``, the router with its OpenAI HTTP API; each its own process).
With one worker, "the worker that served" a routed request is that worker. Rounds of arms, in a new
random order each round (the host's load drifts over all of them alike), one request at a time:

- ``http``: a fresh ~4 KB text prompt as an OpenAI ``/v1/completions`` to the router's HTTP port
  (``max_tokens`` 1, ``ignore_eos``), over a kept-alive connection; the time to the whole answer;
- ``http stream``: the same with ``"stream": true``; the time to ``data: [DONE]``;
- ``router gRPC``: the same kind of text as the router's gRPC Generate: the request path without the
  HTTP front (what ``http`` − this costs is the HTTP front's own share);
- ``direct``: a fresh text's token ids (the router's tokenizer, special tokens added, as the router
  encodes) as a gRPC Generate straight to the worker;
- ``hop``: a bare gRPC round trip (a health Check of the worker).

With ``--baseline-ref REF`` a second router runs REF's code (kvmesh/bench/hop.py's ``baseline_site``:
that commit's kvmesh as a wheel, first on PYTHONPATH) on the same kv_service and worker, and its HTTP
arms (``http (REF)``, ``http stream (REF)``) take turns with the others: an A/B in one run.

``--front``: also the HTTP front alone, with no request path behind it: the router's ``HttpServer`` in
a process of its own whose Frontend answers every request at once with one token (``--serve-stub``),
under this code and, with ``--baseline-ref``, REF's, taking turns request by request (the same 4 KB
completions, non-streamed and streamed); printed: each one's p50 and its process's CPU per request
(what the front costs the router's loop, the figure least moved by the host's load).

Every arm gets a prompt of its own (random words of kvmesh/data/corpus.txt, none sharing a first
block with any other), so none is served from the worker's prefix cache. Printed: p50 / p99 of each,
and each routed arm's added p50 over ``direct`` in ms and in bare hops.

    .venv/bin/python benchmarks/http_front.py [--pairs 300] [--prompt-bytes 4096] [--time-scale 0.05]
        [--baseline-ref REF] [--front]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer

from kvmesh.bench.hop import baseline_site, wait_grpc
from kvmesh.loopback import free_port
from kvmesh.make_model import ensure_default_model
from kvmesh.stack import LocalStack, StackConfig, kvmesh_cmd
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
GOAL_MS = 3.0


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class Prompts:
    """Fresh texts of about ``nbytes`` bytes: random words of the demo corpus."""

    def __init__(self, nbytes: int, seed: int) -> None:
        text = resources.files("kvmesh").joinpath("data/corpus.txt").read_text()
        self.words = text.split()
        self.nbytes = nbytes
        self.rng = random.Random(seed)

    def text(self) -> str:
        out: list[str] = []
        n = 0
        while n < self.nbytes:
            w = self.rng.choice(self.words)
            out.append(w)
            n += len(w) + 1
        return " ".join(out)[:self.nbytes]


class Http:
    """One kept-alive connection to the router's OpenAI API."""

    def __init__(self, host: str, port: int) -> None:
        self.conn = http.client.HTTPConnection(host, port, timeout=60)

    def post(self, path: str, body: bytes) -> bytes:
        self.conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
        return data


# -- the front alone -------------------------------------------------------------------------------------
def serve_stub() -> None:
    """The router's HttpServer before a request path that answers at once (one token, usage); prints its
    port, serves until stdin closes. Runs whichever kvmesh is first on the path (this code or a baseline)."""
    from kvmesh.contract.types import Usage
    from kvmesh.router.api.body_bounds import BodyBounds
    from kvmesh.router.api.frontend import Frontend
    from kvmesh.router.api.openai_api import HttpServer
    from kvmesh.router.config import RouterConfig
    from kvmesh.router.generate_types import GenerateOutput
    from kvmesh.router.metrics import RouterMetrics
    from kvmesh.transport.loop import LoopThread

    class Model:
        model_id = "default"

    class StubFrontend(Frontend):
        def body_bounds(self, config: RouterConfig) -> BodyBounds:
            # NOTE: the demo model's bounds through `kvmesh up` (16k tokens of context)
            return BodyBounds(config.max_body_bytes, config.max_messages, config.max_content_parts,
                              2 * 16384 + 16, 6 * 32 * 16384 + 1024)

        def model(self, name: str) -> Model:  # type: ignore[override]
            return Model()

        async def generate(self, model, inp, request_id=None, span=None):  # type: ignore[no-untyped-def, override]
            self.admit()
            try:
                yield GenerateOutput([5], "x", "length", Usage(len(inp.text or ""), 0, 1), "worker-0", inp.request_id)
            finally:
                self.release("ok")

    loop = LoopThread("http")

    async def start() -> HttpServer:
        server = HttpServer(StubFrontend(None, 1024, RouterMetrics()), "127.0.0.1", 0,  # type: ignore[arg-type]
                            RouterConfig())
        await server.start()
        return server

    server = loop.run(start())
    print(server.port, flush=True)
    sys.stdin.read()
    loop.run(server.stop(0.1))


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def front_alone(n: int, prompt_bytes: int, baseline: Path | None, ref: str) -> None:
    servers: dict[str, tuple[subprocess.Popen, Http]] = {}
    for tag, env in [("this", {}), *([(ref, {"PYTHONPATH": str(baseline)})] if baseline else [])]:
        proc = subprocess.Popen([sys.executable, __file__, "--serve-stub"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env={**os.environ, **env}, text=True)
        assert proc.stdout is not None
        servers[tag] = (proc, Http("127.0.0.1", int(proc.stdout.readline())))
    prompts = Prompts(prompt_bytes, seed=17)
    arms = [(tag, stream) for tag in servers for stream in (False, True)]
    times: dict[tuple[str, bool], list[float]] = {a: [] for a in arms}
    cpu = dict.fromkeys(servers, 0.0)
    rng = random.Random(5)
    try:
        for r in range(n + n // 10):
            rng.shuffle(arms)
            for tag, stream in arms:
                proc, client = servers[tag]
                body = json.dumps({"model": "default", "prompt": prompts.text(), "max_tokens": 1, "stream": stream}).encode()
                c0 = cpu_s(proc.pid)
                t0 = time.perf_counter()
                client.post("/v1/completions", body)
                ms = (time.perf_counter() - t0) * 1e3
                if r >= n // 10:
                    times[tag, stream].append(ms)
                    cpu[tag] += cpu_s(proc.pid) - c0
    finally:
        for proc, client in servers.values():
            client.conn.close()
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(10)
    print(f"\nthe HTTP front alone (a request path that answers at once), {n} requests per arm, load average {load()}:")
    for tag in servers:
        for stream in (False, True):
            xs = times[tag, stream]
            print(f"  {tag:<12} {'stream' if stream else 'whole':<7} p50 {statistics.median(xs):6.2f} ms  "
                  f"p99 {pct(xs, 0.99):6.2f} ms")
        print(f"  {tag:<12} the server process's CPU per request (both kinds): {cpu[tag] / (2 * n) * 1e3:.3f} ms")


def main() -> int:
    if sys.argv[1:] == ["--serve-stub"]:
        serve_stub()
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=300, help="rounds measured (default 300)")
    ap.add_argument("--warmup", type=int, default=20, help="rounds not counted (default 20)")
    ap.add_argument("--prompt-bytes", type=int, default=4096, help="text prompt size (default 4096)")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--time-scale", type=float, default=0.05, help="the worker's --sim-time-scale (default 0.05)")
    ap.add_argument("--no-stream", action="store_true", help="skip the streamed HTTP arm")
    ap.add_argument("--router-args", default="", help="extra `kvmesh router` flags, space-separated")
    ap.add_argument("--baseline-ref", default="", help="a commit whose router's HTTP arms run beside this code's")
    ap.add_argument("--front", action="store_true", help="also the HTTP front alone, before a stub request path")
    ap.add_argument("--front-only", action="store_true", help="only the HTTP front alone")
    args = ap.parse_args()
    print(f"http_front: load average at start {load()}", flush=True)
    model = ensure_default_model()
    site = baseline_site(args.baseline_ref, ROOT) if args.baseline_ref else None
    if args.front or args.front_only:
        front_alone(args.pairs, args.prompt_bytes, site, args.baseline_ref)
        if args.front_only:
            return 0
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    http_port = free_port()
    cfg = StackConfig(model=str(model), workers=1, http_port=http_port, router_port=free_port(),
                      kv_service_port=free_port(), worker_port=free_port(), metrics_port=0, simulate=True,
                      worker_args=["--sim-time-scale", str(args.time_scale)],
                      router_args=["--log-level", "warning", *args.router_args.split()],
                      log_dir=tempfile.mkdtemp(prefix="kvmesh-http-front-"))
    stack = LocalStack(cfg).start()
    base: subprocess.Popen | None = None
    try:
        clients = {"": Http("127.0.0.1", http_port)}
        if site is not None:
            port, base_http = free_port(), free_port()
            base = subprocess.Popen(kvmesh_cmd("router", "--host", "127.0.0.1", "--port", str(port), "--kv-service",
                                               stack.endpoints["kv_service"], "--model", str(model), "--http-port",
                                               str(base_http), "--metrics-port", "0", "--log-level", "warning",
                                               *args.router_args.split()),
                                    env={**os.environ, "PYTHONPATH": str(site)})
            wait_grpc(f"127.0.0.1:{port}", base)
            clients[f" ({args.baseline_ref})"] = Http("127.0.0.1", base_http)
        router = router_pb2_grpc.RouterStub(dial(stack.endpoints["router"]))
        wchan = dial(stack.endpoints["worker-0"])
        worker = worker_pb2_grpc.WorkerStub(wchan)
        health = health_pb2_grpc.HealthStub(wchan)
        prompts = Prompts(args.prompt_bytes, seed=11)
        sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        ntokens: list[int] = []

        def body(stream: bool) -> bytes:
            return json.dumps({"model": "default", "prompt": prompts.text(), "max_tokens": args.max_tokens,
                               "temperature": 0, "ignore_eos": True, "stream": stream}).encode()

        def http_whole(client: Http) -> Callable[[], None]:
            def run() -> None:
                data = client.post("/v1/completions", body(False))
                assert json.loads(data)["usage"]["completion_tokens"] == args.max_tokens
            return run

        def http_stream(client: Http) -> Callable[[], None]:
            def run() -> None:
                data = client.post("/v1/completions", body(True))
                assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
            return run

        def router_grpc() -> None:
            for _ in router.Generate(router_pb2.GenerateRequest(text=prompts.text(), sampling=sampling), timeout=60):
                pass

        k = [0]

        def direct() -> float:
            ids = tok.encode(prompts.text(), add_special_tokens=True).ids
            ntokens.append(len(ids))
            k[0] += 1
            req = worker_pb2.WorkerGenerateRequest(request_id=f"direct-{k[0]}", prompt_token_ids=ids, sampling=sampling)
            t0 = time.perf_counter()
            for _ in worker.Generate(req, timeout=60):
                pass
            return (time.perf_counter() - t0) * 1e3  # tokenizing is the client's, not the worker's

        def hop() -> None:
            health.Check(health_pb2.HealthCheckRequest(), timeout=10)

        arms: dict[str, Callable[[], float | None]] = {"router gRPC": router_grpc, "direct": direct, "hop": hop}
        for tag, client in clients.items():
            arms["http" + tag] = http_whole(client)
            if not args.no_stream:
                arms["http stream" + tag] = http_stream(client)
        times: dict[str, list[float]] = {n: [] for n in arms}
        order = list(arms)
        rng = random.Random(3)
        print(f"rounds: {args.warmup} warm-up + {args.pairs}, load average {load()}", flush=True)
        for r in range(args.warmup + args.pairs):
            rng.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                own = arms[name]()
                ms = own if own is not None else (time.perf_counter() - t0) * 1e3
                if r >= args.warmup:
                    times[name].append(ms)
        for client in clients.values():
            client.conn.close()
        wchan.close()
    finally:
        if base is not None:
            base.terminate()
            base.wait(10)
        stack.stop()
    print(f"(load average at the end {load()}; prompts ~{args.prompt_bytes} bytes, "
          f"{statistics.median(ntokens):.0f} tokens p50; max_tokens {args.max_tokens}; "
          f"worker --sim-time-scale {args.time_scale})")
    routed = [n for n in times if n.startswith("http")] + ["router gRPC"]
    for name in [*routed, "direct", "hop"]:
        if name in times:
            xs = times[name]
            print(f"  {name:<26} p50 {statistics.median(xs):7.2f} ms   p99 {pct(xs, 0.99):7.2f} ms   (n={len(xs)})")
    d = statistics.median(times["direct"])
    h = statistics.median(times["hop"])
    print("added p50 over direct:")
    for name in routed:
        if name in times:
            a = statistics.median(times[name]) - d
            print(f"  {name:<26} {a:6.2f} ms = {a / h:5.2f} bare hops")
    front = statistics.median(times["http"]) - statistics.median(times["router gRPC"])
    print(f"  the HTTP front alone (http − router gRPC): {front:.2f} ms = {front / h:.2f} bare hops")
    added = statistics.median(times["http"]) - d
    print(f"\ngoal: the router HTTP front's added p50 ≤ {GOAL_MS:g} ms: {added:.2f} ms, "
          f"{'met' if added <= GOAL_MS else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
