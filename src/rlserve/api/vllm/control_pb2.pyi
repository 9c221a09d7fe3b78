from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
    PAUSE_MODE_KEEP: _ClassVar[PauseMode]
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_WAIT: PauseMode
PAUSE_MODE_KEEP: PauseMode

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("engine_version", "api_version", "instance_id", "parallelism", "max_model_len", "kv_block_size", "total_kv_blocks", "max_running_requests", "max_batched_tokens", "max_loras", "rl_capabilities", "effective_attention_block_size")
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    RL_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_ATTENTION_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    engine_version: str
    api_version: str
    instance_id: str
    parallelism: ParallelismInfo
    max_model_len: int
    kv_block_size: int
    total_kv_blocks: int
    max_running_requests: int
    max_batched_tokens: int
    max_loras: int
    rl_capabilities: RlCapabilities
    effective_attention_block_size: int
    def __init__(self, engine_version: _Optional[str] = ..., api_version: _Optional[str] = ..., instance_id: _Optional[str] = ..., parallelism: _Optional[_Union[ParallelismInfo, _Mapping]] = ..., max_model_len: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., max_batched_tokens: _Optional[int] = ..., max_loras: _Optional[int] = ..., rl_capabilities: _Optional[_Union[RlCapabilities, _Mapping]] = ..., effective_attention_block_size: _Optional[int] = ...) -> None: ...

class RlCapabilities(_message.Message):
    __slots__ = ("weight_transfer_enabled", "weight_transfer_backend", "sleep_mode_enabled", "draft_weight_updates_enabled")
    WEIGHT_TRANSFER_ENABLED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    SLEEP_MODE_ENABLED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WEIGHT_UPDATES_ENABLED_FIELD_NUMBER: _ClassVar[int]
    weight_transfer_enabled: bool
    weight_transfer_backend: str
    sleep_mode_enabled: bool
    draft_weight_updates_enabled: bool
    def __init__(self, weight_transfer_enabled: _Optional[bool] = ..., weight_transfer_backend: _Optional[str] = ..., sleep_mode_enabled: _Optional[bool] = ..., draft_weight_updates_enabled: _Optional[bool] = ...) -> None: ...

class ParallelismInfo(_message.Message):
    __slots__ = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "data_parallel_rank", "decode_context_parallel_size", "world_size", "data_parallel_size_local")
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    DECODE_CONTEXT_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_LOCAL_FIELD_NUMBER: _ClassVar[int]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    data_parallel_rank: int
    decode_context_parallel_size: int
    world_size: int
    data_parallel_size_local: int
    def __init__(self, tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., data_parallel_size: _Optional[int] = ..., data_parallel_rank: _Optional[int] = ..., decode_context_parallel_size: _Optional[int] = ..., world_size: _Optional[int] = ..., data_parallel_size_local: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "served_model_name", "served_model_aliases", "supports_text_input", "supports_token_ids_input", "supports_lora", "supports_multimodal", "reasoning_parser", "tool_call_parser")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_ALIASES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_TEXT_INPUT_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_TOKEN_IDS_INPUT_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_LORA_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_MULTIMODAL_FIELD_NUMBER: _ClassVar[int]
    REASONING_PARSER_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_PARSER_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    served_model_name: str
    served_model_aliases: _containers.RepeatedScalarFieldContainer[str]
    supports_text_input: bool
    supports_token_ids_input: bool
    supports_lora: bool
    supports_multimodal: bool
    reasoning_parser: str
    tool_call_parser: str
    def __init__(self, model_id: _Optional[str] = ..., served_model_name: _Optional[str] = ..., served_model_aliases: _Optional[_Iterable[str]] = ..., supports_text_input: _Optional[bool] = ..., supports_token_ids_input: _Optional[bool] = ..., supports_lora: _Optional[bool] = ..., supports_multimodal: _Optional[bool] = ..., reasoning_parser: _Optional[str] = ..., tool_call_parser: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("lora_id", "lora_name", "source_path")
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    lora_name: str
    source_path: str
    def __init__(self, lora_id: _Optional[int] = ..., lora_name: _Optional[str] = ..., source_path: _Optional[str] = ...) -> None: ...

class LoadLoraRequest(_message.Message):
    __slots__ = ("lora_name", "source_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    source_path: str
    def __init__(self, lora_name: _Optional[str] = ..., source_path: _Optional[str] = ...) -> None: ...

class LoadLoraResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class UnloadLoraRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class ListLorasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLorasResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class GetKvEventSourcesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetKvEventSourcesResponse(_message.Message):
    __slots__ = ("sources",)
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[KvEventSource]
    def __init__(self, sources: _Optional[_Iterable[_Union[KvEventSource, _Mapping]]] = ...) -> None: ...

class KvEventSource(_message.Message):
    __slots__ = ("transport", "endpoint", "topic", "replay_endpoint", "data_parallel_rank", "encoding", "schema_version", "buffer_steps", "hwm", "max_queue_size")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_STEPS_FIELD_NUMBER: _ClassVar[int]
    HWM_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    transport: str
    endpoint: str
    topic: str
    replay_endpoint: str
    data_parallel_rank: int
    encoding: str
    schema_version: int
    buffer_steps: int
    hwm: int
    max_queue_size: int
    def __init__(self, transport: _Optional[str] = ..., endpoint: _Optional[str] = ..., topic: _Optional[str] = ..., replay_endpoint: _Optional[str] = ..., data_parallel_rank: _Optional[int] = ..., encoding: _Optional[str] = ..., schema_version: _Optional[int] = ..., buffer_steps: _Optional[int] = ..., hwm: _Optional[int] = ..., max_queue_size: _Optional[int] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode", "clear_cache")
    MODE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_CACHE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    clear_cache: bool
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ..., clear_cache: _Optional[bool] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsPausedRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsPausedResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level", "mode")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    level: int
    mode: PauseMode
    def __init__(self, level: _Optional[int] = ..., mode: _Optional[_Union[PauseMode, str]] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingResponse(_message.Message):
    __slots__ = ("sleeping",)
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    sleeping: bool
    def __init__(self, sleeping: _Optional[bool] = ...) -> None: ...

class InitWeightTransferEngineRequest(_message.Message):
    __slots__ = ("init_info_json",)
    INIT_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    init_info_json: bytes
    def __init__(self, init_info_json: _Optional[bytes] = ...) -> None: ...

class InitWeightTransferEngineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartWeightUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartWeightUpdateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartDraftWeightUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartDraftWeightUpdateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("update_info_json",)
    UPDATE_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    update_info_json: bytes
    def __init__(self, update_info_json: _Optional[bytes] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishWeightUpdateRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    def __init__(self, weight_version: _Optional[str] = ...) -> None: ...

class FinishWeightUpdateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeightVersionRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    def __init__(self, weight_version: _Optional[str] = ...) -> None: ...

class UpdateWeightVersionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWeightVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWeightVersionResponse(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    def __init__(self, weight_version: _Optional[str] = ...) -> None: ...
