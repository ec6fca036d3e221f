"""`kvmesh worker`: a model worker (engine + gRPC server + kv_service publisher)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from typing import TYPE_CHECKING

from kvmesh.commands.common import add_cost_model_args, add_service_args, linear_cost_from, serve, sim_choices

if TYPE_CHECKING:
    from kvmesh.model_worker.serving.server import WorkerServer

log = logging.getLogger("kvmesh.worker")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags (every field of EngineConfig but the model)."""
    from kvmesh.commands.config_args import add_config_args
    from kvmesh.contract.block_hash import ALGORITHMS
    from kvmesh.model_worker.config import EngineConfig

    add_config_args(p.add_argument_group("engine"), EngineConfig, exclude=("model",),
                    choices={"hash_algorithm": ALGORITHMS})


def register(sub: argparse._SubParsersAction) -> None:
    from kvmesh.commands.config_args import add_config_args
    from kvmesh.model_worker.config import WorkerConfig

    p = sub.add_parser("worker", help="run a model worker (gRPC)",
                       description="Run a model worker: paged-KV engine, token streaming, block events to kv_service.")
    p.add_argument("--model", default=None,
                   help="model directory (config.json, *.safetensors, tokenizer.json); default: the tiny demo model")
    add_config_args(p, WorkerConfig)
    add_engine_args(p)
    add_sim_args(p)
    add_service_args(p, metrics_port=9102, serves="admin", calls="admin")
    p.set_defaults(func=run)


def add_sim_args(p: argparse.ArgumentParser) -> None:
    """`--simulate` and the step-time model (model_worker/simulated/step_time.py, docs/benchmarks.md)."""
    from kvmesh.commands.config_args import add_config_args
    from kvmesh.model_worker.simulated.sim_runner import DEFAULT_SIM_MAX_MODEL_LEN
    from kvmesh.model_worker.simulated.step_time import LinearCost, StepTimeConfig

    g = p.add_argument_group("simulation (no weights, no KV tensors; the forward pass is a cost model)")
    g.add_argument("--simulate", action="store_true",
                   help="replace the forward pass by a step-time model (default: the roofline of an H100 serving "
                        "Llama-3.1-8B); scheduler, prefix cache and events are real; default --num-blocks: what "
                        f"--sim-gpu holds, --max-model-len {DEFAULT_SIM_MAX_MODEL_LEN}")
    g.add_argument("--sim-time-scale", type=float, default=1.0,
                   help="wall seconds slept per modelled second (0.25 = 4x faster than the GPU; default 1)")
    add_config_args(g, StepTimeConfig, choices=sim_choices())
    add_cost_model_args(g, LinearCost())


def default_advertise(host: str, port: int) -> str:
    if host not in ("0.0.0.0", "::", ""):
        return f"{host}:{port}"
    return f"{os.environ.get('POD_IP') or socket.gethostname()}:{port}"


def run(args: argparse.Namespace) -> int:
    from kvmesh.commands.config_args import config_from_args
    from kvmesh.model_worker.config import EngineConfig, WorkerConfig

    worker = config_from_args(WorkerConfig, args)

    def start() -> WorkerServer:
        worker.check()
        from kvmesh.model_worker.engine.llm_engine import LLMEngine
        from kvmesh.model_worker.serving.server import WorkerServer

        if worker.torch_threads:
            from kvmesh.model_worker.execution.model_runner import set_cpu_threads

            set_cpu_threads(worker.torch_threads)
        model = args.model
        if model is None:
            from kvmesh.make_model import ensure_default_model

            model = str(ensure_default_model())
            log.info("no --model given: using the tiny demo model at %s (its output is noise)", model)
        engine_config = config_from_args(EngineConfig, args, model=model)
        runner_factory = None
        if args.simulate:
            from kvmesh.model_worker.simulated.sim_runner import (
                DEFAULT_SIM_MAX_MODEL_LEN,
                SimRunner,
                export_metrics,
            )
            from kvmesh.model_worker.simulated.step_time import StepTimeConfig, gpu_spec

            step_time = config_from_args(StepTimeConfig, args)
            step_time.check()
            cost = step_time.model(linear=linear_cost_from(args))
            blocks = engine_config.num_blocks = engine_config.num_blocks or (
                gpu_spec(step_time.gpu).kv_tokens() // engine_config.block_size)
            engine_config.max_model_len = engine_config.max_model_len or min(
                DEFAULT_SIM_MAX_MODEL_LEN, (blocks - 1) * engine_config.block_size)
            engine_config.device = "cpu"
            sim: list[SimRunner] = []

            def runner_factory(config: EngineConfig, model_config) -> SimRunner:
                sim.append(SimRunner(config, model_config, cost, args.sim_time_scale, step_time.step_noise,
                                     noise_seed=config.seed))
                return sim[0]

        try:
            engine = LLMEngine(config=engine_config, runner_factory=runner_factory)
        except (ValueError, FileNotFoundError) as exc:
            raise ValueError(f"cannot load {model}: {exc}") from None
        worker_id = worker.worker_id or socket.gethostname()
        server = WorkerServer(engine, worker_id, worker.host, worker.port, worker.kv_service,
                              worker.advertise_address or default_advertise(worker.host, worker.port),
                              worker.max_queued_requests, worker.stream_interval, worker.role, worker.kv_transport,
                              worker.kv_hold_ttl).start()
        if args.simulate:
            export_metrics(sim[0], server.metrics.registry)
            log.info("simulated worker: %s, time scale %g", cost, args.sim_time_scale)
        return server

    def serving(server: WorkerServer) -> None:
        engine = server.engine
        warm = engine.warmup_report
        log.info("worker %s serving %s on %s:%d (%d KV blocks of %d tokens%s)", server.worker_id, engine.model_id,
                 worker.host, server.port, engine.kv_cache_manager.num_blocks, engine.config.block_size,
                 f"; {warm}" if warm else "")

    return serve(args, log, start, serving)
