"""The router's config (flags of `kvmesh router`), and its routing settings: the group the live router and
the simulator's routers share (`kvmesh simulate` takes the same flags).

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.contract.block_hash import DEFAULT_BLOCK_SIZE, SHA256_128
from kvmesh.contract.settings import flag
from kvmesh.router.core.pd import PDConfig
from kvmesh.router.core.policies.base import Objectives, PolicyConfig


@dataclass(slots=True)
class RoutingConfig:
    """How a router picks and retries: one declaration for the live router and the simulator."""

    policy: str = "kv-aware"
    """Routing policy (docs/router.md)."""
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    """The policies' knobs (a group: its fields are the flags)."""
    lookup_timeout_ms: float = 250.0
    """Deadline of one kv_service Lookup or Reserve; past it the request routes without the index (a kv_service
    that answered nothing meanwhile is skipped for --index-retry)."""
    index_retry_s: float = flag(1.0, name="index-retry")
    """Seconds to skip the index after a failed Lookup (no Lookup deadline per request while it is down)."""
    speculative_ttl_s: float = flag(2.0, name="speculative-ttl")
    """Seconds a routed prompt's blocks count as held by its worker before the index says so; 0 = off."""
    shared_view: bool = True
    """Routers share their picks through the kv_service: each pick is reserved before forwarding and every
    router's next Lookup sees it until the worker's report covers it (kv-aware only; docs/router.md, "Several
    routers")."""
    fold_reserve: bool = False
    """The Lookup carries the pick this router would make from its own view, reserved in the same call: when the
    answer confirms that pick, no Reserve round trip follows. Off by default: in the simulator it makes bursts of
    one prefix pile onto its first holder (docs/router.md, "The hop in bare hops")."""
    reservation_attempts: int = flag(10, old_names=("claim-attempts",))
    """Reservations per request at most: a refused one (another router reserved the worker since this router's
    Lookup) is picked again; the last is unconditional."""
    max_attempts: int = 3
    """Workers tried before the first token (1 = no retry)."""
    migration_limit: int = 3
    """Times one stream is continued on another worker after its worker failed mid-stream (it died, or its drain
    outlasted its grace), from the prompt plus the tokens already sent; 0 = a failure mid-stream ends the stream
    (Dynamo's --migration-limit, whose default is 0)."""
    migration_max_seq_len: int = 0
    """Prompt plus completion tokens past which a stream's tokens are no longer kept for a migration (its cut then
    ends it); 0 = no bound but the model's."""
    first_token_timeout_s: float = flag(60.0, name="first-token-timeout")
    """Seconds without a token after which a worker is abandoned and the request retried elsewhere; 0 = off."""
    request_timeout_s: float = flag(600.0, name="request-timeout")
    """Deadline in seconds of a forwarded Generate (the client's deadline wins when shorter)."""
    unhealthy_s: float = flag(5.0, name="unhealthy-time")
    """Seconds a worker that failed a call is skipped (unless every worker is)."""
    discovery_interval_s: float = flag(1.0, name="discovery-interval")
    """Seconds between ListWorkers / GetLoad polls."""
    pd: PDConfig = field(default_factory=PDConfig)
    """Prefill/decode disaggregation: the decision whether a prefill worker takes a prompt (a group)."""

    def check(self) -> None:
        """Raises ValueError with the flag to fix."""
        if self.lookup_timeout_ms <= 0 or self.request_timeout_s <= 0:
            raise ValueError("--lookup-timeout-ms and --request-timeout must be > 0")
        if self.migration_limit < 0 or self.migration_max_seq_len < 0:
            raise ValueError("--migration-limit and --migration-max-seq-len must be >= 0")
        if self.max_attempts < 1 or self.reservation_attempts < 1:
            raise ValueError(f"--max-attempts and --reservation-attempts must be >= 1, got {self.max_attempts}, "
                             f"{self.reservation_attempts}")
        if self.speculative_ttl_s < 0 or self.index_retry_s < 0 or self.unhealthy_s < 0:
            raise ValueError("--speculative-ttl, --index-retry and --unhealthy-time must be >= 0")
        if not self.discovery_interval_s > 0:
            raise ValueError(f"--discovery-interval must be > 0, got {self.discovery_interval_s}")
        self.policy_config.check()
        self.pd.check()


