"""The bridge's settings; `kvmesh bridge` derives its flags from these fields (one place each)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from kvmesh.bridge.engine_load import ENGINES
from kvmesh.contract.block_hash import DEFAULT_BLOCK_SIZE, SHA256_128, algorithm_name
from kvmesh.contract.settings import flag


@dataclass(slots=True)
class BridgeConfig:
    url: str
    """The engine server's OpenAI API base URL, e.g. http://10.0.0.7:8000 (its /v1/models, /metrics
    and /health are read from it; routers send requests to it)."""
    events: str
    """The engine's KV event publisher (--kv-events-config endpoint), e.g. tcp://10.0.0.7:5557."""
    engine: str = "vllm"
    """vllm or sglang: how its events, metrics and requests are spelled."""
    role: str = flag("both", metavar="prefill|decode|both")
    """The server's role in prefill/decode disaggregation (vLLM with a KV connector, docs/vllm.md): routers send a
    prefill server prefill legs (kv_transfer_params do_remote_decode) and a decode server the decode legs."""
    replay: str | None = None
    """The engine's replay endpoint (replay_endpoint), e.g. tcp://10.0.0.7:5558; none = lost events
    cannot be recovered (the mirror is marked degraded)."""
    topic: str = ""
    """The engine's event topic (its kv-events-config topic)."""
    kv_service: str = "127.0.0.1:50052"
    """kv_service host:port."""
    model_id: str | None = None
    """The model id routers use (kvmesh's: the model directory's name, or the router's --model-id);
    none = the last path part of the engine's served model name."""
    worker_id: str | None = None
    """The worker id in the index; none = <engine>-<host>-<port> of --url."""
    advertise_url: str | None = None
    """The URL routers should send requests to; none = --url."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """kvmesh's block size for this model (the router's and the other workers'); the engine's block
    size must be a multiple of it (or divide it)."""
    hash_algorithm: str = SHA256_128
    """kvmesh's block hash algorithm for this model."""
    metrics_interval: float = 0.1
    """Seconds between scrapes of the engine's /metrics (its load, reported on the event stream)."""
    health_interval: float = 1.0
    """Seconds between checks of the engine's /health; 2 failures in a row = the engine is down
    (its lease lapses; when it answers again it is a new epoch with an empty cache)."""
    replay_timeout: float = 2.0
    """Seconds a replay request may take before its batches count as lost."""
    idle_replay_interval: float = 1.0
    """Seconds without an event batch after which the engine's replay is asked for anything missed
    (a lost last batch shows no gap until the next one); 0 = never."""
    startup_timeout: float = 0.0
    """Seconds to wait for the engine to answer at start; 0 = wait for ever (a sidecar starts
    before a slow model load finishes)."""

    def check(self) -> None:
        """Raises ValueError with a message a user can act on."""
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"--role must be prefill, decode or both, got {self.role!r}")
        u = urlsplit(self.url)
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
            raise ValueError(f"--url must be the engine's base URL, http(s)://host:port, got {self.url!r}")
        for what, ep in (("--events", self.events), ("--replay", self.replay)):
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{what} must be a ZMQ endpoint such as tcp://host:5557, got {ep!r}")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        self.hash_algorithm = algorithm_name(self.hash_algorithm)
        for what, v in (("--metrics-interval", self.metrics_interval), ("--health-interval", self.health_interval),
                        ("--replay-timeout", self.replay_timeout)):
            if not v > 0:
                raise ValueError(f"{what} must be > 0 seconds, got {v}")

    @property
    def base_url(self) -> str:
        return self.url.rstrip("/")

    @property
    def route_url(self) -> str:
        """What the index records as the worker's address."""
        return (self.advertise_url or self.url).rstrip("/")

    def default_worker_id(self) -> str:
        u = urlsplit(self.url)
        return f"{self.engine}-{u.hostname}-{u.port or (443 if u.scheme == 'https' else 80)}"
