"""`kvmesh kv-service`: the KV-cache metadata service."""

from __future__ import annotations

import argparse
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
    from kvmesh.kv_service.config import LOOKUP_WALKS, KVServiceConfig

    p = sub.add_parser("kv-service", help="run the KV-cache metadata service (gRPC)",
                       description="Run the KV-cache metadata service: which worker holds which block.")
    add_config_args(p, KVServiceConfig, choices={"store": ["redis", "memory"], "lookup_walk": list(LOOKUP_WALKS)})
    p.add_argument("--metrics-port", type=int, default=9100, help="Prometheus /metrics port, 0 = off (default 9100)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds to drain on SIGTERM (default 5)")
    add_security_args(p, serves="admin", calls=None)
    add_tracing_args(p)
    add_log_level(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.commands.config_args import config_from_args
    from kvmesh.contract.errors import FailedPrecondition, Unavailable
    from kvmesh.kv_service.config import DEFAULT_REDIS_URL, KVServiceConfig
    from kvmesh.kv_service.server import KVServiceServer
    from kvmesh.kv_service.stores import make_store
    from kvmesh.transport.server import wait_for_termination_signal

    setup_logging(args.log_level)
    log = logging.getLogger("kvmesh.kv_service")
    config = config_from_args(KVServiceConfig, args)
    try:
        apply_security(args)
        apply_tracing(args, "kvmesh-kv-service")
        config.check()
    except (ValueError, OSError) as exc:
        log.error("%s", exc)
        return 2
    index = make_store(config.store, config.redis_url, config.redis, config.lookup_walk)
    try:
        server = KVServiceServer(index, config.host, config.port, config.service,
                                 max_publishers=config.max_publishers, faults=config.faults).start()
    except Unavailable as exc:  # the server pings the store at start: one actionable line, no traceback
        log.error("cannot reach Redis at %s (%s); start one or pass --store memory",
                  config.redis_url or DEFAULT_REDIS_URL, exc)
        return 2
    except FailedPrecondition as exc:  # the namespace is kept in another number of shards
        log.error("%s", exc)
        return 2
    except OSError as exc:
        log.error("%s", exc)
        return 2
    if args.metrics_port:
        start_metrics_server(args.metrics_port, server.metrics.registry)
    log.info("kv_service listening on %s:%d (store=%s%s%s)", config.host, server.port, index.name,
             f", {config.redis.shards} shards" if config.redis.shards > 1 else "",
             ", Lookups from replicas" if config.redis.read_replicas else "")
    if config.faults.lookup_delay_ms or config.faults.reserve_delay_ms:
        log.warning("injecting latency: Lookup +%g ms, Reserve +%g ms (--lookup-delay-ms / --reserve-delay-ms; a "
                    "stress setting, not for production)", config.faults.lookup_delay_ms, config.faults.reserve_delay_ms)
    wait_for_termination_signal(server.stop, args.grace)
    return 0
