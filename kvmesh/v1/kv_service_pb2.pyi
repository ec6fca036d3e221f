from kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LeaveReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEAVE_REASON_UNSPECIFIED: _ClassVar[LeaveReason]
    LEAVE_REASON_DRAINING: _ClassVar[LeaveReason]
    LEAVE_REASON_UNREACHABLE: _ClassVar[LeaveReason]

class HashAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HASH_ALGORITHM_UNSPECIFIED: _ClassVar[HashAlgorithm]
    HASH_ALGORITHM_SHA256_128: _ClassVar[HashAlgorithm]
    HASH_ALGORITHM_XXH3_128: _ClassVar[HashAlgorithm]

class KVTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KVTier]
    KV_TIER_DEVICE: _ClassVar[KVTier]
    KV_TIER_HOST: _ClassVar[KVTier]
    KV_TIER_DISK: _ClassVar[KVTier]

class PublishAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUBLISH_ACTION_UNSPECIFIED: _ClassVar[PublishAction]
    PUBLISH_ACTION_ACK: _ClassVar[PublishAction]
    PUBLISH_ACTION_RESYNC: _ClassVar[PublishAction]
LEAVE_REASON_UNSPECIFIED: LeaveReason
LEAVE_REASON_DRAINING: LeaveReason
LEAVE_REASON_UNREACHABLE: LeaveReason
HASH_ALGORITHM_UNSPECIFIED: HashAlgorithm
HASH_ALGORITHM_SHA256_128: HashAlgorithm
HASH_ALGORITHM_XXH3_128: HashAlgorithm
KV_TIER_UNSPECIFIED: KVTier
KV_TIER_DEVICE: KVTier
KV_TIER_HOST: KVTier
KV_TIER_DISK: KVTier
PUBLISH_ACTION_UNSPECIFIED: PublishAction
PUBLISH_ACTION_ACK: PublishAction
PUBLISH_ACTION_RESYNC: PublishAction

class LeaveWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "reason", "reporter")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    reason: LeaveReason
    reporter: str
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[_Union[LeaveReason, str]] = ..., reporter: _Optional[str] = ...) -> None: ...

class LeaveWorkerResponse(_message.Message):
    __slots__ = ("left",)
    LEFT_FIELD_NUMBER: _ClassVar[int]
    left: bool
    def __init__(self, left: _Optional[bool] = ...) -> None: ...

class WatchWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "model_id", "block_size", "hash_algorithm", "num_blocks", "epoch", "extra_keys", "engine", "host_blocks", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    model_id: str
    block_size: int
    hash_algorithm: HashAlgorithm
    num_blocks: int
    epoch: int
    extra_keys: str
    engine: str
    host_blocks: int
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_algorithm: _Optional[_Union[HashAlgorithm, str]] = ..., num_blocks: _Optional[int] = ..., epoch: _Optional[int] = ..., extra_keys: _Optional[str] = ..., engine: _Optional[str] = ..., host_blocks: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("lease_ttl_ms", "next_seq")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    next_seq: int
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., next_seq: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load", "epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: _common_pb2.WorkerLoad
    epoch: int
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., epoch: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ttl_ms", "resync")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    resync: bool
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., resync: _Optional[bool] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("parent_hash", "block_hashes", "group_id", "tier", "adapter")
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    parent_hash: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    group_id: int
    tier: KVTier
    adapter: str
    def __init__(self, parent_hash: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., group_id: _Optional[int] = ..., tier: _Optional[_Union[KVTier, str]] = ..., adapter: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "group_id", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    group_id: int
    tier: KVTier
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., group_id: _Optional[int] = ..., tier: _Optional[_Union[KVTier, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "all_cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    all_cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class PublishEventsRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "seq", "events", "snapshot", "snapshot_hashes", "load", "snapshot_host_hashes", "stream_bound")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_HASHES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_HOST_HASHES_FIELD_NUMBER: _ClassVar[int]
    STREAM_BOUND_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    snapshot: bool
    snapshot_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    load: _common_pb2.WorkerLoad
    snapshot_host_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    stream_bound: bool
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ..., snapshot_hashes: _Optional[_Iterable[bytes]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., snapshot_host_hashes: _Optional[_Iterable[bytes]] = ..., stream_bound: _Optional[bool] = ...) -> None: ...

class PublishEventsResponse(_message.Message):
    __slots__ = ("seq", "action", "reason")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    action: PublishAction
    reason: str
    def __init__(self, seq: _Optional[int] = ..., action: _Optional[_Union[PublishAction, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model_id", "block_hashes", "reserve")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    reserve: ReserveRequest
    def __init__(self, model_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., reserve: _Optional[_Union[ReserveRequest, _Mapping]] = ...) -> None: ...

class WorkerMatch(_message.Message):
    __slots__ = ("worker_id", "address", "matched_blocks", "load", "block_size", "pending", "pending_blocks", "host_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    PENDING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    matched_blocks: int
    load: _common_pb2.WorkerLoad
    block_size: int
    pending: PendingPicks
    pending_blocks: int
    host_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., block_size: _Optional[int] = ..., pending: _Optional[_Union[PendingPicks, _Mapping]] = ..., pending_blocks: _Optional[int] = ..., host_blocks: _Optional[int] = ...) -> None: ...

class PendingPicks(_message.Message):
    __slots__ = ("requests", "prefill_tokens", "blocks", "version")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    requests: int
    prefill_tokens: int
    blocks: int
    version: int
    def __init__(self, requests: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("model_id", "worker_id", "router_id", "request_id", "prefill_tokens", "blocks", "seen_version", "anchors", "release_worker_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEEN_VERSION_FIELD_NUMBER: _ClassVar[int]
    ANCHORS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    worker_id: str
    router_id: str
    request_id: str
    prefill_tokens: int
    blocks: int
    seen_version: int
    anchors: _containers.RepeatedScalarFieldContainer[bytes]
    release_worker_id: str
    def __init__(self, model_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., router_id: _Optional[str] = ..., request_id: _Optional[str] = ..., prefill_tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., seen_version: _Optional[int] = ..., anchors: _Optional[_Iterable[bytes]] = ..., release_worker_id: _Optional[str] = ...) -> None: ...

class WorkerPending(_message.Message):
    __slots__ = ("worker_id", "pending", "anchored")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    ANCHORED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pending: PendingPicks
    anchored: int
    def __init__(self, worker_id: _Optional[str] = ..., pending: _Optional[_Union[PendingPicks, _Mapping]] = ..., anchored: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reserved", "workers")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    reserved: bool
    workers: _containers.RepeatedCompositeFieldContainer[WorkerPending]
    def __init__(self, reserved: _Optional[bool] = ..., workers: _Optional[_Iterable[_Union[WorkerPending, _Mapping]]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("workers", "block_size", "num_blocks_queried", "reserved")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_QUERIED_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerMatch]
    block_size: int
    num_blocks_queried: int
    reserved: bool
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerMatch, _Mapping]]] = ..., block_size: _Optional[int] = ..., num_blocks_queried: _Optional[int] = ..., reserved: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelStats(_message.Message):
    __slots__ = ("model_id", "block_size", "hash_algorithm", "live_workers")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    block_size: int
    hash_algorithm: HashAlgorithm
    live_workers: int
    def __init__(self, model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_algorithm: _Optional[_Union[HashAlgorithm, str]] = ..., live_workers: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("live_workers", "indexed_blocks", "block_replicas", "store", "models", "lookups_total", "events_applied_total", "resyncs_total", "host_indexed_blocks", "host_block_replicas")
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    live_workers: int
    indexed_blocks: int
    block_replicas: int
    store: str
    models: _containers.RepeatedCompositeFieldContainer[ModelStats]
    lookups_total: int
    events_applied_total: int
    resyncs_total: int
    host_indexed_blocks: int
    host_block_replicas: int
    def __init__(self, live_workers: _Optional[int] = ..., indexed_blocks: _Optional[int] = ..., block_replicas: _Optional[int] = ..., store: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelStats, _Mapping]]] = ..., lookups_total: _Optional[int] = ..., events_applied_total: _Optional[int] = ..., resyncs_total: _Optional[int] = ..., host_indexed_blocks: _Optional[int] = ..., host_block_replicas: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("include_expired",)
    INCLUDE_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    include_expired: bool
    def __init__(self, include_expired: _Optional[bool] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "model_id", "block_size", "hash_algorithm", "num_blocks", "epoch", "last_seq", "blocks_indexed", "load", "lease_remaining_ms", "live", "engine", "pending", "host_blocks", "host_blocks_indexed", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_INDEXED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_INDEXED_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    model_id: str
    block_size: int
    hash_algorithm: HashAlgorithm
    num_blocks: int
    epoch: int
    last_seq: int
    blocks_indexed: int
    load: _common_pb2.WorkerLoad
    lease_remaining_ms: int
    live: bool
    engine: str
    pending: PendingPicks
    host_blocks: int
    host_blocks_indexed: int
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_algorithm: _Optional[_Union[HashAlgorithm, str]] = ..., num_blocks: _Optional[int] = ..., epoch: _Optional[int] = ..., last_seq: _Optional[int] = ..., blocks_indexed: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., lease_remaining_ms: _Optional[int] = ..., live: _Optional[bool] = ..., engine: _Optional[str] = ..., pending: _Optional[_Union[PendingPicks, _Mapping]] = ..., host_blocks: _Optional[int] = ..., host_blocks_indexed: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class GetBlockRequest(_message.Message):
    __slots__ = ("block_hash",)
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    def __init__(self, block_hash: _Optional[bytes] = ...) -> None: ...

class GetBlockResponse(_message.Message):
    __slots__ = ("block_hash", "holders", "refcount", "host_holders")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_FIELD_NUMBER: _ClassVar[int]
    HOST_HOLDERS_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    holders: _containers.RepeatedScalarFieldContainer[str]
    refcount: int
    host_holders: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_hash: _Optional[bytes] = ..., holders: _Optional[_Iterable[str]] = ..., refcount: _Optional[int] = ..., host_holders: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupTokensRequest(_message.Message):
    __slots__ = ("model_id", "token_ids", "cache_salt")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, model_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class FlushWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class FlushWorkerResponse(_message.Message):
    __slots__ = ("blocks_removed",)
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    blocks_removed: int
    def __init__(self, blocks_removed: _Optional[int] = ...) -> None: ...

class WorkerAudit(_message.Message):
    __slots__ = ("worker_id", "requests", "predicted_blocks", "cached_blocks", "predicted_hits", "cached_hits", "silent_misses", "unseen_hits", "engine")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHED_HITS_FIELD_NUMBER: _ClassVar[int]
    SILENT_MISSES_FIELD_NUMBER: _ClassVar[int]
    UNSEEN_HITS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    requests: int
    predicted_blocks: int
    cached_blocks: int
    predicted_hits: int
    cached_hits: int
    silent_misses: int
    unseen_hits: int
    engine: str
    def __init__(self, worker_id: _Optional[str] = ..., requests: _Optional[int] = ..., predicted_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., predicted_hits: _Optional[int] = ..., cached_hits: _Optional[int] = ..., silent_misses: _Optional[int] = ..., unseen_hits: _Optional[int] = ..., engine: _Optional[str] = ...) -> None: ...

class ReportAuditRequest(_message.Message):
    __slots__ = ("router_id", "workers")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerAudit]
    def __init__(self, router_id: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerAudit, _Mapping]]] = ...) -> None: ...

class ReportAuditResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetAuditRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetAuditResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerAudit]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerAudit, _Mapping]]] = ...) -> None: ...
