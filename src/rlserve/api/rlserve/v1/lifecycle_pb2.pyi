from rlserve.api.vllm import control_pb2 as _control_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PausePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_PHASE_UNSPECIFIED: _ClassVar[PausePhase]
    PAUSE_PHASE_RUNNING: _ClassVar[PausePhase]
    PAUSE_PHASE_PAUSING: _ClassVar[PausePhase]
    PAUSE_PHASE_PAUSED: _ClassVar[PausePhase]
PAUSE_PHASE_UNSPECIFIED: PausePhase
PAUSE_PHASE_RUNNING: PausePhase
PAUSE_PHASE_PAUSING: PausePhase
PAUSE_PHASE_PAUSED: PausePhase

class StartLoraUpdateRequest(_message.Message):
    __slots__ = ("lora_name", "version", "adapter_config_json", "new_version")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    version: str
    adapter_config_json: bytes
    new_version: bool
    def __init__(self, lora_name: _Optional[str] = ..., version: _Optional[str] = ..., adapter_config_json: _Optional[bytes] = ..., new_version: _Optional[bool] = ...) -> None: ...

class StartLoraUpdateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishLoraUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishLoraUpdateResponse(_message.Message):
    __slots__ = ("adapter", "version")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    adapter: _control_pb2.LoraAdapter
    version: str
    def __init__(self, adapter: _Optional[_Union[_control_pb2.LoraAdapter, _Mapping]] = ..., version: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("data_parallel_rank", "num_running_requests", "num_waiting_requests", "kv_cache_usage", "unix_time_s")
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_S_FIELD_NUMBER: _ClassVar[int]
    data_parallel_rank: int
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    unix_time_s: float
    def __init__(self, data_parallel_rank: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., unix_time_s: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("engines", "num_held_requests", "num_outstanding_requests")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineLoad]
    num_held_requests: int
    num_outstanding_requests: int
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineLoad, _Mapping]]] = ..., num_held_requests: _Optional[int] = ..., num_outstanding_requests: _Optional[int] = ...) -> None: ...

class StageWeightUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageWeightUpdateResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: WeightUpdateSession
    def __init__(self, session: _Optional[_Union[WeightUpdateSession, _Mapping]] = ...) -> None: ...

class PrepareWeightUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrepareWeightUpdateResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: WeightUpdateSession
    def __init__(self, session: _Optional[_Union[WeightUpdateSession, _Mapping]] = ...) -> None: ...

class AbortWeightUpdateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortWeightUpdateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWeightChecksumRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WeightChecksum(_message.Message):
    __slots__ = ("algorithm", "overall", "per_tensor", "inconsistent_tensors")
    class PerTensorEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    OVERALL_FIELD_NUMBER: _ClassVar[int]
    PER_TENSOR_FIELD_NUMBER: _ClassVar[int]
    INCONSISTENT_TENSORS_FIELD_NUMBER: _ClassVar[int]
    algorithm: str
    overall: str
    per_tensor: _containers.ScalarMap[str, str]
    inconsistent_tensors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, algorithm: _Optional[str] = ..., overall: _Optional[str] = ..., per_tensor: _Optional[_Mapping[str, str]] = ..., inconsistent_tensors: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightUpdateSession(_message.Message):
    __slots__ = ("session_id", "is_draft", "num_chunks", "num_tensors", "num_bytes", "started_unix_s", "lora_name", "prepared", "staged", "shadow_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IS_DRAFT_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    SHADOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    is_draft: bool
    num_chunks: int
    num_tensors: int
    num_bytes: int
    started_unix_s: float
    lora_name: str
    prepared: bool
    staged: bool
    shadow_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., is_draft: _Optional[bool] = ..., num_chunks: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., started_unix_s: _Optional[float] = ..., lora_name: _Optional[str] = ..., prepared: _Optional[bool] = ..., staged: _Optional[bool] = ..., shadow_bytes: _Optional[int] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineState(_message.Message):
    __slots__ = ("data_parallel_rank", "paused", "weight_version")
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    data_parallel_rank: int
    paused: bool
    weight_version: str
    def __init__(self, data_parallel_rank: _Optional[int] = ..., paused: _Optional[bool] = ..., weight_version: _Optional[str] = ...) -> None: ...

class Frontend(_message.Message):
    __slots__ = ("index", "pid", "num_requests", "num_open_requests", "num_restarts")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_OPEN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    pid: int
    num_requests: int
    num_open_requests: int
    num_restarts: int
    def __init__(self, index: _Optional[int] = ..., pid: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_open_requests: _Optional[int] = ..., num_restarts: _Optional[int] = ...) -> None: ...

class AuditEntry(_message.Message):
    __slots__ = ("sequence", "operation", "detail", "outcome", "unix_time_s", "caller")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_S_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    operation: str
    detail: str
    outcome: str
    unix_time_s: float
    caller: str
    def __init__(self, sequence: _Optional[int] = ..., operation: _Optional[str] = ..., detail: _Optional[str] = ..., outcome: _Optional[str] = ..., unix_time_s: _Optional[float] = ..., caller: _Optional[str] = ...) -> None: ...

class LifecycleState(_message.Message):
    __slots__ = ("revision", "pause_phase", "pause_mode", "asleep", "sleep_level", "weights_consistent", "inconsistency_reason", "weight_version", "num_held_requests", "engines", "capabilities", "recent_mutations", "transport_ready", "update_session", "transport_initializing", "insecure_control", "weight_dtype", "stages_updates", "frontends", "num_frontends", "staged_weight_updates", "logprobs_mode", "weight_bytes")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    PAUSE_PHASE_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MODE_FIELD_NUMBER: _ClassVar[int]
    ASLEEP_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CONSISTENT_FIELD_NUMBER: _ClassVar[int]
    INCONSISTENCY_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    RECENT_MUTATIONS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_READY_FIELD_NUMBER: _ClassVar[int]
    UPDATE_SESSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_INITIALIZING_FIELD_NUMBER: _ClassVar[int]
    INSECURE_CONTROL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    STAGES_UPDATES_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    STAGED_WEIGHT_UPDATES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    revision: int
    pause_phase: PausePhase
    pause_mode: _control_pb2.PauseMode
    asleep: _containers.RepeatedScalarFieldContainer[str]
    sleep_level: int
    weights_consistent: bool
    inconsistency_reason: str
    weight_version: str
    num_held_requests: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineState]
    capabilities: _control_pb2.RlCapabilities
    recent_mutations: _containers.RepeatedCompositeFieldContainer[AuditEntry]
    transport_ready: bool
    update_session: WeightUpdateSession
    transport_initializing: bool
    insecure_control: bool
    weight_dtype: str
    stages_updates: bool
    frontends: _containers.RepeatedCompositeFieldContainer[Frontend]
    num_frontends: int
    staged_weight_updates: bool
    logprobs_mode: str
    weight_bytes: int
    def __init__(self, revision: _Optional[int] = ..., pause_phase: _Optional[_Union[PausePhase, str]] = ..., pause_mode: _Optional[_Union[_control_pb2.PauseMode, str]] = ..., asleep: _Optional[_Iterable[str]] = ..., sleep_level: _Optional[int] = ..., weights_consistent: _Optional[bool] = ..., inconsistency_reason: _Optional[str] = ..., weight_version: _Optional[str] = ..., num_held_requests: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineState, _Mapping]]] = ..., capabilities: _Optional[_Union[_control_pb2.RlCapabilities, _Mapping]] = ..., recent_mutations: _Optional[_Iterable[_Union[AuditEntry, _Mapping]]] = ..., transport_ready: _Optional[bool] = ..., update_session: _Optional[_Union[WeightUpdateSession, _Mapping]] = ..., transport_initializing: _Optional[bool] = ..., insecure_control: _Optional[bool] = ..., weight_dtype: _Optional[str] = ..., stages_updates: _Optional[bool] = ..., frontends: _Optional[_Iterable[_Union[Frontend, _Mapping]]] = ..., num_frontends: _Optional[int] = ..., staged_weight_updates: _Optional[bool] = ..., logprobs_mode: _Optional[str] = ..., weight_bytes: _Optional[int] = ...) -> None: ...

class UpdateWeightVersionRequest(_message.Message):
    __slots__ = ("weight_version", "expected_weight_version")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    expected_weight_version: str
    def __init__(self, weight_version: _Optional[str] = ..., expected_weight_version: _Optional[str] = ...) -> None: ...

class UpdateWeightVersionResponse(_message.Message):
    __slots__ = ("previous_weight_version",)
    PREVIOUS_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    previous_weight_version: str
    def __init__(self, previous_weight_version: _Optional[str] = ...) -> None: ...
