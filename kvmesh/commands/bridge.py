"""`kvmesh bridge`: a vLLM or SGLang server as a kvmesh worker (docs/vllm.md)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

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
    p.add_argument("--metrics-port", type=int, default=9103,
                   help="the bridge's own Prometheus /metrics port, 0 = off (default 9103)")
    add_security_args(p, serves=None, calls="admin")
    add_tracing_args(p)
    add_log_level(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.bridge.bridge import Bridge
    from kvmesh.bridge.config import BridgeConfig
    from kvmesh.commands.config_args import config_from_args

    setup_logging(args.log_level)
    log = logging.getLogger("kvmesh.bridge")
    cfg = config_from_args(BridgeConfig, args)
    try:
        apply_security(args)
        apply_tracing(args, "kvmesh-bridge")
        bridge = Bridge(cfg)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if args.metrics_port:
        start_metrics_server(args.metrics_port, bridge.metrics.registry)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        # NOTE: waiting for the engine happens here, so SIGTERM still ends a bridge whose engine never came.
        starter = threading.Thread(target=_start, args=(bridge, done), daemon=True)
        starter.start()
        done.wait()
    finally:
        bridge.stop()
        from kvmesh.transport import tracing

        tracing.shutdown()
    return getattr(bridge, "exit_code", 0)


def _start(bridge, done: threading.Event) -> None:
    log = logging.getLogger("kvmesh.bridge")
    try:
        bridge.start()
    except (ValueError, TimeoutError) as exc:
        log.error("%s", exc)
        bridge.exit_code = 2
        done.set()
