"""The domain types every part shares: what a request asks for, what a worker reports, block events.

Plain dataclasses, no grpc and no redis: kvmesh/contract/convert.py is the one place they become
protobuf messages and back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal
from urllib.parse import quote, unquote

from kvmesh.contract.errors import InvalidArgument
from kvmesh.contract.limits import MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID, excerpt

DEFAULT_MAX_TOKENS = 16
"""max_tokens of a request that sets none (fewer when the prompt leaves less room)."""

FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite 32-bit float: temperature travels as one (common.proto)."""

FinishReason = Literal["stop", "length", "abort"]
"""Why a request ended: a stop condition, max_tokens / max_model_len, or cancelled."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = None
    """Tokens to generate at most, >= 1; None = 16, or fewer when the prompt leaves less room in
    max_model_len (a value set explicitly must fit: the engine refuses it otherwise)."""
    temperature: float = 0.0
    """0 = greedy; >= 0."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = all."""
    seed: int | None = None
    """Makes sampling reproducible per request."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Sampling one of these finishes the request (the id is kept in the output)."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS token."""

    def validate(self) -> None:
        """Raises InvalidArgument (a ValueError) naming the field, with a message a user can act on.

        Every bound is the range of the field's protobuf type (common.proto), so a value that passes
        always reaches the worker as sent: ``max_tokens`` uint32, ``top_k`` int32, ``seed`` uint64,
        ``temperature``/``top_p`` 32-bit floats; stop token ids are token ids (< 2**31, hashed as
        int32), at most MAX_STOP_TOKEN_IDS of them.
        """
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens < 2**32):
            raise InvalidArgument(f"max_tokens must be an integer in [1, 2**32) (leave it unset for the default), "
                                  f"got {excerpt(self.max_tokens)}", param="max_tokens")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= FLOAT32_MAX):
            raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy) and at most {FLOAT32_MAX:.4g} "
                                  f"(a 32-bit float), got {excerpt(self.temperature)}", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1] (leave it unset for 1), got {excerpt(self.top_p)}",
                                  param="top_p")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise InvalidArgument(f"top_k must be an integer in [0, 2**31) (0 disables it), got {excerpt(self.top_k)}",
                                  param="top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise InvalidArgument(f"seed must be an integer in [0, 2**64), got {excerpt(self.seed)}", param="seed")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}",
                                  param="stop_token_ids")
        for i, t in enumerate(self.stop_token_ids):
            if not isinstance(t, int) or not 0 <= t < MAX_TOKEN_ID:
                raise InvalidArgument(f"stop_token_ids must be non-negative integers below 2**31 (token ids), "
                                      f"got stop_token_ids[{i}] = {excerpt(t)}", param="stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True, frozen=True)
class Usage:
    """Token counts of one finished request."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the worker's prefix cache."""
    completion_tokens: int = 0


class AdapterLevel(IntEnum):
    """Where a LoRA adapter's weights are (kvmesh.v1.AdapterLevel; unset on the wire = GPU)."""

    GPU = 1
    """In one of the worker's GPU slots (--max-loras): a request of it runs without a load."""
    CPU = 2
    """In CPU memory (--max-cpu-loras): copied into a slot before a request of it runs."""
    DISK = 3
    """Servable, its weights on disk only: read and copied into a slot before a request of it runs."""


@dataclass(slots=True, frozen=True)
class AdapterResidency:
    """One LoRA adapter a worker serves, idle or not, and where its weights are (docs/adapters.md)."""

    name: str
    level: AdapterLevel = AdapterLevel.GPU
    requests: int = 0
    """Its requests running or waiting on the worker."""


@dataclass(slots=True, frozen=True)
class Load:
    """A worker's load as it reports it (heartbeat, GetLoad) and the router sees it.

    The first five fields are the worker's state now. The counters after them are cumulative since
    the worker started: what its steps computed and how long they took. A router learns the
    worker's step-time coefficients from their deltas between two reports (router/core/policies/cost.py). A worker
    that does not report them (an older one) leaves them 0.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    queued_prefill_tokens: int = 0
    busy_s: float = 0.0
    """Seconds spent running steps (modelled seconds on a simulated worker)."""
    steps: int = 0
    """Forward passes run."""
    prefill_tokens: int = 0
    """Prompt (and recomputed) tokens computed."""
    prefill_pairs: int = 0
    """Attention pairs of prefill: sum over chunks of new * (context before + (new + 1) / 2)."""
    decode_tokens: int = 0
    """Decode sequence-steps (one per sequence per forward pass)."""
    decode_context_tokens: int = 0
    """Context tokens read by those decodes."""
    max_num_batched_tokens: int = 0
    """The worker's token budget per step (0 = not reported)."""
    admitted: tuple[str, ...] = ()
    """Ids of the requests the worker admitted since its last acknowledged report: their picks are
    in this report's counts, so the kv_service retires them from the routers' shared view
    (docs/router.md, "Several routers"). Consumed where the report lands; never stored."""
    reports_admissions: bool = False
    """The worker lists its admissions (a kvmesh worker). Without it (a bridged engine) a report
    covers the picks made ``--pending-grace-ms`` or more before it arrived."""
    cache_block_tokens: int = 0
    """Tokens in one of the engine's own KV blocks when it reuses a prefix in coarser steps than the
    index's blocks (a bridged vLLM's 32 over kvmesh's 16); 0 = the index's block size. The miss audit
    (router/core/audit.py) caps a prediction at what such an engine can reuse."""
    host_loaded_blocks: int = 0
    """Blocks loaded back from the host KV tier (host -> device), cumulative."""
    host_load_s: float = 0.0
    """Seconds those loads took (modelled seconds on a simulated worker), cumulative; part of
    ``busy_s``. A router learns the worker's seconds per loaded block from the two
    (router/core/policies/cost.py)."""
    num_cached_blocks: int = 0
    """Device blocks holding a cached prefix, in use or idle (a bridged engine's: the blocks its
    mirror holds). ``num_total_blocks`` less these is what a new prefix fills without evicting one:
    the KV a router may treat as free (router/core/policies/prefix_load.py)."""
    adapters: tuple[AdapterResidency, ...] = ()
    """The LoRA adapters the worker serves, idle ones included: in a GPU slot, in CPU memory or on disk."""
    max_loras: int = 0
    """The worker's GPU adapter slots (0 = it serves no adapter)."""
    adapter_cpu_loads: int = 0
    """Adapters copied into a GPU slot from CPU memory, cumulative."""
    adapter_cpu_load_s: float = 0.0
    """Seconds those copies took, cumulative (part of ``busy_s``)."""
    adapter_disk_loads: int = 0
    """Adapters read from disk into a GPU slot, cumulative."""
    adapter_disk_load_s: float = 0.0
    """Seconds those took, cumulative (part of ``busy_s``): a router learns each kind's cost from the deltas."""
    prefilling_tokens: int = 0
    """Uncached prompt tokens of the requests in the scheduler without a token yet, each counted whole until its
    first token (``queued_prefill_tokens`` counts only the part still to compute): what one router counts of its
    own requests in flight, summed over every router's (docs/router.md, "Several routers"). Requests the engine
    has not taken from its inbox yet are not in it (their cache hit is not known yet: ``queued_prefill_tokens``
    counts them whole). 0 = not reported."""

    def adapter(self, name: str) -> AdapterResidency | None:
        """Where the worker holds LoRA adapter ``name``; None: it does not serve it."""
        return next((a for a in self.adapters if a.name == name), None)

    def queue_state(self) -> tuple[int, int, int, int]:
        """What routing reads of the worker's state: (running, waiting, queued prefill tokens, prefilling
        tokens); a change of it is worth a load report of its own (kvmesh/kv_client/publisher.py)."""
        return self.num_running, self.num_waiting, self.queued_prefill_tokens, self.prefilling_tokens

    def encode(self) -> str:
        # NOTE: comma-separated, in the order of _ENCODED, the trailing fields left out while they hold
        # their defaults: a worker without the newer fields stores what it stored before them, and
        # decode() reads the strings of older workers (the first five fields only) too.
        values = [getattr(self, name) for name, _ in _ENCODED]
        n = len(values)
        while n > _ALWAYS_ENCODED and not values[n - 1]:
            n -= 1
        raw = ",".join(repr(v) if isinstance(v, float) else str(v) for v in values[:n])
        if self.adapters:
            # NOTE: after a '/', one "name:level:requests" per adapter, ';'-separated, the names quoted (the
            # Redis store keeps a load between '|'s)
            raw += "/" + ";".join(f"{quote(a.name, safe='')}:{int(a.level)}:{a.requests}" for a in self.adapters)
        return raw

    @classmethod
    def decode(cls, raw: str | bytes | None) -> Load:
        if not raw:
            return cls()
        if isinstance(raw, bytes):
            raw = raw.decode()
        raw, _, listed = raw.partition("/")
        fields = {name: kind(x) for (name, kind), x in zip(_ENCODED, raw.split(","), strict=False)}
        if listed:
            fields["adapters"] = tuple(_adapter(a) for a in listed.split(";"))
        return cls(**fields)


def _adapter(raw: str) -> AdapterResidency:
    name, level, requests = raw.rsplit(":", 2)
    return AdapterResidency(unquote(name), AdapterLevel(int(level)), int(requests))


_ENCODED: tuple[tuple[str, type], ...] = (
    ("num_running", int), ("num_waiting", int), ("num_free_blocks", int), ("num_total_blocks", int),
    ("queued_prefill_tokens", int), ("busy_s", float), ("steps", int), ("prefill_tokens", int),
    ("prefill_pairs", int), ("decode_tokens", int), ("decode_context_tokens", int),
    ("max_num_batched_tokens", int), ("cache_block_tokens", int), ("host_loaded_blocks", int),
    ("host_load_s", float), ("num_cached_blocks", int), ("max_loras", int), ("adapter_cpu_loads", int),
    ("adapter_cpu_load_s", float), ("adapter_disk_loads", int), ("adapter_disk_load_s", float),
    ("prefilling_tokens", int))
"""The fields :meth:`Load.encode` writes, in order (the kv_service's stored form)."""
_ALWAYS_ENCODED = 12
"""Fields every stored load has (those before the miss audit's and the host tier's)."""


H100_8B_KV_BLOCKS = 27_648
"""KV blocks of 16 tokens of an H100-80GB serving Llama-3-8B in bf16: 128 KiB of KV per token
(2 x 32 layers x 8 KV heads x 128 x 2 B), 0.9 x 80 GB minus 16 GB weights and ~3 GB activations
= ~54 GiB = 442,368 tokens. The simulated worker's pool, and the router's guess of a worker's
capacity when its load does not report one."""


@dataclass(slots=True, frozen=True)
class TraceContext:
    """A W3C trace context as it travels between processes (HTTP headers, gRPC metadata): the one type a
    request's trace context has from the front door to the worker (kvmesh/transport/tracing.py reads and
    writes it)."""

    traceparent: str
    tracestate: str = ""

    def headers(self) -> list[tuple[str, str]]:
        """As header / metadata pairs (``tracestate`` only when set)."""
        return [("traceparent", self.traceparent), *((("tracestate", self.tracestate),) if self.tracestate else ())]


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """What makes block hashes of one model comparable: its id, block size and hash algorithm."""

    model_id: str
    block_size: int
    hash_algorithm: str


# Block lifecycle events (1:1 with kvmesh.v1.KVEvent). Replayed in order into one set per tier, a
# worker's events give exactly the hashes it holds in each tier. Two device blocks may hold the
# same hash (the pool does not de-duplicate): each is announced by a BlockStored, and the hash is
# removed only when its last block is evicted. A block moving between tiers is two events: evicted
# from the device to host memory = BlockRemoved(DEVICE) + BlockStored(HOST); loaded back =
# BlockStored(DEVICE) (the host copy stays until the host tier evicts it: BlockRemoved(HOST)).


class Tier(IntEnum):
    """Where a worker holds a block (kvmesh.v1.KVTier; unset on the wire = DEVICE)."""

    DEVICE = 0
    """Accelerator memory: the KV cache the model attends over (on a CPU worker, its KV pool)."""
    HOST = 1
    """Host memory: blocks evicted from the device, loaded back instead of recomputed."""
    DISK = 2
    """Local disk or storage (engines behind the bridge: vLLM's "STORAGE", SGLang's "DISK")."""


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[bytes]
    """Newly cached full blocks, in chain order (device); in eviction order (host, disk)."""
    parent_block_hash: bytes | None = None
    """Hash of the block before the first one here; None when the chain starts at the root, and
    always None off the device (blocks reach the host tier one by one, not as chains)."""
    group_id: int = 0
    """KV cache group (hybrid allocators); 0 for full attention."""
    tier: Tier = Tier.DEVICE
    """The tier that now holds them."""
    adapter: str = ""
    """The LoRA adapter they were computed under ("" = the base model); its name already keys their hashes."""


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    """Hashes this worker no longer holds in ``tier``."""
    group_id: int = 0
    """KV cache group (hybrid allocators); 0 for full attention."""
    tier: Tier = Tier.DEVICE
    """The tier that no longer holds them."""


@dataclass(slots=True)
class AllBlocksCleared:
    """The worker dropped its whole prefix cache, every tier."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
