"""`kvmesh router`: the public, KV-cache-aware entry point."""

from __future__ import annotations

import argparse
import gc
import logging

from kvmesh.commands.common import add_service_args, serve

log = logging.getLogger("kvmesh.router")


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
    add_service_args(p, metrics_port=9101, serves="api", calls="admin")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    from kvmesh.commands.config_args import config_from_args as build
    from kvmesh.router.config import RouterConfig

    return build(RouterConfig, args)


def run(args: argparse.Namespace) -> int:
    from kvmesh.router.server import RouterServer

    def start() -> RouterServer:
        server = RouterServer(config_from_args(args)).start()
        # NOTE: what start-up made lives as long as the process: frozen, the collector's full passes
        # (which a request that allocates much can trigger) skip it, so they no longer pause every
        # client on the loop for tens of milliseconds.
        gc.collect()
        gc.freeze()
        return server

    def serving(server: RouterServer) -> None:
        source = f"workers {args.workers}" if args.workers else f"kv_service {args.kv_service}"
        log.info("router listening on %s:%d (policy %s, %s)", args.host, server.port, args.policy, source)
        if server.http_port is not None:
            log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if server.http.tls else "http", args.host,
                     server.http_port)

    return serve(args, log, start, serving)
