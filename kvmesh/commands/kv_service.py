"""`kvmesh kv-service`: the KV-cache metadata service."""

from __future__ import annotations

import argparse
import logging

from kvmesh.commands.common import (
    add_log_level,
    add_security_args,
    apply_security,
    setup_logging,
    start_metrics_server,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kv-service", help="run the KV-cache metadata service (gRPC)",
                       description="Run the KV-cache metadata service: which worker holds which block.")
    p.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=50052, help="gRPC port (default 50052)")
    store = p.add_mutually_exclusive_group()
    store.add_argument("--redis-url", default=None,
                       help="Redis to keep the index in, e.g. redis://127.0.0.1:6379/0 (the default store)")
    store.add_argument("--store", choices=["redis", "memory"], default=None,
                       help="'memory' keeps the index in this process (single replica only)")
    p.add_argument("--namespace", default="kvmesh",
                   help="Redis key hash tag; deployments sharing one Redis use different ones (default kvmesh)")
    p.add_argument("--lease-ttl-ms", type=int, default=10_000,
                   help="worker lease: no heartbeat for this long removes it from lookups (default 10000)")
    p.add_argument("--max-publishers", type=int, default=1024,
                   help="workers that may stream block events to this replica at once; one more is refused "
                        "with RESOURCE_EXHAUSTED (default 1024)")
    p.add_argument("--max-blocks-per-call", type=int, default=256,
                   help="block hashes one Redis event-apply script carries at most; a bigger batch is applied in "
                        "several calls so a Lookup never waits behind a whole batch (default 256)")
    p.add_argument("--redis-connections", type=int, default=64,
                   help="size of the Redis connection pool (default 64)")
    p.add_argument("--metrics-port", type=int, default=9100, help="Prometheus /metrics port, 0 = off (default 9100)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds to drain on SIGTERM (default 5)")
    add_security_args(p, serves="admin", calls=None)
    add_log_level(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.contract.errors import Unavailable
    from kvmesh.kv_service.server import KVServiceServer
    from kvmesh.kv_service.service import ServiceConfig
    from kvmesh.transport.rpc import wait_for_termination_signal

    setup_logging(args.log_level)
    log = logging.getLogger("kvmesh.kv_service")
    try:
        apply_security(args)
    except (ValueError, OSError) as exc:
        log.error("%s", exc)
        return 2
    if args.lease_ttl_ms < 100:
        log.error("--lease-ttl-ms must be >= 100")
        return 2
    if args.max_publishers < 1 or args.max_blocks_per_call < 1 or args.redis_connections < 1:
        log.error("--max-publishers, --max-blocks-per-call and --redis-connections must be >= 1")
        return 2
    url = args.redis_url or "redis://127.0.0.1:6379/0"
    if args.store == "memory":
        from kvmesh.kv_service.store_memory import MemoryIndex

        index = MemoryIndex()
    else:
        from kvmesh.kv_service.store_redis import RedisIndex

        index = RedisIndex(url, namespace=args.namespace, max_blocks_per_call=args.max_blocks_per_call,
                           max_connections=args.redis_connections)
    config = ServiceConfig(lease_ttl_ms=args.lease_ttl_ms, reap_interval_s=max(0.1, args.lease_ttl_ms / 2000))
    try:
        server = KVServiceServer(index, args.host, args.port, config, max_publishers=args.max_publishers).start()
    except Unavailable as exc:
        log.error("cannot reach Redis at %s (%s); start one or pass --store memory", url, exc)
        return 2
    except OSError as exc:
        log.error("%s", exc)
        return 2
    if args.metrics_port:
        start_metrics_server(args.metrics_port, server.metrics.registry)
    log.info("kv_service listening on %s:%d (store=%s)", args.host, server.port, index.name)
    wait_for_termination_signal(server.stop, args.grace)
    return 0
