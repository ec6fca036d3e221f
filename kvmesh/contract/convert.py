"""Protobuf <-> domain conversions: the one place kvmesh.v1 messages become kvmesh.contract types.

Adapters (the gRPC servers and clients of every part) call these; core code never sees protobuf.
One encoder is written by hand for speed, :class:`LookupReplies` (the kv_service's Lookup reply from
cached wire bytes); its reference is :func:`match_to_pb`.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.contract.block_hash import HASH_LEN, SHA256_128, XXH3_128
from kvmesh.contract.errors import InvalidArgument
from kvmesh.contract.index_protocol import (
    NO_PENDING,
    Pending,
    Registration,
    Reservation,
    ReservationAnswer,
    WorkerAudit,
    WorkerInfo,
    WorkerMatch,
)
from kvmesh.contract.kv_transfer import GRPC, KVLayout, KVSource
from kvmesh.contract.limits import MAX_ADAPTER_NAME_CHARS
from kvmesh.contract.types import (
    AdapterLevel,
    AdapterResidency,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FinishReason,
    KVCacheEvent,
    Load,
    SamplingParams,
    Tier,
    Usage,
)
from kvmesh.v1 import common_pb2
from kvmesh.v1 import kv_service_pb2 as kv_pb
from kvmesh.v1 import worker_pb2 as w_pb

FINISH_TO_PB: dict[FinishReason, int] = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
PB_TO_FINISH: dict[int, FinishReason] = {v: k for k, v in FINISH_TO_PB.items()}

ALGO_TO_PB: dict[str, int] = {SHA256_128: kv_pb.HASH_ALGORITHM_SHA256_128, XXH3_128: kv_pb.HASH_ALGORITHM_XXH3_128}
PB_TO_ALGO: dict[int, str] = {v: k for k, v in ALGO_TO_PB.items()}


def sampling_from_pb(m: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take their defaults; set values are checked. Raises ValueError naming the field."""
    params = SamplingParams(
        max_tokens=m.max_tokens if m.HasField("max_tokens") else None,
        temperature=m.temperature,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        top_k=m.top_k,
        seed=m.seed if m.HasField("seed") else None,
        stop_token_ids=list(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
    )
    params.validate()
    return params


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    m = common_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
        stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
    )
    return m


def usage_to_pb(u: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                            completion_tokens=u.completion_tokens)


def usage_from_pb(m: common_pb2.Usage) -> Usage:
    return Usage(m.prompt_tokens, m.cached_tokens, m.completion_tokens)


def load_to_pb(load: Load) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(
        num_running=load.num_running, num_waiting=load.num_waiting, num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks, queued_prefill_tokens=load.queued_prefill_tokens,
        busy_seconds=load.busy_s, steps_total=load.steps, prefill_tokens_total=load.prefill_tokens,
        prefill_attention_pairs_total=load.prefill_pairs, decode_tokens_total=load.decode_tokens,
        decode_context_tokens_total=load.decode_context_tokens, max_num_batched_tokens=load.max_num_batched_tokens,
        admitted_request_ids=load.admitted, reports_admissions=load.reports_admissions,
        cache_block_tokens=load.cache_block_tokens,
        host_loaded_blocks_total=load.host_loaded_blocks, host_load_seconds=load.host_load_s,
        num_cached_blocks=load.num_cached_blocks,
        adapters=[common_pb2.AdapterResidency(name=a.name, level=int(a.level), requests=a.requests)
                  for a in load.adapters],
        max_loras=load.max_loras,
        adapter_cpu_loads_total=load.adapter_cpu_loads, adapter_cpu_load_seconds=load.adapter_cpu_load_s,
        adapter_disk_loads_total=load.adapter_disk_loads, adapter_disk_load_seconds=load.adapter_disk_load_s,
        prefilling_tokens=load.prefilling_tokens,
    )


