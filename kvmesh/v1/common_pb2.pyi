from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_LEVEL_UNSPECIFIED: _ClassVar[AdapterLevel]
    ADAPTER_LEVEL_GPU: _ClassVar[AdapterLevel]
    ADAPTER_LEVEL_CPU: _ClassVar[AdapterLevel]
    ADAPTER_LEVEL_DISK: _ClassVar[AdapterLevel]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
ADAPTER_LEVEL_UNSPECIFIED: AdapterLevel
ADAPTER_LEVEL_GPU: AdapterLevel
ADAPTER_LEVEL_CPU: AdapterLevel
ADAPTER_LEVEL_DISK: AdapterLevel
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORT: FinishReason

class WorkerLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "queued_prefill_tokens", "busy_seconds", "steps_total", "prefill_tokens_total", "prefill_attention_pairs_total", "decode_tokens_total", "decode_context_tokens_total", "max_num_batched_tokens", "admitted_request_ids", "reports_admissions", "cache_block_tokens", "host_loaded_blocks_total", "host_load_seconds", "num_cached_blocks", "adapters", "max_loras", "adapter_cpu_loads_total", "adapter_cpu_load_seconds", "adapter_disk_loads_total", "adapter_disk_load_seconds", "prefilling_tokens")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ATTENTION_PAIRS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_CONTEXT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_LOADED_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CPU_LOADS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CPU_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DISK_LOADS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DISK_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILLING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    queued_prefill_tokens: int
    busy_seconds: float
    steps_total: int
    prefill_tokens_total: int
    prefill_attention_pairs_total: int
    decode_tokens_total: int
    decode_context_tokens_total: int
    max_num_batched_tokens: int
    admitted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    reports_admissions: bool
    cache_block_tokens: int
    host_loaded_blocks_total: int
    host_load_seconds: float
    num_cached_blocks: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterResidency]
    max_loras: int
    adapter_cpu_loads_total: int
    adapter_cpu_load_seconds: float
    adapter_disk_loads_total: int
    adapter_disk_load_seconds: float
    prefilling_tokens: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., steps_total: _Optional[int] = ..., prefill_tokens_total: _Optional[int] = ..., prefill_attention_pairs_total: _Optional[int] = ..., decode_tokens_total: _Optional[int] = ..., decode_context_tokens_total: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., admitted_request_ids: _Optional[_Iterable[str]] = ..., reports_admissions: _Optional[bool] = ..., cache_block_tokens: _Optional[int] = ..., host_loaded_blocks_total: _Optional[int] = ..., host_load_seconds: _Optional[float] = ..., num_cached_blocks: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterResidency, _Mapping]]] = ..., max_loras: _Optional[int] = ..., adapter_cpu_loads_total: _Optional[int] = ..., adapter_cpu_load_seconds: _Optional[float] = ..., adapter_disk_loads_total: _Optional[int] = ..., adapter_disk_load_seconds: _Optional[float] = ..., prefilling_tokens: _Optional[int] = ...) -> None: ...

class AdapterResidency(_message.Message):
    __slots__ = ("name", "level", "requests")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    level: AdapterLevel
    requests: int
    def __init__(self, name: _Optional[str] = ..., level: _Optional[_Union[AdapterLevel, str]] = ..., requests: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...
