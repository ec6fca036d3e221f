"""The router's one config type (flags of `kvmesh router`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.contract.block_hash import DEFAULT_BLOCK_SIZE, SHA256_128


@dataclass(slots=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    """Public gRPC port; 0 picks a free one (tests)."""
    kv_service: str | None = "127.0.0.1:50052"
    """host:port of the kv_service; None = no index (static workers, rendezvous routing)."""
    model_dir: str | None = None
    """Checkpoint dir whose tokenizer.json tokenizes text prompts; None = token ids only."""
    model_id: str | None = None
    """Model identity in block hashes; default: from model_dir, else the one model kv_service knows."""
    workers: list[str] = field(default_factory=list)
    """Static worker addresses (host:port); empty = discover them from kv_service."""
    policy: str = "kv-aware"
    block_size: int = DEFAULT_BLOCK_SIZE
    """Used when neither kv_service nor the workers say (they always do when reachable)."""
    hash_algorithm: str = SHA256_128
    """Used when kv_service does not say (static workers do not report it)."""
    lookup_timeout_ms: float = 50.0
    """Deadline of one Lookup; past it the request routes by rendezvous hash."""
    index_retry_s: float = 1.0
    """After a failed Lookup, skip the index this long (no 50 ms wait per request while it is down)."""
    request_timeout_s: float = 600.0
    """Deadline of a forwarded Generate (the client's deadline wins when shorter)."""
    first_token_timeout_s: float = 60.0
    """A worker that sends no token for this long is abandoned and the request retried elsewhere
    (0 = off)."""
    max_attempts: int = 3
    """Workers tried before the first token (1 = no retry)."""
    decode_cost_tokens: int = 32
    overlap_weight: float = 1.0
    balance_factor: float = 2.0
    balance_min_tokens: int = 2048
    fallback_prefix_blocks: int = 4
    speculative_ttl_s: float = 2.0
    discovery_interval_s: float = 1.0
    """ListWorkers / GetLoad poll period."""
    unhealthy_s: float = 5.0
    """A worker that failed a call is skipped this long (unless every worker is)."""
    rpc_timeout_s: float = 2.0
    """Deadline of discovery calls (ListWorkers, GetLoad)."""
    max_streams: int = 1024
    """Concurrent Generate streams; more are refused with RESOURCE_EXHAUSTED naming --max-streams
    (health checks are never refused)."""
    max_prompt_tokens: int = 0
    """Longer prompts are refused with RESOURCE_EXHAUSTED; 0 = no limit (the worker's max_model_len still applies)."""
    max_tokens_limit: int = 0
    """Requests asking for more max_tokens are refused with RESOURCE_EXHAUSTED; 0 = no limit."""
    seed: int | None = None
    """Seeds the policy's tie-break RNG (tests)."""

    def check(self) -> None:
        """Raises ValueError with the flag to fix."""
        if not self.kv_service and not self.workers:
            raise ValueError("give --kv-service HOST:PORT or --workers HOST:PORT,...: the router needs workers")
        if self.lookup_timeout_ms <= 0 or self.request_timeout_s <= 0:
            raise ValueError("--lookup-timeout-ms and --request-timeout must be > 0")
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be >= 1, got {self.max_attempts}")
        if not self.overlap_weight >= 0:
            raise ValueError(f"--overlap-weight must be >= 0, got {self.overlap_weight}")
        if self.balance_factor < 1.0:
            raise ValueError(f"--balance-factor must be >= 1.0, got {self.balance_factor}")
        if self.max_streams < 1 or self.max_prompt_tokens < 0 or self.max_tokens_limit < 0:
            raise ValueError("--max-streams must be >= 1; --max-prompt-tokens / --max-tokens-limit >= 0")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