def load_from_pb(m: common_pb2.WorkerLoad) -> Load:
    return Load(m.num_running, m.num_waiting, m.num_free_blocks, m.num_total_blocks, m.queued_prefill_tokens,
                m.busy_seconds, m.steps_total, m.prefill_tokens_total, m.prefill_attention_pairs_total,
                m.decode_tokens_total, m.decode_context_tokens_total, m.max_num_batched_tokens,
                tuple(m.admitted_request_ids), m.reports_admissions, cache_block_tokens=m.cache_block_tokens,
                host_loaded_blocks=m.host_loaded_blocks_total, host_load_s=m.host_load_seconds,
                num_cached_blocks=m.num_cached_blocks, max_loras=m.max_loras,
                adapter_cpu_loads=m.adapter_cpu_loads_total, adapter_cpu_load_s=m.adapter_cpu_load_seconds,
                adapter_disk_loads=m.adapter_disk_loads_total, adapter_disk_load_s=m.adapter_disk_load_seconds,
                prefilling_tokens=m.prefilling_tokens,
                adapters=tuple(AdapterResidency(a.name, AdapterLevel(a.level or AdapterLevel.GPU), a.requests) for a in m.adapters))


def pending_to_pb(p: Pending) -> kv_pb.PendingPicks:
    return kv_pb.PendingPicks(requests=p.requests, prefill_tokens=p.prefill_tokens, blocks=p.blocks,
                              version=p.version)


def pending_from_pb(m: kv_pb.PendingPicks) -> Pending:
    return Pending(m.requests, m.prefill_tokens, m.blocks, m.version)


def algorithm_to_pb(name: str) -> int:
    return ALGO_TO_PB[name]


def algorithm_from_pb(value: int) -> str:
    """Raises InvalidArgument for an unset or unknown enum value."""
    name = PB_TO_ALGO.get(value)
    if name is None:
        what = "unset" if value == kv_pb.HASH_ALGORITHM_UNSPECIFIED else f"{value}, which is not a known algorithm"
        raise InvalidArgument(f"hash_algorithm is {what}: use HASH_ALGORITHM_SHA256_128 or HASH_ALGORITHM_XXH3_128")
    return name


# -- the index protocol (kvmesh/contract/index_protocol.py) ---------------------------------------
def registration_to_pb(r: Registration) -> kv_pb.RegisterWorkerRequest:
    return kv_pb.RegisterWorkerRequest(worker_id=r.worker_id, address=r.address, model_id=r.model_id,
                                       block_size=r.block_size, hash_algorithm=algorithm_to_pb(r.hash_algorithm),
                                       num_blocks=r.num_blocks, epoch=r.epoch, engine=r.engine,
                                       host_blocks=r.host_blocks, role=r.role)


def registration_from_pb(m: kv_pb.RegisterWorkerRequest) -> Registration:
    """Raises InvalidArgument for an unset or unknown hash algorithm (the kv_service checks the rest)."""
    return Registration(m.worker_id, m.address, m.model_id, m.block_size, algorithm_from_pb(m.hash_algorithm),
                        m.num_blocks, m.epoch, m.engine or "kvmesh", m.host_blocks, m.role or "both")


def worker_info_to_pb(info: WorkerInfo, now_ms: int) -> kv_pb.WorkerInfo:
    """``now_ms`` on the holder's clock: the wire carries the lease's remaining time, not its end."""
    r = info.registration
    return kv_pb.WorkerInfo(
        worker_id=r.worker_id, address=r.address, model_id=r.model_id, block_size=r.block_size,
        hash_algorithm=algorithm_to_pb(r.hash_algorithm), num_blocks=r.num_blocks, epoch=r.epoch,
        last_seq=info.last_seq, blocks_indexed=info.blocks_indexed, load=load_to_pb(info.load),
        lease_remaining_ms=info.lease_expiry_ms - now_ms, live=info.live(now_ms), engine=r.engine,
        pending=pending_to_pb(info.pending), host_blocks=r.host_blocks, host_blocks_indexed=info.host_blocks_indexed,
        role=r.role,
    )


