"""Prefill/decode disaggregation's shared vocabulary: worker roles, the KV layout two workers must
agree on, and the handle a prefill worker gives for the KV it holds for a decode worker.

The router, the workers, the kv_service and the simulator all speak in these; kvmesh/contract/convert.py
is the one place they become kvmesh.v1 messages (docs/architecture.md, "Prefill/decode
disaggregation"). No grpc, no redis, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.contract.errors import FailedPrecondition, InvalidArgument
from kvmesh.contract.limits import excerpt

PREFILL = "prefill"
DECODE = "decode"
BOTH = "both"
ROLES = (PREFILL, DECODE, BOTH)
"""What a worker serves: prompts only (``prefill``: it computes a prompt's KV and hands it over),
decode legs only (``decode``: it takes a prompt's KV from a prefill worker, or prefills it itself
when none is worth the transfer), or every request (``both``, the default: an aggregated worker)."""

GRPC = "grpc"
NIXL = "nixl"
TRANSPORTS = (NIXL, GRPC)
"""How block bytes travel, in the order a decode worker tries them: NIXL (the transfer library
vLLM, Dynamo and llm-d use; UCX over host memory on a CPU) where both sides loaded it, else the
gRPC stream of the prefill worker's ``PullKV``."""


def check_role(role: str) -> str:
    """The role, or ValueError naming the choices."""
    role = role or BOTH
    if role not in ROLES:
        raise InvalidArgument(f"role must be one of {', '.join(ROLES)}, got {excerpt(role)}")
    return role


def serves_prefill(role: str) -> bool:
    """Whether a worker of ``role`` takes a prefill leg (or a whole request's prefill)."""
    return (role or BOTH) in (PREFILL, BOTH)


def serves_decode(role: str) -> bool:
    """Whether a worker of ``role`` takes a decode leg (or a whole aggregated request)."""
    return (role or BOTH) in (DECODE, BOTH)


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What the bytes of one KV block mean: two workers exchange blocks only when these agree.

    A block travels as ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`` of ``dtype``,
    under its chained hash (docs/block-hashing.md): the model id and hash algorithm make the same
    hash name the same tokens on both sides.
    """

    model_id: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_algorithm: str

    @property
    def element_size(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}.get(self.dtype, 4)

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    def mismatch(self, other: KVLayout) -> str:
        """"" when blocks of ``other`` can be read as this layout's, else what differs (for an error)."""
        diffs = []
        for name in ("model_id", "hash_algorithm", "block_size", "dtype", "num_layers", "num_kv_heads", "head_dim"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                diffs.append(f"{name} {excerpt(str(b))} (here {excerpt(str(a))})")
        return ", ".join(diffs)

    def check_compatible(self, other: KVLayout) -> None:
        """Raises FailedPrecondition naming every field where ``other``'s blocks differ from this layout."""
        why = self.mismatch(other)
        if why:
            raise FailedPrecondition(f"the other worker's KV blocks do not fit this worker: {why}; "
                                     "prefill and decode workers must serve the same model with the same "
                                     "--block-size, --dtype and --hash-algorithm")


@dataclass(slots=True, frozen=True)
class KVSource:
    """Where a decode worker finds the KV a prefill worker computed for one request (vLLM's
    ``kv_transfer_params`` after a prefill leg): the prefill worker holds the blocks for it until it
    pulls them, releases them, or ``ttl_ms`` passes.

    ``block_hashes`` are the prompt's full blocks the prefill worker holds, in chain order from the
    root; a decode worker pulls only those past the prefix it already has.
    """

    request_id: str
    worker_id: str
    address: str
    """host:port of the prefill worker's gRPC server (``PullKV``, ``ReleaseKV``); a vLLM server's base URL."""
    layout: KVLayout | None
    """None for a vLLM prefill worker (its connector checks its own layouts)."""
    block_hashes: tuple[bytes, ...]
    transports: tuple[str, ...] = (GRPC,)
    """What the prefill worker offers, NIXL first when it loaded it."""
    nixl_metadata: bytes = b""
    """The prefill worker's NIXL agent metadata (its UCX address), for a decode worker that reads with NIXL."""
    ttl_ms: int = 30_000
    """How long the prefill worker holds the blocks when nobody pulls them."""
    first_token: int | None = None
    """The token the prefill leg sampled (the decode leg computes the same one itself, greedy or seeded)."""
    engine_params: str = ""
    """A vLLM prefill worker's answer: its ``kv_transfer_params`` (JSON), passed unchanged to the decode leg
    (router/workers/openai_worker.py)."""


@dataclass(slots=True)
class TransferStats:
    """One worker's transfers so far, by side and transport (its metrics, and the benchmark's figures)."""

    pulled: dict[str, int] = field(default_factory=dict)
    """Transfers this worker completed as the decode side, by transport."""
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    skipped_blocks: int = 0
    """Blocks a prefill worker offered that this worker held already (not sent)."""
    failed: dict[str, int] = field(default_factory=dict)
    """Transfers that failed here (the request then prefilled locally), by cause."""
    served_blocks: int = 0
    """Blocks this worker sent as the prefill side."""
    served_bytes: int = 0
