"""`kvmesh router`: the public, KV-cache-aware entry point."""

from __future__ import annotations

import argparse
import gc
import logging

from kvmesh.commands.common import (
    add_log_level,
    add_security_args,
    add_tracing_args,
    apply_security,
    apply_tracing,
    setup_logging,
    start_metrics_server,
)


def register(sub: argparse._SubParsersAction) -> None:
    from kvmesh.commands.config_args import add_config_args
    from kvmesh.contract.block_hash import ALGORITHMS
    from kvmesh.router.config import RouterConfig
    from kvmesh.router.core.policies import policy_names
    from kvmesh.router.core.policies.base import STEP_COST_FITS

    p = sub.add_parser("router", help="run the KV-cache-aware router (gRPC, and OpenAI HTTP with --http-port)",
                       description="Route each request to the worker with the least tokens of work: "
                                   "uncached prefill plus queued work. Serves every model whose workers "
                                   "register with the kv_service.")
    add_config_args(p, RouterConfig, choices={"policy": policy_names(), "hash_algorithm": ALGORITHMS,
                                              "step_cost_fit": STEP_COST_FITS})
    p.add_argument("--metrics-port", type=int, default=9101, help="Prometheus /metrics port, 0 = off (default 9101)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds to drain on SIGTERM (default 5)")
    add_security_args(p, serves="api", calls="admin")
    add_tracing_args(p)
    add_log_level(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    from kvmesh.commands.config_args import config_from_args as build
    from kvmesh.router.config import RouterConfig

    return build(RouterConfig, args)


def run(args: argparse.Namespace) -> int:
    from kvmesh.router.server import RouterServer
    from kvmesh.transport.server import wait_for_termination_signal

    setup_logging(args.log_level)
    log = logging.getLogger("kvmesh.router")
    try:
        apply_security(args)
        apply_tracing(args, "kvmesh-router")
        server = RouterServer(config_from_args(args)).start()
    except (ValueError, FileNotFoundError, OSError) as exc:
        log.error("%s", exc)
        return 2
    # NOTE: what start-up made lives as long as the process: frozen, the collector's full passes
    # (which a request that allocates much can trigger) skip it, so they no longer pause every
    # client on the loop for tens of milliseconds.
    gc.collect()
    gc.freeze()
    if args.metrics_port:
        start_metrics_server(args.metrics_port, server.metrics.registry)
    source = f"workers {args.workers}" if args.workers else f"kv_service {args.kv_service}"
    log.info("router listening on %s:%d (policy %s, %s)", args.host, server.port, args.policy, source)
    if server.http_port is not None:
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if server.http.tls else "http", args.host,
                 server.http_port)
    wait_for_termination_signal(server.stop, args.grace)
    return 0