def worker_info_from_pb(m: kv_pb.WorkerInfo, now_ms: int) -> WorkerInfo:
    """The lease ends ``lease_remaining_ms`` after ``now_ms`` on the receiver's clock. A hash algorithm
    this side does not know reads as ""."""
    reg = Registration(m.worker_id, m.address, m.model_id, m.block_size, PB_TO_ALGO.get(m.hash_algorithm, ""),
                       m.num_blocks, m.epoch, m.engine or "kvmesh", m.host_blocks, m.role or "both")
    return WorkerInfo(reg, m.last_seq, m.blocks_indexed, load_from_pb(m.load), now_ms + m.lease_remaining_ms,
                      pending_from_pb(m.pending) if m.HasField("pending") else NO_PENDING, m.host_blocks_indexed)


def match_from_pb(m: kv_pb.WorkerMatch) -> WorkerMatch:
    return WorkerMatch(m.worker_id, m.address, m.matched_blocks, load_from_pb(m.load), m.block_size,
                       pending_from_pb(m.pending) if m.HasField("pending") else NO_PENDING, m.pending_blocks, m.host_blocks)


def match_to_pb(m: WorkerMatch) -> kv_pb.WorkerMatch:
    """Field by field; the kv_service's Lookup replies are :class:`LookupReplies`' cached bytes of the same."""
    return kv_pb.WorkerMatch(worker_id=m.worker_id, address=m.address, matched_blocks=m.matched_blocks,
                             load=load_to_pb(m.load), block_size=m.block_size,
                             pending=pending_to_pb(m.pending) if m.pending.version else None,
                             pending_blocks=m.pending_blocks, host_blocks=m.host_blocks)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_VARINTS = [_varint(i) for i in range(1 << 14)]
"""Every varint below 2**14 (matched blocks, lengths of a worker's entry), made once."""


def varint(n: int) -> bytes:
    return _VARINTS[n] if n < len(_VARINTS) else _varint(n)


class LookupReplies:
    """Builds LookupResponses from each worker's match cached as protobuf wire bytes: the kv_service's
    Lookup reply, parse-equal to ``LookupResponse(workers=[match_to_pb(m) ...])`` (tests/contract/ checks it
    against protobuf's own encoding).

    NOTE: a reply names every live worker of the model with its load (the router prefers it to
    its last discovery poll), so with 64 workers building 64 nested messages field by field cost
    ~300 us a Lookup, more than the Redis round trip. A worker's address, block size and load
    change at most once per heartbeat: their encoding is cached per worker (checked by identity
    first: the store hands out the same Load object until its cache refresh), and a reply is the
    cached bytes plus each worker's matched_blocks (and host_blocks), parsed once into the message
    gRPC sends.
    """

    MAX_CACHED = 8192

    def __init__(self) -> None:
        self._static: dict[str, tuple[Load, str, int, bytes]] = {}

    def _entry(self, m: WorkerMatch) -> bytes:
        c = self._static.get(m.worker_id)
        if c is None or c[1] != m.address or c[2] != m.block_size or (c[0] is not m.load and c[0] != m.load):
            if len(self._static) >= self.MAX_CACHED:
                self._static.clear()  # workers that left
            c = (m.load, m.address, m.block_size, kv_pb.WorkerMatch(
                worker_id=m.worker_id, address=m.address, load=load_to_pb(m.load), block_size=m.block_size,
            ).SerializeToString())
            self._static[m.worker_id] = c
        elif c[0] is not m.load:
            self._static[m.worker_id] = (m.load, *c[1:])  # an equal load, refreshed: identity next time
        # field 3 (matched_blocks, varint): proto3 leaves a 0 out
        entry = c[3] + b"\x18" + varint(m.matched_blocks) if m.matched_blocks else c[3]
        p = m.pending
        if p.version:
            # field 6 (pending, a PendingPicks of four varints, zeros left out): changes every pick
            body = b"".join((b"\x08" + varint(p.requests) if p.requests else b"",
                             b"\x10" + varint(p.prefill_tokens) if p.prefill_tokens else b"",
                             b"\x18" + varint(p.blocks) if p.blocks else b"", b"\x20" + varint(p.version)))
            entry += b"\x32" + varint(len(body)) + body
        if m.pending_blocks:
            entry += b"\x38" + varint(m.pending_blocks)  # field 7 (pending_blocks, varint)
        if m.host_blocks:
            entry += b"\x40" + varint(m.host_blocks)  # field 8 (host_blocks, varint)
        return entry

    def response(self, matches: list[WorkerMatch], block_size: int, n: int,
                 reserved: bool = False) -> kv_pb.LookupResponse:
        parts = []
        for m in matches:
            entry = self._entry(m)
            parts += (b"\x0a", varint(len(entry)), entry)  # field 1 (workers), length-delimited
        parts += (b"\x10", varint(block_size), b"\x18", varint(n))  # fields 2 and 3, varints
        if reserved:
            parts.append(b"\x20\x01")  # field 4 (reserved, a bool): the Lookup's folded reservation was made
        return kv_pb.LookupResponse.FromString(b"".join(parts))


