"""`kvmesh epp`: the KV-aware router as a Gateway API Inference Extension endpoint picker (ext_proc)."""

from __future__ import annotations

import argparse
import gc
import logging

from kvmesh.commands.common import add_service_args, serve

log = logging.getLogger("kvmesh.epp")

ROUTER_ONLY = ("port", "http_port", "http_header_timeout_s", "http_body_timeout_s", "http_max_unfinished",
               "http_keep_alive_s", "http_linger_bytes", "http_linger_time_s")
"""RouterConfig's fields of the fronts the endpoint picker does not have (its port is EppConfig's)."""


def register(sub: argparse._SubParsersAction) -> None:
    from kvmesh.commands.config_args import add_config_args
    from kvmesh.contract.block_hash import ALGORITHMS
    from kvmesh.router.config import EPP_BODY_MODES, EppConfig, RouterConfig
    from kvmesh.router.core.policies import policy_names
    from kvmesh.router.core.policies.base import STEP_COST_FITS

    p = sub.add_parser("epp", help="run the router's picks as a Gateway API Inference Extension endpoint picker "
                                   "(Envoy ext_proc)",
                       description="Answer a gateway's ext_proc stream per request with the worker the router would "
                                   "pick (x-gateway-destination-endpoint and the envoy.lb metadata), from the same "
                                   "index, policy and shared view as `kvmesh router` (docs/epp.md).")
    add_config_args(p, EppConfig, choices={"request_body_mode": EPP_BODY_MODES})
    add_config_args(p, RouterConfig, exclude=ROUTER_ONLY,
                    choices={"policy": policy_names(), "hash_algorithm": ALGORITHMS, "step_cost_fit": STEP_COST_FITS})
    add_service_args(p, metrics_port=9090, serves="api", calls="admin")
    p.set_defaults(func=run)


def configs_from_args(args: argparse.Namespace):
    from kvmesh.commands.config_args import config_from_args as build
    from kvmesh.router.config import EppConfig, RouterConfig

    return build(RouterConfig, args, exclude=ROUTER_ONLY), build(EppConfig, args)


def run(args: argparse.Namespace) -> int:
    from kvmesh.router.epp import EppServer

    def start() -> EppServer:
        server = EppServer(*configs_from_args(args)).start()
        gc.collect()
        gc.freeze()  # as the router: start-up's objects out of the collector's full passes
        return server

    def serving(server: EppServer) -> None:
        source = f"workers {args.workers}" if args.workers else f"kv_service {args.kv_service}"
        log.info("endpoint picker (ext_proc) listening on %s:%d (policy %s, %s)", args.host, server.port,
                 args.policy, source)

    return serve(args, log, start, serving)
