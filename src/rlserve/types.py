"""Typed domain messages crossing rlserve's package boundaries (server <-> engine).

Frozen dataclasses only; no protobuf, grpc, torch or vllm types. The server's `convert`
module builds and reads these; the engine adapter maps them onto vLLM.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class PauseMode(enum.Enum):
    """How a pause treats in-flight requests; values are vLLM's spelling."""

    KEEP = "keep"  # freeze them, continue after resume
    WAIT = "wait"  # let them finish
    ABORT = "abort"  # end them now with their partial output

    @property
    def strength(self) -> int:
        """A pause in a stronger mode applies to what a weaker one left (ABORT > WAIT > KEEP)."""
        return _PAUSE_STRENGTH[self]


_PAUSE_STRENGTH = {PauseMode.KEEP: 0, PauseMode.WAIT: 1, PauseMode.ABORT: 2}


class PausePhase(enum.Enum):
    RUNNING = 1
    PAUSING = 2  # requested; the engine is not idle yet (a WAIT pause draining)
    PAUSED = 3  # the engine is idle; new requests are held


class SleepTag(enum.Enum):
    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    SCHEDULING = "scheduling"


MEMORY_TAGS = frozenset({SleepTag.WEIGHTS, SleepTag.KV_CACHE})


class StructuredOutputKind(enum.Enum):
    JSON_SCHEMA = "json"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    JSON_OBJECT = "json_object"
    STRUCTURAL_TAG = "structural_tag"


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: StructuredOutputKind
    spec: str | tuple[str, ...] | bool


@dataclass(frozen=True, slots=True)
class CandidateSelection:
    """Which alternative tokens to report per position: the top n, given ids, or all."""

    top_n: int = 0
    token_ids: tuple[int, ...] = ()
    is_all: bool = False


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """One generation request, validated for shape; the engine validates against the model."""

    request_id: str
    model: str = ""
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    # Sampling
    temperature: float | None = None
    num_sequences: int = 1
    top_k: int = 0
    top_p: float = 0.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] = ()
    structured_output: StructuredOutput | None = None
    # Stopping
    max_new_tokens: int = 0
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    include_stop_strings: bool = False
    ignore_eos: bool = False
    # Response
    return_prompt_token_ids: bool = False
    return_prompt_logprobs: bool = False
    prompt_candidates: CandidateSelection | None = None
    return_text: bool = True
    return_token_ids: bool = False
    return_logprobs: bool = False
    output_candidates: CandidateSelection | None = None
    skip_special_tokens: bool = True
    # KV cache and scheduling
    bypass_prefix_cache: bool = False
    cache_salt: str = ""
    kv_transfer_params: Mapping[str, object] | None = None
    truncate_prompt_tokens: int = 0
    priority: int = 0
    lora_name: str = ""  # empty: the base model
    # Apply the engine's configured watermark (vLLM's SamplingParams.watermarking); None: its default.
    watermarking: bool | None = None
    native_sampling_params: Mapping[str, object] | None = None
    is_stream: bool = False


class FinishReason(enum.Enum):
    LENGTH = 1
    STOP = 2
    ABORTED = 3


@dataclass(frozen=True, slots=True)
class Finish:
    num_output_tokens: int
    reason: FinishReason
    stop_token_id: int | None = None
    eos_token_id: int | None = None
    stop_string: str | None = None
    kv_transfer_params: Mapping[str, object] | None = None


@dataclass(frozen=True, slots=True)
class TokenCandidate:
    token_id: int
    logprob: float
    rank: int


@dataclass(frozen=True, slots=True)
class WeightVersionSpan:
    """Output tokens [start, end) of a sequence were sampled by weights labelled `weight_version`."""

    weight_version: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class TokenScores:
    """Per-position logprob, rank and candidates; empty tuples when not requested."""

    logprobs: tuple[float, ...] = ()
    ranks: tuple[int, ...] = ()
    candidates: tuple[tuple[TokenCandidate, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class PromptDetails:
    num_prompt_tokens: int
    token_ids: tuple[int, ...] = ()
    scores: TokenScores = TokenScores()


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    """New output of one sequence since its previous chunk (the whole output when unary)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    scores: TokenScores = TokenScores()
    finish: Finish | None = None
    weight_version_spans: tuple[WeightVersionSpan, ...] = ()
    # With the final chunk of a request that used a LoRA adapter: that adapter's version.
    lora_version: str = ""


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    prompt: PromptDetails | None
    sequence: SequenceChunk


@dataclass(frozen=True, slots=True)
class ParallelismInfo:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    data_parallel_rank: int
    decode_context_parallel_size: int
    world_size: int
    data_parallel_size_local: int | None


@dataclass(frozen=True, slots=True)
class RlCapabilities:
    weight_transfer_enabled: bool
    weight_transfer_backend: str
    sleep_mode_enabled: bool
    draft_weight_updates_enabled: bool


@dataclass(frozen=True, slots=True)
class ServerInfo:
    engine_version: str
    api_version: str
    instance_id: str
    parallelism: ParallelismInfo
    max_model_len: int
    kv_block_size: int
    total_kv_blocks: int
    max_running_requests: int
    max_batched_tokens: int
    rl_capabilities: RlCapabilities
    max_loras: int = 0  # 0: LoRA is off
    effective_attention_block_size: int | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_id: str
    served_model_name: str
    served_model_aliases: tuple[str, ...]
    supports_text_input: bool
    supports_token_ids_input: bool
    supports_multimodal: bool
    supports_lora: bool = False
    reasoning_parser: str = ""
    tool_call_parser: str = ""


@dataclass(frozen=True, slots=True)
class KvEventSource:
    transport: str
    endpoint: str
    topic: str
    replay_endpoint: str = ""
    data_parallel_rank: int | None = None
    encoding: str = ""
    schema_version: int = 0
    buffer_steps: int = 0
    hwm: int = 0
    max_queue_size: int = 0


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A LoRA adapter loaded from disk: its engine id is unique for its content."""

    lora_id: int
    lora_name: str
    source_path: str
    digest: str = ""  # of the adapter's files when it was loaded
    version: str = ""  # the trainer's label of a pushed adapter ("" for one loaded from disk)
    owned_dir: str = ""  # a directory rlserve wrote the adapter into, removed with it


@dataclass(frozen=True, slots=True)
class FrontendStatus:
    """One frontend process: the requests it admitted in all and has open now, and how often
    frontend `index` was restarted (a new process each time)."""

    index: int
    pid: int
    num_requests: int
    num_open_requests: int
    num_restarts: int = 0


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """What one data-parallel engine reports about itself."""

    data_parallel_rank: int
    is_paused: bool
    weight_version: str


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """How busy one data-parallel engine is, as its scheduler last reported."""

    data_parallel_rank: int
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float  # 0..1 of the KV cache blocks in use
    unix_time_s: float  # when the engine reported these figures; 0: not yet


@dataclass(frozen=True, slots=True)
class ServedChecksums:
    """Digests of the weights one engine serves, per checkpoint tensor; `inconsistent` names
    tensors whose serving places (e.g. an embedding and the lm_head tied to it) disagree."""

    algorithm: str
    overall: str
    per_tensor: Mapping[str, str]
    inconsistent: tuple[str, ...] = ()
