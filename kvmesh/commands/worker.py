"""`kvmesh worker`: a model worker (engine + gRPC server + kv_service publisher)."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from kvmesh.commands.common import (
    add_log_level,
    add_security_args,
    apply_security,
    setup_logging,
    start_metrics_server,
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by `kvmesh worker` and `kvmesh up`."""
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks in the pool (default: from --memory-fraction)")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="CUDA: share of GPU memory for weights + KV (0.9); CPU: share of free RAM for KV (0.05)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step (default 2048)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="running requests at most (default 128)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens at most (default: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--hash-algorithm", default="sha256_128", choices=["sha256_128", "xxh3_128"],
                   help="block hash (default sha256_128; must match the other workers of the model)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16 (default auto)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default auto)")
    p.add_argument("--model-id", default=None, help="model identity in the index (default: see docs/block-hashing.md)")
    p.add_argument("--seed", type=int, default=0, help="seed for sampled requests without their own (default 0)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps per scheduler call when the batch is all decodes (default 1)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        block_size=args.block_size, num_blocks=args.num_blocks, memory_fraction=args.memory_fraction,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        hash_algorithm=args.hash_algorithm, dtype=args.dtype, device=args.device, model_id=args.model_id,
        seed=args.seed, num_scheduler_steps=args.num_scheduler_steps,
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run a model worker (gRPC)",
                       description="Run a model worker: paged-KV engine, token streaming, block events to kv_service.")
    p.add_argument("--model", default=None,
                   help="model directory (config.json, *.safetensors, tokenizer.json); default: the tiny demo model")
    p.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=50061, help="gRPC port (default 50061)")
    p.add_argument("--advertise-address", default=None,
                   help="host:port routers should dial (default: $POD_IP or this host's name, with --port)")
    p.add_argument("--kv-service", default="127.0.0.1:50052",
                   help="kv_service host:port to register with and publish to; 'none' to run alone")
    p.add_argument("--worker-id", default=None, help="id in the index and in served_by (default: the host name)")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests in flight before RESOURCE_EXHAUSTED (default 1024)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per stream message after the first, as vLLM's --stream-interval: larger values cut "
                        "host overhead per token, the first token still goes out at once (default 1)")
    p.add_argument("--metrics-port", type=int, default=9102, help="Prometheus /metrics port, 0 = off (default 9102)")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads, 0 = torch default (default 0)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds to drain on SIGTERM (default 5)")
    add_engine_args(p)
    add_sim_args(p)
    add_security_args(p, serves="admin", calls="admin")
    add_log_level(p)
    p.set_defaults(func=run)


def add_sim_args(p: argparse.ArgumentParser) -> None:
    """`--simulate` and the cost model's constants (model_worker/sim_runner.py, docs/benchmarks.md)."""
    from kvmesh.model_worker.sim_runner import CostModel

    c = CostModel()
    g = p.add_argument_group("simulation (no weights, no KV tensors; the forward pass is a cost model)")
    g.add_argument("--simulate", action="store_true",
                   help="replace the forward pass by an H100 / 8B cost model; scheduler, prefix cache and "
                        "events are real; default --num-blocks 27648, --max-model-len 131072")
    g.add_argument("--sim-time-scale", type=float, default=1.0,
                   help="wall seconds slept per modelled second (0.25 = 4x faster than the GPU; default 1)")
    for field, doc in (("step_overhead_s", "fixed seconds per step"),
                       ("prefill_token_s", "seconds per new prefill token"),
                       ("attn_pair_s", "seconds per prefill (new x context) token pair"),
                       ("decode_seq_s", "seconds per decoding sequence"),
                       ("decode_kv_token_s", "seconds per context token read by a decode")):
        g.add_argument(f"--sim-{field.removesuffix('_s').replace('_', '-')}", dest=f"sim_{field}", type=float,
                       default=getattr(c, field), help=f"{doc} (default {getattr(c, field):g})")


def default_advertise(host: str, port: int) -> str:
    if host not in ("0.0.0.0", "::", ""):
        return f"{host}:{port}"
    return f"{os.environ.get('POD_IP') or socket.gethostname()}:{port}"


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    log = logging.getLogger("kvmesh.worker")
    try:
        apply_security(args)
    except (ValueError, OSError) as exc:
        log.error("%s", exc)
        return 2
    if args.stream_interval < 1:
        log.error("--stream-interval must be >= 1, got %d", args.stream_interval)
        return 2
    from kvmesh.model_worker.llm_engine import LLMEngine
    from kvmesh.model_worker.server import WorkerServer
    from kvmesh.transport.rpc import wait_for_termination_signal

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    model = args.model
    if model is None:
        from kvmesh.make_model import ensure_default_model

        model = str(ensure_default_model())
        log.info("no --model given: using the tiny demo model at %s (its output is noise)", model)
    kwargs = engine_kwargs(args)
    if args.simulate:
        from kvmesh.model_worker.config import EngineConfig
        from kvmesh.model_worker.sim_runner import (
            DEFAULT_SIM_MAX_MODEL_LEN,
            CostModel,
            SimRunner,
            export_metrics,
        )

        cost = CostModel(**{f: getattr(args, f"sim_{f}") for f in CostModel.__dataclass_fields__})
        from kvmesh.model_worker.sim_runner import DEFAULT_SIM_NUM_BLOCKS

        blocks = kwargs["num_blocks"] or DEFAULT_SIM_NUM_BLOCKS
        kwargs["max_model_len"] = kwargs["max_model_len"] or min(DEFAULT_SIM_MAX_MODEL_LEN,
                                                                 (blocks - 1) * kwargs["block_size"])
        kwargs["device"] = "cpu"
        sim: list[SimRunner] = []

        def make_runner(config: EngineConfig, model_config) -> SimRunner:
            sim.append(SimRunner(config, model_config, cost, args.sim_time_scale))
            return sim[0]

        kwargs["runner_factory"] = make_runner
    try:
        engine = LLMEngine(model=model, **kwargs)
    except (ValueError, FileNotFoundError) as exc:
        log.error("cannot load %s: %s", model, exc)
        return 2
    worker_id = args.worker_id or socket.gethostname()
    kv = None if args.kv_service.lower() == "none" else args.kv_service
    try:
        server = WorkerServer(engine, worker_id, args.host, args.port, kv,
                              args.advertise_address or default_advertise(args.host, args.port),
                              args.max_queued_requests, args.stream_interval).start()
    except OSError as exc:
        log.error("%s", exc)
        return 2
    if args.simulate:
        export_metrics(sim[0], server.metrics.registry)
        log.info("simulated worker: %s, time scale %g", cost, args.sim_time_scale)
    if args.metrics_port:
        start_metrics_server(args.metrics_port, server.metrics.registry)
    log.info("worker %s serving %s on %s:%d (%d KV blocks of %d tokens)", worker_id, engine.model_id, args.host,
             server.port, engine.kv_cache_manager.num_blocks, engine.config.block_size)
    wait_for_termination_signal(server.stop, args.grace)
    return 0