def reservation_to_pb(r: Reservation) -> kv_pb.ReserveRequest:
    return kv_pb.ReserveRequest(model_id=r.model_id, worker_id=r.worker_id, router_id=r.router_id,
                                request_id=r.request_id, prefill_tokens=r.prefill_tokens, blocks=r.blocks,
                                seen_version=r.seen_version, anchors=r.anchors,
                                release_worker_id=r.release_worker_id)


def reservation_from_pb(m: kv_pb.ReserveRequest) -> Reservation:
    return Reservation(m.model_id, m.worker_id, m.router_id, m.request_id, m.prefill_tokens, m.blocks,
                       m.seen_version if m.HasField("seen_version") else None, tuple(m.anchors),
                       m.release_worker_id)


def reservation_answer_to_pb(a: ReservationAnswer) -> kv_pb.ReserveResponse:
    return kv_pb.ReserveResponse(reserved=a.reserved, workers=[
        kv_pb.WorkerPending(worker_id=w, pending=pending_to_pb(p), anchored=a.anchored.get(w, 0))
        for w, p in a.pending.items()])


def reservation_answer_from_pb(m: kv_pb.ReserveResponse) -> ReservationAnswer:
    return ReservationAnswer(m.reserved, {w.worker_id: pending_from_pb(w.pending) for w in m.workers},
                             {w.worker_id: w.anchored for w in m.workers if w.anchored})


# NOTE: the device tier goes out unset (0), so a device event is byte for byte what a worker sent
# before tiers existed, and an older kv_service reads it as it always did.
_TIER_TO_PB = {Tier.DEVICE: kv_pb.KV_TIER_UNSPECIFIED, Tier.HOST: kv_pb.KV_TIER_HOST, Tier.DISK: kv_pb.KV_TIER_DISK}
_TIER_FROM_PB = {kv_pb.KV_TIER_UNSPECIFIED: Tier.DEVICE, kv_pb.KV_TIER_DEVICE: Tier.DEVICE,
                 kv_pb.KV_TIER_HOST: Tier.HOST, kv_pb.KV_TIER_DISK: Tier.DISK}


def tier_from_pb(value: int, where: str) -> Tier:
    """A KVTier on the wire (unset = device); InvalidArgument naming ``where`` for a value this
    version does not know."""
    tier = _TIER_FROM_PB.get(value)
    if tier is None:
        raise InvalidArgument(f"{where}.tier is {value}, not a KVTier this kv_service knows (device, host, disk)")
    return tier


def event_to_pb(ev: KVCacheEvent) -> kv_pb.KVEvent:
    if isinstance(ev, BlockStored):
        return kv_pb.KVEvent(stored=kv_pb.BlockStored(block_hashes=ev.block_hashes,
                                                      parent_hash=ev.parent_block_hash or b"", group_id=ev.group_id,
                                                      tier=_TIER_TO_PB[ev.tier], adapter=ev.adapter))
    if isinstance(ev, BlockRemoved):
        return kv_pb.KVEvent(removed=kv_pb.BlockRemoved(block_hashes=ev.block_hashes, group_id=ev.group_id,
                                                        tier=_TIER_TO_PB[ev.tier]))
    assert isinstance(ev, AllBlocksCleared)
    return kv_pb.KVEvent(all_cleared=kv_pb.AllBlocksCleared())


