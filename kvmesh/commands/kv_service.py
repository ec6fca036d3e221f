"""`kvmesh kv-service`: the KV-cache metadata service."""

from __future__ import annotations

import argparse
import logging

from kvmesh.commands.common import add_service_args, serve

log = logging.getLogger("kvmesh.kv_service")


def register(sub: argparse._SubParsersAction) -> None:
    from kvmesh.commands.config_args import add_config_args
    from kvmesh.kv_service.config import LOOKUP_WALKS, KVServiceConfig

    p = sub.add_parser("kv-service", help="run the KV-cache metadata service (gRPC)",
                       description="Run the KV-cache metadata service: which worker holds which block.")
    add_config_args(p, KVServiceConfig, choices={"store": ["redis", "memory"], "lookup_walk": list(LOOKUP_WALKS)})
    add_service_args(p, metrics_port=9100, serves="admin", calls=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.commands.config_args import config_from_args
    from kvmesh.contract.errors import FailedPrecondition, Unavailable
    from kvmesh.kv_service.config import DEFAULT_REDIS_URL, KVServiceConfig
    from kvmesh.kv_service.server import KVServiceServer
    from kvmesh.kv_service.stores import make_store

    config = config_from_args(KVServiceConfig, args)

    def start() -> KVServiceServer:
        config.check()
        index = make_store(config.store, config.redis_url, config.redis, config.lookup_walk)
        try:
            return KVServiceServer(index, config.host, config.port, config.service,
                                   max_publishers=config.max_publishers, faults=config.faults).start()
        except Unavailable as exc:  # the server pings the store at start: one actionable line, no traceback
            raise ValueError(f"cannot reach Redis at {config.redis_url or DEFAULT_REDIS_URL} ({exc}); start one "
                             "or pass --store memory") from None
        except FailedPrecondition as exc:  # the namespace is kept in another number of shards
            raise ValueError(str(exc)) from None

    def serving(server: KVServiceServer) -> None:
        log.info("kv_service listening on %s:%d (store=%s%s%s)", config.host, server.port, server.service.index.name,
                 f", {config.redis.shards} shards" if config.redis.shards > 1 else "",
                 ", Lookups from replicas" if config.redis.read_replicas else "")
        if config.faults.lookup_delay_ms or config.faults.reserve_delay_ms:
            log.warning("injecting latency: Lookup +%g ms, Reserve +%g ms (--lookup-delay-ms / --reserve-delay-ms; "
                        "a stress setting, not for production)", config.faults.lookup_delay_ms,
                        config.faults.reserve_delay_ms)

    return serve(args, log, start, serving)
