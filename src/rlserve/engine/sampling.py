"""Map a validated `GenerateParams` onto vLLM's `SamplingParams` and prompt.

Owns the meaning of the wire's zero defaults (0 = unset) and the vLLM spelling of each option;
anything vLLM rejects becomes `InvalidRequest` naming the field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import RepetitionDetectionParams, RequestOutputKind, StructuredOutputsParams
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from rlserve.errors import InvalidRequest, PromptTooLong
from rlserve.types import (
    CandidateSelection,
    GenerateParams,
    StructuredOutput,
    StructuredOutputKind,
)

# Texts up to this long tokenize faster than a hop to a thread and back.
INLINE_TOKENIZE_CHARS = 4096
# Upstream's default when StoppingCriteria.max_new_tokens is 0.
DEFAULT_MAX_NEW_TOKENS = 20
# Keys of native_sampling_params_json that would break the response framing if overridden,
# and vLLM's own bookkeeping, "not supposed to be used as an input" (a client-set
# `_bad_words_token_ids` out of the vocabulary killed the engine: the fuzzer found it).
NATIVE_KEYS_FRAMING = ("output_kind", "detokenize")
NATIVE_KEYS_INTERNAL = ("skip_clone", "output_text_buffer_length")


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the engine's model allows; read once from the engine config."""

    max_model_len: int
    vocab_size: int
    has_kv_connector: bool
    has_priority_scheduling: bool
    default_sampling: Mapping[str, Any]
    # vLLM's own checks of a request's sampling params against the model (SamplingParams.verify
    # with the engine's configs bound); idempotent, so the engine may run them again.
    verify: Callable[[SamplingParams], None] = lambda sampling: None


async def build_prompt_token_ids(params: GenerateParams, tokenizer: Any, limits: ModelLimits) -> list[int]:
    """Tokenize (text) or check (token ids), truncate from the left, and check the length.
    A long text is tokenized in a thread (the tokenizer releases the GIL), so one large
    prompt never stalls the event loop that serves every other call."""
    if params.prompt_text is not None:
        if not params.prompt_text:
            raise InvalidRequest("text", "the prompt is empty")
        if len(params.prompt_text) > INLINE_TOKENIZE_CHARS:
            ids = await asyncio.to_thread(tokenizer.encode, params.prompt_text)
        else:
            ids = tokenizer.encode(params.prompt_text)
    elif params.prompt_token_ids is not None:
        if not params.prompt_token_ids:
            raise InvalidRequest("token_ids", "the prompt is empty")
        ids = list(params.prompt_token_ids)
        bad = [i for i in ids if i >= limits.vocab_size] if max(ids) >= limits.vocab_size else []
        if bad:
            raise InvalidRequest("token_ids", f"ids {bad[:5]} are outside the vocabulary (size {limits.vocab_size})")
    else:
        raise InvalidRequest("prompt", "set either text or token_ids")
    if params.truncate_prompt_tokens and len(ids) > params.truncate_prompt_tokens:
        ids = ids[-params.truncate_prompt_tokens :]
    if len(ids) >= limits.max_model_len:
        raise PromptTooLong(len(ids), limits.max_model_len - 1)
    return ids


def build_sampling_params(params: GenerateParams, num_prompt_tokens: int, limits: ModelLimits) -> SamplingParams:
    """Sampling params the engine is certain to accept: every value is checked by type
    against vLLM's own schema (and round-tripped through the engine's request codec), because
    a value the engine core cannot decode kills its input thread and every later request."""
    if params.priority and not limits.has_priority_scheduling:
        raise InvalidRequest("priority", "priority scheduling is not enabled; start with --scheduling-policy priority")
    if not params.is_stream and params.num_sequences > 1:
        raise InvalidRequest("sampling.num_sequences", "Generate returns one sequence; use GenerateStream for n > 1")
    kwargs = _structured_kwargs(params, num_prompt_tokens, limits)
    field = "sampling"
    if params.native_sampling_params is not None:
        field = "native_sampling_params_json"
        kwargs.update(_native_kwargs(params.native_sampling_params))
    try:
        sampling = msgspec.convert(kwargs, SamplingParams, str_keys=True)
    except msgspec.ValidationError as e:
        raise InvalidRequest(field, str(e)) from e
    except (TypeError, ValueError, VLLMClientError) as e:
        raise InvalidRequest(field, str(e)) from e
    if not params.is_stream and sampling.n > 1:
        raise InvalidRequest(field, "n > 1 needs GenerateStream")
    try:
        limits.verify(sampling)
    except (TypeError, ValueError, VLLMClientError) as e:
        raise refused_by_vllm(e, field) from e
    _check_engine_decodes(sampling, field)
    return sampling


def refused_by_vllm(error: Exception, field: str) -> InvalidRequest:
    """What vLLM's request validation raised (its VLLMValidationError, which may name the
    parameter, or a plain ValueError / TypeError, which names it in its text), as
    InvalidRequest naming the parameter under `field`."""
    parameter = getattr(error, "parameter", None) or next(
        (name for name in _SAMPLING_FIELDS_LONGEST_FIRST if name in str(error)), None
    )
    return InvalidRequest(f"{field}.{parameter}" if parameter else field, str(error))


_ENCODER = MsgpackEncoder()
_DECODER = MsgpackDecoder(SamplingParams)


def _check_engine_decodes(sampling: SamplingParams, field: str) -> None:
    try:
        _DECODER.decode(_ENCODER.encode(sampling))
    except (msgspec.MsgspecError, OverflowError, TypeError, ValueError) as e:
        raise InvalidRequest(field, f"the engine cannot decode these sampling params: {e}") from e


