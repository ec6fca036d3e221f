"""`kvmesh bridge`: a vLLM or SGLang server as a kvmesh worker (docs/vllm.md)."""

from __future__ import annotations

import argparse
import logging

from kvmesh.commands.common import add_service_args, serve

log = logging.getLogger("kvmesh.bridge")


def register(sub: argparse._SubParsersAction) -> None:
    from kvmesh.bridge.config import BridgeConfig
    from kvmesh.bridge.engine_load import ENGINES
    from kvmesh.commands.config_args import add_config_args
    from kvmesh.contract.block_hash import ALGORITHMS

    p = sub.add_parser(
        "bridge", help="make a vLLM / SGLang server a kvmesh worker (its KV events feed the index)",
        description="Registers an engine server with the kv_service, mirrors its KV events (ZMQ) into kvmesh "
                    "block events hashed from their token ids, reports its load from its /metrics and keeps its "
                    "lease. Routers send it requests directly, as token ids. One bridge per server or data-parallel "
                    "rank (a sidecar in Kubernetes).")
    add_config_args(p, BridgeConfig, choices={"engine": ENGINES, "hash_algorithm": ALGORITHMS})
    add_service_args(p, metrics_port=9103, serves=None, calls="admin", grace=False,
                     metrics_help="the bridge's own Prometheus /metrics port")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.bridge.bridge import Bridge
    from kvmesh.bridge.config import BridgeConfig
    from kvmesh.commands.config_args import config_from_args

    cfg = config_from_args(BridgeConfig, args)
    # NOTE: waiting for the engine happens in the background, so SIGTERM still ends a bridge whose
    # engine never came.
    return serve(args, log, lambda: Bridge(cfg), background=Bridge.start)