@dataclass(slots=True)
class RouterConfig:
    host: str = "0.0.0.0"
    """Listen address."""
    port: int = 50051
    """Public gRPC port; 0 picks a free one (tests)."""
    http_port: int | None = None
    """Port of the OpenAI-compatible HTTP API (docs/openai.md) on the same host; 0 picks a free one; none = off."""
    kv_service: str | None = flag("127.0.0.1:50052", metavar="HOST:PORT")
    """The kv_service to look prefixes up in and discover workers from; none = no index (needs --workers)."""
    model_dirs: list[str] = flag(default_factory=list, name="model", metavar="DIR,...")
    """Model dirs (comma-separated) whose tokenizer.json and chat template serve text and chat requests; the first
    is the default model. Models without one here serve token ids only."""
    model_id: str | None = None
    """Model identity in block hashes of the first --model (default: its directory's name); without --model, a
    model served before any worker of it registers."""
    workers: list[str] = flag(default_factory=list, metavar="HOST:PORT,...")
    """Static worker addresses instead of discovery from kv_service."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """How requests are routed (a group: its fields are the flags)."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per block when no worker reports it yet (they always do when reachable)."""
    hash_algorithm: str = SHA256_128
    """Block hash when kv_service does not report it (static workers do not)."""
    rpc_timeout_s: float = flag(2.0, name="rpc-timeout")
    """Deadline in seconds of discovery calls (ListWorkers, GetLoad)."""
    max_streams: int = 1024
    """Concurrent Generate streams; more are refused with RESOURCE_EXHAUSTED naming this flag (health checks
    are never refused)."""
    max_prompt_tokens: int | None = None
    """Longer prompts are refused with RESOURCE_EXHAUSTED; default: the model's context length minus one (from
    --model's config.json, or the static workers' max_model_len; INVALID_ARGUMENT past it); 0 = no router limit."""
    max_prompt_bytes: int | None = None
    """Text prompts longer than this many UTF-8 bytes are refused with RESOURCE_EXHAUSTED before tokenizing;
    default: 32 per token of the prompt-token bound; 0 = no limit."""
    max_tokens_limit: int = 0
    """Requests asking for more max_tokens are refused with RESOURCE_EXHAUSTED; 0 = no limit."""
    tokenizer_threads: int = 0
    """Threads of each model's tokenizer pool (long texts and conversations, long chains' hashes); 0 = one per
    core this process may use, at least 2."""
    prompt_cache_bytes: int = 128 * 1024 * 1024
    """Bytes of each model's cache of tokenized prefixes (a text sharing a cached prefix is tokenized from where it
    parts, with the same ids as a whole tokenization: docs/router.md "Long prompts"); 0 = off."""
    max_messages: int = 4096
    """Messages in one chat request; more are refused (400 over HTTP, RESOURCE_EXHAUSTED over gRPC) as soon as
    the one past the limit arrives, before any other work on the request."""
    max_content_parts: int = 4096
    """Content parts in one chat request (all its messages together); more are refused like --max-messages."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request in bytes: an OpenAI HTTP body (a larger declared Content-Length gets 413 before the body
    is read, a longer chunked body 413 where it passes the limit) or a gRPC request message (RESOURCE_EXHAUSTED
    before it is decoded)."""
    http_header_timeout_s: float = flag(10.0, name="http-header-timeout")
    """Seconds an HTTP connection has to send its request line and headers (from its opening, or from the first
    byte of the next request on a kept-alive connection); past it: 408 and the connection closed. 0 = none."""
    http_body_timeout_s: float = flag(30.0, name="http-body-timeout")
    """Seconds an HTTP request has to send its body after its headers; past it: 408 and the connection closed.
    0 = none."""
    http_max_unfinished: int = 256
    """HTTP connections one client address may hold whose request has been arriving for over a second; a new
    connection past it gets 429 and is closed (slow clients cannot hold every socket)."""
    audit_window: int = 64
    """Miss audit: requests per worker a mismatch rate is taken over (docs/router.md, "Miss audit")."""
    audit_miss_rate: float = 0.25
    """Miss audit: a warning when this share of a worker's last --audit-window requests found at least one block
    fewer (silent misses) or more (unseen hits) cached than the index said; 0 = no warning."""
    http_keep_alive_s: float = flag(30.0, name="http-keep-alive")
    """Seconds an idle HTTP keep-alive connection stays open between requests."""
    http_linger_bytes: int = 64 * 1024 * 1024
    """After an HTTP answer given before the request's body was read (401, 413, 415, a 400 of the streaming
    parser), the rest of the body is read and dropped up to this many bytes, then the connection closes: clients
    that send their whole body before reading (urllib, requests, many SDKs) get the answer, not a reset."""
    http_linger_time_s: float = flag(10.0, name="http-linger-time")
    """Seconds the rest of an early-answered request's body is read and dropped at most (--http-linger-bytes);
    0 = close at once."""
    slo_ttft_ms: float = 0.0
    """Time-to-first-token objective of a request that names none (x-slo-ttft-ms, slo_ttft_ms); 0 = none
    (docs/router.md, "Latency objectives")."""
    slo_tpot_ms: float = 0.0
    """Time-per-output-token objective of a request that names none (x-slo-tpot-ms, slo_tpot_ms); 0 = none."""
    slo_refuse: bool = False
    """Refuse a request with objectives that the policy predicts no worker can meet (429 / RESOURCE_EXHAUSTED)
    instead of serving it late."""
    allow_runtime_lora_updating: bool = False
    """Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): each
    loads or unloads a LoRA adapter on every live worker of its base model (docs/adapters.md)."""

    def default_objectives(self) -> Objectives:
        """--slo-ttft-ms and --slo-tpot-ms, in seconds."""
        return Objectives(self.slo_ttft_ms / 1000, self.slo_tpot_ms / 1000)

    def check(self) -> None:
        """Raises ValueError with the flag to fix."""
        if not self.kv_service and not self.workers:
            raise ValueError("give --kv-service HOST:PORT or --workers HOST:PORT,...: the router needs workers")
        if any(w.startswith(("http://", "https://")) for w in self.workers):
            raise ValueError("--workers lists kvmesh workers (host:port); a vLLM or SGLang server joins through "
                             "its bridge (`kvmesh bridge`) and the kv_service (docs/vllm.md)")
        self.routing.check()
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must be in [0, 65535] (0 = a free port), got {self.http_port}")
        if (self.max_streams < 1 or (self.max_prompt_tokens or 0) < 0 or (self.max_prompt_bytes or 0) < 0
                or self.max_tokens_limit < 0):
            raise ValueError("--max-streams must be >= 1; --max-prompt-tokens / --max-prompt-bytes / "
                             "--max-tokens-limit >= 0")
        if self.tokenizer_threads < 0 or self.prompt_cache_bytes < 0:
            raise ValueError("--tokenizer-threads and --prompt-cache-bytes must be >= 0 (0 = per core / off)")
        if self.max_messages < 1 or self.max_content_parts < 1 or self.max_body_bytes < 1:
            raise ValueError("--max-messages, --max-content-parts and --max-body-bytes must be >= 1")
        if self.http_linger_bytes < 0 or not self.http_linger_time_s >= 0:
            raise ValueError("--http-linger-bytes and --http-linger-time must be >= 0")
        if (not self.http_header_timeout_s >= 0 or not self.http_body_timeout_s >= 0 or self.http_max_unfinished < 1
                or not self.http_keep_alive_s > 0):
            raise ValueError("--http-header-timeout and --http-body-timeout must be >= 0 (0 = none), "
                             "--http-max-unfinished >= 1 and --http-keep-alive > 0")
        if self.audit_window < 1 or not 0 <= self.audit_miss_rate <= 1:
            raise ValueError(f"--audit-window must be >= 1 and --audit-miss-rate in [0, 1], got {self.audit_window}, "
                             f"{self.audit_miss_rate}")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if not 0 <= self.slo_ttft_ms <= 3_600_000 or not 0 <= self.slo_tpot_ms <= 3_600_000:
            raise ValueError(f"--slo-ttft-ms and --slo-tpot-ms must be in [0, 3600000] (0 = none), got "
                             f"{self.slo_ttft_ms:g}, {self.slo_tpot_ms:g}")


