from kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("model_id", "block_size", "dtype", "num_layers", "num_kv_heads", "head_dim", "hash_algorithm")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_algorithm: str
    def __init__(self, model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., hash_algorithm: _Optional[str] = ...) -> None: ...

class KVSource(_message.Message):
    __slots__ = ("request_id", "worker_id", "address", "layout", "block_hashes", "transports", "nixl_metadata", "ttl_ms", "first_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    address: str
    layout: KVLayout
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    transports: _containers.RepeatedScalarFieldContainer[str]
    nixl_metadata: bytes
    ttl_ms: int
    first_token: int
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., address: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., transports: _Optional[_Iterable[str]] = ..., nixl_metadata: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ..., first_token: _Optional[int] = ...) -> None: ...

class KVTransfer(_message.Message):
    __slots__ = ("do_remote_decode", "source")
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    do_remote_decode: bool
    source: KVSource
    def __init__(self, do_remote_decode: _Optional[bool] = ..., source: _Optional[_Union[KVSource, _Mapping]] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("request_id", "start_block", "layout", "worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start_block: int
    layout: KVLayout
    worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., start_block: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class KVBlockChunk(_message.Message):
    __slots__ = ("start_block", "num_blocks", "data")
    START_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start_block: int
    num_blocks: int
    data: bytes
    def __init__(self, start_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "kv_transfer", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    kv_transfer: KVTransfer
    adapter: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., kv_transfer: _Optional[_Union[KVTransfer, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "usage", "worker_id", "kv_source", "kv_transport", "kv_blocks_pulled", "kv_bytes_pulled", "kv_pull_seconds")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    worker_id: str
    kv_source: KVSource
    kv_transport: str
    kv_blocks_pulled: int
    kv_bytes_pulled: int
    kv_pull_seconds: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., worker_id: _Optional[str] = ..., kv_source: _Optional[_Union[KVSource, _Mapping]] = ..., kv_transport: _Optional[str] = ..., kv_blocks_pulled: _Optional[int] = ..., kv_bytes_pulled: _Optional[int] = ..., kv_pull_seconds: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("worker_id", "load", "model_id", "block_size", "max_model_len", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: _common_pb2.WorkerLoad
    model_id: str
    block_size: int
    max_model_len: int
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...