def events_from_pb(events: Iterable[kv_pb.KVEvent]) -> list[KVCacheEvent]:
    """Raises InvalidArgument naming the first event that sets no kind or an unknown tier."""
    out: list[KVCacheEvent] = []
    for i, ev in enumerate(events):
        kind = ev.WhichOneof("event")
        if kind == "stored":
            s = ev.stored
            if len(s.adapter) > MAX_ADAPTER_NAME_CHARS:
                raise InvalidArgument(f"events[{i}].stored.adapter has {len(s.adapter)} characters; at most "
                                      f"{MAX_ADAPTER_NAME_CHARS}")
            out.append(BlockStored(list(s.block_hashes), s.parent_hash or None, s.group_id,
                                   tier_from_pb(s.tier, f"events[{i}].stored"), s.adapter))
        elif kind == "removed":
            r = ev.removed
            out.append(BlockRemoved(list(r.block_hashes), r.group_id, tier_from_pb(r.tier, f"events[{i}].removed")))
        elif kind == "all_cleared":
            out.append(AllBlocksCleared())
        else:
            raise InvalidArgument(f"events[{i}] sets no event: use stored, removed or all_cleared")
    return out


_AUDIT_FIELDS = ("requests", "predicted_blocks", "cached_blocks", "predicted_hits", "cached_hits", "silent_misses",
                 "unseen_hits")


def audit_to_pb(worker_id: str, a: WorkerAudit) -> kv_pb.WorkerAudit:
    return kv_pb.WorkerAudit(worker_id=worker_id, engine=a.engine, **{f: getattr(a, f) for f in _AUDIT_FIELDS})


def audit_from_pb(m: kv_pb.WorkerAudit) -> tuple[str, WorkerAudit]:
    return m.worker_id, WorkerAudit(**{f: getattr(m, f) for f in _AUDIT_FIELDS}, engine=m.engine)


# -- prefill/decode disaggregation (kvmesh/contract/kv_transfer.py) ------------------------------------
def kv_layout_to_pb(x: KVLayout) -> w_pb.KVLayout:
    return w_pb.KVLayout(model_id=x.model_id, block_size=x.block_size, dtype=x.dtype, num_layers=x.num_layers,
                         num_kv_heads=x.num_kv_heads, head_dim=x.head_dim, hash_algorithm=x.hash_algorithm)


def kv_layout_from_pb(m: w_pb.KVLayout) -> KVLayout:
    return KVLayout(m.model_id, m.block_size, m.dtype, m.num_layers, m.num_kv_heads, m.head_dim, m.hash_algorithm)


def kv_source_to_pb(s: KVSource) -> w_pb.KVSource:
    if s.layout is None:
        raise InvalidArgument("a vLLM prefill leg's KV cannot go to a kvmesh decode worker: prefill and decode "
                              "workers of one model are both kvmesh workers or both vLLM servers")
    m = w_pb.KVSource(request_id=s.request_id, worker_id=s.worker_id, address=s.address,
                      layout=kv_layout_to_pb(s.layout), block_hashes=list(s.block_hashes),
                      transports=list(s.transports), nixl_metadata=s.nixl_metadata, ttl_ms=s.ttl_ms)
    if s.first_token is not None:
        m.first_token = s.first_token
    return m


def kv_source_from_pb(m: w_pb.KVSource) -> KVSource:
    """Raises InvalidArgument on a source a decode worker cannot use (checked before any KV moves)."""
    if not m.request_id or not m.address or not m.HasField("layout"):
        raise InvalidArgument("kv_transfer.source needs request_id, address and layout (the prefill leg's "
                              "kv_source, passed on unchanged)", param="kv_transfer")
    bad = next((i for i, h in enumerate(m.block_hashes) if len(h) != HASH_LEN), None)
    if bad is not None:
        raise InvalidArgument(f"kv_transfer.source.block_hashes[{bad}] is {len(m.block_hashes[bad])} bytes, not "
                              f"{HASH_LEN}", param="kv_transfer")
    return KVSource(m.request_id, m.worker_id, m.address, kv_layout_from_pb(m.layout), tuple(m.block_hashes),
                    tuple(m.transports) or (GRPC,), m.nixl_metadata, m.ttl_ms,
                    m.first_token if m.HasField("first_token") else None)