def _structured_kwargs(params: GenerateParams, num_prompt_tokens: int, limits: ModelLimits) -> dict[str, Any]:
    room = limits.max_model_len - num_prompt_tokens
    max_tokens = params.max_new_tokens or min(DEFAULT_MAX_NEW_TOKENS, room)
    if max_tokens > room:
        raise InvalidRequest(
            "stopping.max_new_tokens",
            f"{max_tokens} new tokens after a {num_prompt_tokens}-token prompt exceed the "
            f"model's {limits.max_model_len}-token context",
        )
    if params.min_new_tokens > max_tokens:
        raise InvalidRequest("stopping.min_new_tokens", "is larger than max_new_tokens")
    defaults = limits.default_sampling
    kwargs: dict[str, Any] = {
        "n": params.num_sequences,
        "temperature": _pick(params.temperature, defaults.get("temperature"), 0.0),
        "top_k": params.top_k or defaults.get("top_k", 0),
        "top_p": params.top_p or defaults.get("top_p", 1.0),
        "min_p": params.min_p or defaults.get("min_p", 0.0),
        "seed": params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty or defaults.get("repetition_penalty", 1.0),
        "logit_bias": dict(params.logit_bias) or None,
        "allowed_token_ids": list(params.allowed_token_ids) or None,
        "max_tokens": max_tokens,
        "min_tokens": params.min_new_tokens,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "stop": list(params.stop_strings) or None,
        "include_stop_str_in_output": params.include_stop_strings,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": params.skip_special_tokens,
        # Text is needed to return it and to match stop strings; skipping it saves frontend CPU.
        "detokenize": params.return_text or bool(params.stop_strings),
        "output_kind": (RequestOutputKind.DELTA if params.is_stream else RequestOutputKind.FINAL_ONLY).value,
        "skip_reading_prefix_cache": True if params.bypass_prefix_cache else None,
    }
    kwargs.update(_logprob_kwargs(params))
    if params.watermarking is not None:
        kwargs["watermarking"] = params.watermarking
    if params.structured_output is not None:
        kwargs["structured_outputs"] = _structured_output(params.structured_output)
    if params.kv_transfer_params is not None:
        if not limits.has_kv_connector:
            raise InvalidRequest("kv.kv_transfer_params", "no KV connector is configured")
        kwargs["extra_args"] = {"kv_transfer_params": dict(params.kv_transfer_params)}
    return kwargs


def _pick(value: float | None, default: float | None, fallback: float) -> float:
    if value is not None:
        return value
    return fallback if default is None else default


def _logprob_kwargs(params: GenerateParams) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cand = params.output_candidates
    if cand is not None:
        out.update(_candidate_kwargs(cand, "logprobs", "logprob_token_ids"))
    elif params.return_logprobs:
        out["logprobs"] = 0
    cand = params.prompt_candidates
    if cand is not None:
        if cand.token_ids:
            raise InvalidRequest("response.prompt_candidates.token_ids", "not supported; use top_n or all")
        out.update(_candidate_kwargs(cand, "prompt_logprobs", ""))
    elif params.return_prompt_logprobs:
        out["prompt_logprobs"] = 0
    return out


def _candidate_kwargs(cand: CandidateSelection, count_key: str, ids_key: str) -> dict[str, Any]:
    if cand.is_all:
        return {count_key: -1}
    if cand.token_ids:
        # vLLM returns exactly these ids (plus the chosen one) when the counts agree.
        return {ids_key: list(cand.token_ids), count_key: len(cand.token_ids)}
    return {count_key: cand.top_n}


def _structured_output(so: StructuredOutput) -> StructuredOutputsParams:
    kind = so.kind
    if kind is StructuredOutputKind.CHOICE:
        return StructuredOutputsParams(choice=list(so.spec))  # type: ignore[arg-type]  # spec is a tuple for CHOICE
    if kind is StructuredOutputKind.JSON_OBJECT:
        return StructuredOutputsParams(json_object=True)
    if kind is StructuredOutputKind.JSON_SCHEMA:
        try:
            json.loads(so.spec)  # type: ignore[arg-type]  # spec is a str for JSON_SCHEMA
        except ValueError as e:
            raise InvalidRequest("decoding.json", f"not a JSON schema: {e}") from e
    spec: Any = so.spec  # str for every kind but CHOICE (a tuple), checked by the parser
    return StructuredOutputsParams(**{kind.value: spec})


def _native_kwargs(native: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON object's keys, checked against SamplingParams' fields (and those of its
    nested dataclasses, which msgspec would otherwise fill with defaults silently)."""
    refused = sorted(k for k in native if k in NATIVE_KEYS_FRAMING or k in NATIVE_KEYS_INTERNAL or k.startswith("_"))
    if refused:
        raise InvalidRequest("native_sampling_params_json", f"may not set {refused}: rlserve or vLLM sets them")
    unknown = sorted(set(native) - _SAMPLING_FIELDS)
    if unknown:
        raise InvalidRequest("native_sampling_params_json", f"unknown SamplingParams fields {unknown}")
    for key, cls in _NESTED_DATACLASSES.items():
        value = native.get(key)
        if isinstance(value, dict):
            extra = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if extra:
                raise InvalidRequest("native_sampling_params_json", f"{key}: unknown fields {extra}")
    return dict(native)


_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
# "logprobs" is in "prompt_logprobs": the longest name a message mentions is the one it means.
_SAMPLING_FIELDS_LONGEST_FIRST = sorted(_SAMPLING_FIELDS, key=len, reverse=True)
_NESTED_DATACLASSES = {"structured_outputs": StructuredOutputsParams, "repetition_detection": RepetitionDetectionParams}
