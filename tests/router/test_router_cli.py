"""`kvmesh router` flags: defaults match DESIGN.md and the config they build."""

from __future__ import annotations

from kvmesh.cli import build_parser
from kvmesh.commands.router import config_from_args


def test_defaults_and_static_workers():
    cfg = config_from_args(build_parser("router").parse_args(["router"]))
    r = cfg.routing
    assert (cfg.port, cfg.kv_service, r.policy, cfg.block_size, cfg.hash_algorithm, r.lookup_timeout_ms,
            r.request_timeout_s, r.speculative_ttl_s, cfg.workers) == (
        50051, "127.0.0.1:50052", "kv-aware", 16, "sha256_128", 250.0, 600.0, 2.0, [])
    args = build_parser("router").parse_args(
        ["router", "--kv-service", "", "--workers", "a:1, b:2", "--policy", "prefix-hash"])
    cfg = config_from_args(args)
    assert (cfg.kv_service, cfg.workers, cfg.routing.policy, args.metrics_port) == (
        None, ["a:1", "b:2"], "prefix-hash", 9101)
    cfg.check()
