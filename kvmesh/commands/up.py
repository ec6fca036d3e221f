"""`kvmesh up`: the whole stack on this machine."""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start Redis, kv_service, workers and a router locally",
                       description="Start a local kvmesh stack; Ctrl-C / SIGTERM stops it.")
    p.add_argument("--model", action="append", default=None, metavar="DIR",
                   help="model directory; repeat it to serve several models behind one router, each with "
                        "--workers workers (default: the tiny demo model, made once)")
    p.add_argument("--workers", type=int, default=2, help="kvmesh workers per model; 0 with --vllm (default 2)")
    p.add_argument("--prefill-workers", type=int, default=0, metavar="N",
                   help="prefill/decode disaggregation: of each model's --workers, N run --role prefill and the "
                        "rest --role decode; the router decides per request whether a prefill worker takes the "
                        "prompt (docs/router.md) (default 0: every worker serves whole requests)")
    p.add_argument("--vllm", action="append", default=[], metavar="URL,EVENTS[,REPLAY]",
                   help="a running vLLM server of the first model as a worker, repeatable: its base URL, its KV "
                        "event endpoint and (optional) its replay endpoint, e.g. "
                        "http://127.0.0.1:8001,tcp://127.0.0.1:5557,tcp://127.0.0.1:5558; a bridge is started "
                        "for each (docs/vllm.md)")
    p.add_argument("--host", default="127.0.0.1", help="address every part listens on (default 127.0.0.1)")
    p.add_argument("--router-port", type=int, default=50051,
                   help="first router's port; router i on this + 2*i (default 50051)")
    p.add_argument("--routers", type=int, default=1,
                   help="routers over the one kv_service, as the deployment's replicas; clients spread over them "
                        "with gRPC round_robin (`kvmesh generate --router ipv4:H:P1,H:P2`) (default 1)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the router's OpenAI-compatible HTTP API port (docs/openai.md); 0 = off (default 8000)")
    p.add_argument("--kv-service-port", type=int, default=50052, help="kv_service port (default 50052)")
    p.add_argument("--worker-port", type=int, default=50061, help="first worker port; then +1 each (default 50061)")
    p.add_argument("--metrics-port", type=int, default=9100,
                   help="kv_service /metrics port; router +1, worker i +2+i; 0 = off (default 9100)")
    store = p.add_mutually_exclusive_group()
    store.add_argument("--redis-url", default=None, help="use this Redis (default: start a private redis-server)")
    store.add_argument("--store", choices=["redis", "memory"], default="redis",
                       help="'memory': no Redis, the kv_service keeps the index in-process")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for every worker, repeatable (e.g. --worker-arg=--num-blocks=512)")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="extra flag for the router, repeatable (e.g. --router-arg=--policy=round-robin)")
    p.add_argument("--simulate", action="store_true",
                   help="simulated workers: real scheduler and prefix cache, forward pass replaced by an "
                        "H100 cost model (docs/benchmarks.md); pass --worker-arg=--sim-time-scale=X etc.")
    p.add_argument("--worker-start-timeout", type=float, default=900.0, metavar="S",
                   help="seconds to wait for each worker to report SERVING; a worker loads its model and warms "
                        "up (compiles, CUDA graphs) before it serves (default 900)")
    p.add_argument("--otlp-endpoint", default=None, metavar="HOST:PORT",
                   help="every part exports OpenTelemetry traces to this OTLP/gRPC collector (docs/tracing.md); "
                        "default: off")
    p.add_argument("--log-dir", default=None, help="where the children's logs go (default: a new temp dir)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.stack import LocalStack, StackConfig

    models = args.model
    if not models:
        from kvmesh.make_model import ensure_default_model

        models = [str(ensure_default_model())]
        print(f"using the tiny demo model {models[0]} (random weights: its output is noise)", flush=True)
    cfg = StackConfig(model=models[0], extra_models=models[1:], workers=args.workers, prefill_workers=args.prefill_workers,
                      host=args.host,
                      http_port=args.http_port or None, router_port=args.router_port, routers=args.routers,
                      kv_service_port=args.kv_service_port, worker_port=args.worker_port,
                      metrics_port=args.metrics_port, redis_url=args.redis_url, store=args.store,
                      worker_args=args.worker_arg, router_args=args.router_arg, log_dir=args.log_dir,
                      simulate=args.simulate, vllm=args.vllm, worker_start_timeout=args.worker_start_timeout,
                      otlp_endpoint=args.otlp_endpoint)
    try:
        cfg.check()
    except ValueError as exc:
        print(f"kvmesh up: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = LocalStack(cfg)
    bridged = f" + {len(args.vllm)} vLLM server(s)" if args.vllm else ""
    print(f"starting kvmesh ({args.workers} worker(s) x {len(models)} model(s){bridged}); logs in {stack.log_dir}",
          flush=True)
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvmesh up: {exc}; see the logs in {stack.log_dir}", file=sys.stderr)
        return 1
    for name, addr in stack.endpoints.items():
        print(f"  {name:<12} {addr}", flush=True)
    hint = f" or `curl {stack.endpoints['openai']}/models`" if "openai" in stack.endpoints else ""
    where = f" --router {stack.endpoints['routers']}" if "routers" in stack.endpoints else ""
    print(f"ready: try `kvmesh generate{where} \"Hello\"`{hint} or `kvmesh admin stats`; Ctrl-C stops", flush=True)
    while not stop.wait(1.0):
        dead = stack.failed()
        if dead:
            print(f"kvmesh up: {', '.join(dead)} exited; stopping (logs in {stack.log_dir})", file=sys.stderr)
            stack.stop()
            return 1
    print("stopping...", flush=True)
    stack.stop()
    return 0