EPP_BODY_MODES = ("full-duplex", "buffered")


@dataclass(slots=True)
class EppConfig:
    """The endpoint picker's own flags (`kvmesh epp`, docs/epp.md); the routing ones are RouterConfig's."""

    port: int = 9002
    """The ext_proc gRPC port the gateway calls (the InferencePool's endpointPickerRef port; grpc health on the
    same port); 0 picks a free one (tests)."""
    fallbacks: int = 2
    """Endpoints listed after the pick, in the order a retry would try them (the policy's next picks); the
    gateway goes down the list when one fails."""
    target_port: int | None = None
    """The port the gateway sends requests to on a picked pod (the InferencePool's target port): replaces the port
    of each worker's registered address; none = the address's own (a vLLM or SGLang server's behind its bridge)."""
    destination_header: str = "x-gateway-destination-endpoint"
    """The request header (and dynamic metadata key) that names the picked endpoints."""
    metadata_namespace: str = "envoy.lb"
    """The dynamic metadata namespace of the pick (and of the served endpoint on the response path)."""
    subset_namespace: str = "envoy.lb.subset_hint"
    """The filter metadata namespace of the gateway's subset hint (x-gateway-destination-endpoint-subset)."""
    request_body_mode: str = "full-duplex"
    """How the gateway sends bodies when its messages do not say (ext_proc's protocol_config): full-duplex
    (FULL_DUPLEX_STREAMED, the protocol's) answers the headers with the pick once the body is read; buffered
    (BUFFERED) lets the headers through and puts the pick in the body's answer."""

    def check(self) -> None:
        """Raises ValueError with the flag to fix."""
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535] (0 = a free port), got {self.port}")
        if self.fallbacks < 0:
            raise ValueError(f"--fallbacks must be >= 0, got {self.fallbacks}")
        if self.target_port is not None and not 0 < self.target_port < 65536:
            raise ValueError(f"--target-port must be in [1, 65535], got {self.target_port}")
        if self.request_body_mode not in EPP_BODY_MODES:
            raise ValueError(f"--request-body-mode must be one of {', '.join(EPP_BODY_MODES)}, "
                             f"got {self.request_body_mode!r}")
        if not self.destination_header or not self.metadata_namespace:
            raise ValueError("--destination-header and --metadata-namespace must not be empty")
