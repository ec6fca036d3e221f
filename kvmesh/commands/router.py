"""`kvmesh router`: the public, KV-cache-aware entry point."""

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
    from kvmesh.router.policy import POLICIES

    p = sub.add_parser("router", help="run the KV-cache-aware router (gRPC)",
                       description="Route each request to the worker with the least tokens of work: "
                                   "uncached prefill plus queued work.")
    p.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=50051, help="public gRPC port (default 50051)")
    p.add_argument("--kv-service", default="127.0.0.1:50052",
                   help="kv_service host:port; '' = none (needs --workers) (default 127.0.0.1:50052)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="model dir whose tokenizer.json tokenizes text prompts (without it: token ids only)")
    p.add_argument("--model-id", default=None,
                   help="model id in block hashes (default: from --model, else the one model in kv_service)")
    p.add_argument("--workers", default="", metavar="LIST",
                   help="static worker addresses host:port,... instead of discovery from kv_service")
    p.add_argument("--policy", default="kv-aware", choices=list(POLICIES), help="routing policy (default kv-aware)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per block when no worker reports it yet (default 16)")
    p.add_argument("--hash-algorithm", default="sha256_128",
                   help="block hash when kv_service does not report it: sha256_128 or xxh3_128 (default sha256_128)")
    p.add_argument("--lookup-timeout-ms", type=float, default=50.0,
                   help="deadline of one kv_service Lookup; past it, route by rendezvous hash (default 50)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="deadline in seconds of a forwarded Generate (default 600)")
    p.add_argument("--first-token-timeout", type=float, default=60.0,
                   help="retry elsewhere when a worker sends no token for this long, 0 = off (default 60)")
    p.add_argument("--max-attempts", type=int, default=3, help="workers tried before the first token (default 3)")
    p.add_argument("--balance-factor", type=float, default=2.0,
                   help="hot-spot guard: a worker queued over this x the mean (and over the least loaded by "
                        "--balance-min-tokens) gets no prefix-affine traffic (default 2.0)")
    p.add_argument("--balance-min-tokens", type=int, default=2048,
                   help="hot-spot guard's absolute margin in tokens (default 2048)")
    p.add_argument("--decode-cost", type=int, default=32,
                   help="tokens of work charged per running or queued request (default 32)")
    p.add_argument("--overlap-weight", type=float, default=1.0,
                   help="kv-aware: weight of uncached prompt tokens against queued tokens; above 1 favours "
                        "cache hits over balance (default 1.0)")
    p.add_argument("--speculative-ttl", type=float, default=2.0,
                   help="seconds a routed prompt's blocks count as held by its worker, 0 = off (default 2.0)")
    p.add_argument("--max-streams", type=int, default=1024,
                   help="concurrent Generate streams; more get RESOURCE_EXHAUSTED (default 1024)")
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="refuse longer prompts with RESOURCE_EXHAUSTED, 0 = no limit (default 0)")
    p.add_argument("--max-tokens-limit", type=int, default=0,
                   help="refuse requests asking for more max_tokens with RESOURCE_EXHAUSTED, 0 = no limit (default 0)")
    p.add_argument("--metrics-port", type=int, default=9101, help="Prometheus /metrics port, 0 = off (default 9101)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds to drain on SIGTERM (default 5)")
    add_security_args(p, serves="api", calls="admin")
    add_log_level(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    from kvmesh.router.config import RouterConfig

    return RouterConfig(
        host=args.host, port=args.port, kv_service=args.kv_service or None, model_dir=args.model,
        model_id=args.model_id, workers=[w.strip() for w in args.workers.split(",") if w.strip()],
        policy=args.policy, block_size=args.block_size, hash_algorithm=args.hash_algorithm,
        lookup_timeout_ms=args.lookup_timeout_ms, request_timeout_s=args.request_timeout,
        first_token_timeout_s=args.first_token_timeout, max_attempts=args.max_attempts,
        decode_cost_tokens=args.decode_cost, overlap_weight=args.overlap_weight, balance_factor=args.balance_factor,
        balance_min_tokens=args.balance_min_tokens, speculative_ttl_s=args.speculative_ttl,
        max_streams=args.max_streams, max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
    )


def run(args: argparse.Namespace) -> int:
    from kvmesh.contract.block_hash import algorithm_name
    from kvmesh.router.server import RouterServer
    from kvmesh.transport.rpc import wait_for_termination_signal

    setup_logging(args.log_level)
    log = logging.getLogger("kvmesh.router")
    try:
        apply_security(args)
        algorithm_name(args.hash_algorithm)
        server = RouterServer(config_from_args(args)).start()
    except (ValueError, FileNotFoundError, OSError) as exc:
        log.error("%s", exc)
        return 2
    if args.metrics_port:
        start_metrics_server(args.metrics_port, server.metrics.registry)
    source = f"workers {args.workers}" if args.workers else f"kv_service {args.kv_service}"
    log.info("router listening on %s:%d (policy %s, %s)", args.host, server.port, args.policy, source)
    wait_for_termination_signal(server.stop, args.grace)
    return 0
