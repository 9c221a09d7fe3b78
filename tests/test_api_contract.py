"""The generated stubs match the wire contract (docs/wire-contract.md) and the committed .proto.

Pure descriptor checks: no vllm, no torch, no server. The tables below are written from the
contract by hand; a change to them is a change to the wire.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf import descriptor_pb2

from rlserve.api.rlserve.v1 import rlserve_pb2, rlserve_pb2_grpc
from rlserve.api.vllm import aliases_pb2, control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
FD = _descriptor.FieldDescriptor
STRUCT = "google.protobuf.Struct"

# message full name -> {field: (number, "[repeated |optional ]type")}; "optional" is proto3
# explicit presence. Types are scalar names, message/enum full names or "map<K, V>".
MESSAGES: dict[str, dict[str, tuple[int, str]]] = {
    "vllm.GenerateRequest": {
        "request_id": (1, "string"),
        "model": (2, "string"),
        "text": (3, "string"),
        "token_ids": (4, "vllm.TokenIds"),
        "temperature": (5, "optional float"),
        "sampling": (6, "vllm.RandomSampling"),
        "decoding": (7, "vllm.DecodingParameters"),
        "stopping": (8, "vllm.StoppingCriteria"),
        "response": (9, "vllm.ResponseOptions"),
        "kv": (10, "vllm.KVCacheParameters"),
        "truncate_prompt_tokens": (11, "uint32"),
        "priority": (12, "int32"),
        "session_id": (13, "optional string"),
        "media": (14, "repeated vllm.MediaItem"),
        "lora_name": (15, "string"),
        # Upstream's 16 (vllm-rs, vllm-router); Dynamo's vendored bytes at 16 are read as 1016.
        "watermarking": (16, "optional bool"),
        "native_sampling_params_json": (1016, "bytes"),
    },
    "vllm.TokenIds": {"ids": (1, "repeated uint32")},
    "vllm.RandomSampling": {
        "num_sequences": (1, "uint32"),
        "top_k": (2, "uint32"),
        "top_p": (3, "float"),
        "min_p": (4, "float"),
        "seed": (5, "optional int64"),
    },
    "vllm.DecodingParameters": {
        "presence_penalty": (1, "float"),
        "frequency_penalty": (2, "float"),
        "repetition_penalty": (3, "float"),
        "logit_bias": (4, "map<uint32, float>"),
        "allowed_token_ids": (5, "repeated uint32"),
        "json": (6, "string"),
        "regex": (7, "string"),
        "choice": (8, "vllm.DecodingParameters.StringChoices"),
        "grammar": (9, "string"),
        "json_object": (10, "bool"),
        "structural_tag": (11, "string"),
    },
    "vllm.DecodingParameters.StringChoices": {"choices": (1, "repeated string")},
    "vllm.StoppingCriteria": {
        "max_new_tokens": (1, "uint32"),
        "min_new_tokens": (2, "uint32"),
        "stop_token_ids": (3, "repeated uint32"),
        "stop_strings": (4, "repeated string"),
        "include_stop_strings": (5, "bool"),
        "ignore_eos": (6, "bool"),
    },
    "vllm.ResponseOptions": {
        "prompt_token_ids": (1, "bool"),
        "prompt_logprobs": (2, "bool"),
        "prompt_candidates": (3, "optional vllm.CandidateTokens"),
        "output_text": (4, "optional bool"),
        "output_token_ids": (5, "bool"),
        "output_logprobs": (6, "bool"),
        "output_candidates": (7, "optional vllm.CandidateTokens"),
        "skip_special_tokens": (8, "optional bool"),
    },
    "vllm.KVCacheParameters": {
        "bypass_prefix_cache": (1, "bool"),
        "cache_salt": (2, "string"),
        "kv_transfer_params": (3, STRUCT),
        "ec_transfer_params": (4, STRUCT),
    },
    "vllm.CandidateTokens": {
        "top_n": (1, "uint32"),
        "token_ids": (2, "vllm.TokenIds"),
        "all": (3, "bool"),
    },
    "vllm.MediaItem": {
        "modality": (1, "vllm.Modality"),
        "url": (2, "string"),
        "data_uri": (3, "string"),
        "raw_bytes": (4, "bytes"),
        "mime_type": (5, "string"),
        "uuid": (6, "string"),
    },
    "vllm.GenerateResponse": {
        "prompt_info": (1, "optional vllm.PromptInfo"),
        "outputs": (2, "vllm.SequenceOutput"),
    },
    "vllm.SequenceOutput": {
        "index": (1, "uint32"),
        "text": (2, "string"),
        "num_tokens": (3, "uint32"),
        "token_ids": (4, "repeated uint32"),
        "logprobs": (5, "repeated float"),
        "ranks": (6, "repeated uint32"),
        "candidate_tokens": (7, "repeated vllm.CandidateTokenInfo"),
        "finish_info": (8, "optional vllm.FinishInfo"),
        # rlserve's extension, numbered from 1000 per the contract.
        "weight_version_spans": (1000, "repeated rlserve.v1.WeightVersionSpan"),
        "lora_version": (1001, "string"),
    },
    "vllm.PromptInfo": {
        "num_prompt_tokens": (1, "uint32"),
        "token_ids": (2, "repeated uint32"),
        "logprobs": (3, "repeated float"),
        "ranks": (4, "repeated uint32"),
        "candidate_tokens": (5, "repeated vllm.CandidateTokenInfo"),
    },
    "vllm.FinishInfo": {
        "num_output_tokens": (1, "uint32"),
        "finish_reason": (2, "vllm.FinishInfo.FinishReason"),
        "stop_token_id": (3, "uint32"),
        "eos_token_id": (4, "uint32"),
        "stop_string": (5, "string"),
        "kv_transfer_params": (6, STRUCT),
        "ec_transfer_params": (8, STRUCT),
    },
    "vllm.CandidateTokenInfo": {"tokens": (1, "repeated vllm.CandidateTokenInfo.TokenInfo")},
    "vllm.CandidateTokenInfo.TokenInfo": {
        "id": (1, "uint32"),
        "logprob": (2, "float"),
        "rank": (3, "uint32"),
    },
    # Control.
    "vllm.GetServerInfoRequest": {},
    "vllm.ServerInfo": {
        "engine_version": (1, "string"),
        "api_version": (2, "string"),
        "instance_id": (3, "string"),
        "parallelism": (4, "vllm.ParallelismInfo"),
        "max_model_len": (5, "uint32"),
        "kv_block_size": (6, "uint32"),
        "total_kv_blocks": (7, "uint64"),
        "max_running_requests": (8, "uint64"),
        "max_batched_tokens": (9, "uint64"),
        "max_loras": (10, "uint32"),
        "rl_capabilities": (11, "vllm.RlCapabilities"),
        "effective_attention_block_size": (14, "optional uint64"),
    },
    "vllm.RlCapabilities": {
        "weight_transfer_enabled": (1, "bool"),
        "weight_transfer_backend": (2, "string"),
        "sleep_mode_enabled": (3, "bool"),
        "draft_weight_updates_enabled": (4, "bool"),
    },
    "vllm.ParallelismInfo": {
        "tensor_parallel_size": (1, "uint32"),
        "pipeline_parallel_size": (2, "uint32"),
        "data_parallel_size": (3, "uint32"),
        "data_parallel_rank": (4, "uint32"),
        "decode_context_parallel_size": (5, "uint32"),
        "world_size": (6, "uint64"),
        "data_parallel_size_local": (7, "optional uint32"),
    },
    "vllm.GetModelInfoRequest": {},
    "vllm.ModelInfo": {
        "model_id": (1, "string"),
        "served_model_name": (2, "string"),
        "served_model_aliases": (3, "repeated string"),
        "supports_text_input": (20, "bool"),
        "supports_token_ids_input": (21, "bool"),
        "supports_lora": (22, "bool"),
        "supports_multimodal": (23, "bool"),
        "reasoning_parser": (24, "string"),
        "tool_call_parser": (25, "string"),
    },
    "vllm.AbortRequest": {"request_ids": (1, "repeated string")},
    "vllm.AbortResponse": {},
    "vllm.LoraAdapter": {"lora_id": (1, "int64"), "lora_name": (2, "string"), "source_path": (3, "string")},
    "vllm.LoadLoraRequest": {"lora_name": (1, "string"), "source_path": (2, "string")},
    "vllm.LoadLoraResponse": {"adapter": (1, "vllm.LoraAdapter")},
    "vllm.UnloadLoraRequest": {"lora_name": (1, "string")},
    "vllm.UnloadLoraResponse": {"adapter": (1, "vllm.LoraAdapter")},
    "vllm.ListLorasRequest": {},
    "vllm.ListLorasResponse": {"adapters": (1, "repeated vllm.LoraAdapter")},
    "vllm.GetKvEventSourcesRequest": {},
    "vllm.GetKvEventSourcesResponse": {"sources": (1, "repeated vllm.KvEventSource")},
    "vllm.KvEventSource": {
        "transport": (1, "string"),
        "endpoint": (2, "string"),
        "topic": (3, "string"),
        "replay_endpoint": (4, "string"),
        "data_parallel_rank": (5, "optional uint32"),
        "encoding": (6, "string"),
        "schema_version": (7, "uint32"),
        "buffer_steps": (8, "uint32"),
        "hwm": (9, "uint32"),
        "max_queue_size": (10, "uint32"),
    },
    "vllm.PauseGenerationRequest": {
        "mode": (1, "vllm.PauseMode"),
        "clear_cache": (2, "optional bool"),
    },
    "vllm.PauseGenerationResponse": {},
    "vllm.ResumeGenerationRequest": {},
    "vllm.ResumeGenerationResponse": {},
    "vllm.IsPausedRequest": {},
    "vllm.IsPausedResponse": {"paused": (1, "bool")},
    "vllm.SleepRequest": {"level": (1, "optional uint32"), "mode": (2, "vllm.PauseMode")},
    "vllm.SleepResponse": {},
    "vllm.WakeUpRequest": {"tags": (1, "repeated string")},
    "vllm.WakeUpResponse": {},
    "vllm.IsSleepingRequest": {},
    "vllm.IsSleepingResponse": {"sleeping": (1, "bool")},
    "vllm.InitWeightTransferEngineRequest": {"init_info_json": (1, "bytes")},
    "vllm.InitWeightTransferEngineResponse": {},
    "vllm.StartWeightUpdateRequest": {},
    "vllm.StartWeightUpdateResponse": {},
    "vllm.StartDraftWeightUpdateRequest": {},
    "vllm.StartDraftWeightUpdateResponse": {},
    "vllm.UpdateWeightsRequest": {"update_info_json": (1, "bytes")},
    "vllm.UpdateWeightsResponse": {},
    "vllm.FinishWeightUpdateRequest": {"weight_version": (1, "optional string")},
    "vllm.FinishWeightUpdateResponse": {},
    "vllm.UpdateWeightVersionRequest": {"weight_version": (1, "string")},
    "vllm.UpdateWeightVersionResponse": {},
    "vllm.GetWeightVersionRequest": {},
    "vllm.GetWeightVersionResponse": {"weight_version": (1, "string")},
    "vllm.ShutdownRequest": {},
    "vllm.ShutdownResponse": {},
    # rlserve's own package.
    "rlserve.v1.WeightVersionSpan": {
        "weight_version": (1, "string"),
        "start": (2, "uint32"),
        "end": (3, "uint32"),
    },
}

# message -> {real (non-synthetic) oneof: fields}
ONEOFS = {
    "vllm.GenerateRequest": {"prompt": {"text", "token_ids"}},
    "vllm.DecodingParameters": {
        "structured_output": {"json", "regex", "choice", "grammar", "json_object", "structural_tag"}
    },
    "vllm.CandidateTokens": {"select": {"top_n", "token_ids", "all"}},
    "vllm.MediaItem": {"source": {"url", "data_uri", "raw_bytes"}},
    "vllm.FinishInfo": {"stop_reason": {"stop_token_id", "eos_token_id", "stop_string"}},
}

ENUMS = {
    "vllm.Modality": {
        "MODALITY_UNSPECIFIED": 0,
        "MODALITY_IMAGE": 1,
        "MODALITY_VIDEO": 2,
        "MODALITY_AUDIO": 3,
    },
    "vllm.FinishInfo.FinishReason": {"NOT_FINISHED": 0, "LENGTH": 1, "STOP": 2, "ABORTED": 3},
    "vllm.PauseMode": {"PAUSE_MODE_UNSPECIFIED": 0, "PAUSE_MODE_ABORT": 1, "PAUSE_MODE_WAIT": 2, "PAUSE_MODE_KEEP": 3},
}

RESERVED = {"vllm.FinishInfo": {7}}

_CONTROL_UNARY = [
    ("GetServerInfo", "GetServerInfoRequest", "ServerInfo"),
    ("GetModelInfo", "GetModelInfoRequest", "ModelInfo"),
    ("Abort", "AbortRequest", "AbortResponse"),
    ("LoadLora", "LoadLoraRequest", "LoadLoraResponse"),
    ("UnloadLora", "UnloadLoraRequest", "UnloadLoraResponse"),
    ("ListLoras", "ListLorasRequest", "ListLorasResponse"),
    ("GetKvEventSources", "GetKvEventSourcesRequest", "GetKvEventSourcesResponse"),
] + [
    (rpc, f"{rpc}Request", f"{rpc}Response")
    for rpc in (
        "PauseGeneration",
        "ResumeGeneration",
        "IsPaused",
        "Sleep",
        "WakeUp",
        "IsSleeping",
        "InitWeightTransferEngine",
        "StartWeightUpdate",
        "StartDraftWeightUpdate",
        "UpdateWeights",
        "FinishWeightUpdate",
        "UpdateWeightVersion",
        "GetWeightVersion",
        "Shutdown",
    )
]
# The RL part of vllm.Control, also served as vllm.RlControl (the proposed split).
_RL_CONTROL = (
    "PauseGeneration",
    "ResumeGeneration",
    "IsPaused",
    "Sleep",
    "WakeUp",
    "IsSleeping",
    "InitWeightTransferEngine",
    "StartWeightUpdate",
    "StartDraftWeightUpdate",
    "UpdateWeights",
    "FinishWeightUpdate",
    "UpdateWeightVersion",
    "GetWeightVersion",
)

# service -> {rpc: (request, response, server_streaming)}
SERVICES = {
    "vllm.Inference": {
        "Generate": ("vllm.GenerateRequest", "vllm.GenerateResponse", False),
        "GenerateStream": ("vllm.GenerateRequest", "vllm.GenerateResponse", True),
    },
    "vllm.Control": {rpc: (f"vllm.{req}", f"vllm.{resp}", False) for rpc, req, resp in _CONTROL_UNARY},
}
SERVICES["vllm.Generate"] = SERVICES["vllm.Inference"]  # the name before vLLM 0.27
SERVICES["vllm.RlControl"] = {rpc: SERVICES["vllm.Control"][rpc] for rpc in _RL_CONTROL}

FILES = [inference_pb2.DESCRIPTOR, control_pb2.DESCRIPTOR, aliases_pb2.DESCRIPTOR, rlserve_pb2.DESCRIPTOR]
_SCALARS = {
    getattr(FD, name): name[len("TYPE_") :].lower()
    for name in dir(FD)
    if name.startswith("TYPE_") and name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")
}


def _is_synthetic(field: _descriptor.FieldDescriptor) -> bool:
    oneof = field.containing_oneof
    return oneof is not None and len(oneof.fields) == 1 and oneof.name == f"_{field.name}"


def _type_spec(field: _descriptor.FieldDescriptor) -> str:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (field.message_type.fields_by_name[n] for n in ("key", "value"))
        return f"map<{_type_spec(key)}, {_type_spec(value)}>"
    if field.message_type is not None:
        base = field.message_type.full_name
    elif field.enum_type is not None:
        base = field.enum_type.full_name
    else:
        base = _SCALARS[field.type]
    if field.is_repeated:
        return f"repeated {base}"
    return f"optional {base}" if _is_synthetic(field) else base


def _all_messages() -> dict[str, _descriptor.Descriptor]:
    found: dict[str, _descriptor.Descriptor] = {}
    pending = [m for f in FILES for m in f.message_types_by_name.values()]
    while pending:
        message = pending.pop()
        if not message.GetOptions().map_entry:
            found[message.full_name] = message
            pending.extend(message.nested_types)
    return found


def _all_enums() -> dict[str, _descriptor.EnumDescriptor]:
    top = [e for f in FILES for e in f.enum_types_by_name.values()]
    nested = [e for m in _all_messages().values() for e in m.enum_types]
    return {e.full_name: e for e in top + nested}


def test_generated_stubs_match_protos() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_message_set_matches_contract() -> None:
    assert sorted(_all_messages()) == sorted(MESSAGES)


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_fields_match_contract(name: str) -> None:
    message = _all_messages()[name]
    actual = {f.name: (f.number, _type_spec(f)) for f in message.fields}
    assert actual == MESSAGES[name]
    for field in message.fields:
        is_optional = MESSAGES[name][field.name][1].startswith("optional ")
        # Scalars without `optional` must stay implicit-presence, or old clients diverge.
        if field.message_type is None and not field.is_repeated:
            in_real_oneof = field.containing_oneof is not None and not is_optional
            assert field.has_presence == (is_optional or in_real_oneof), field.name


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_oneofs_match_contract(name: str) -> None:
    message = _all_messages()[name]
    real = {o.name: {f.name for f in o.fields} for o in message.oneofs if not all(_is_synthetic(f) for f in o.fields)}
    assert real == ONEOFS.get(name, {})


def test_reserved_numbers() -> None:
    messages = _all_messages()
    for name, numbers in RESERVED.items():
        proto = descriptor_pb2.DescriptorProto()
        messages[name].CopyToProto(proto)
        reserved = {n for r in proto.reserved_range for n in range(r.start, r.end)}
        assert reserved == numbers, name
        assert not numbers & set(messages[name].fields_by_number), name


def test_enums_match_contract() -> None:
    actual = {name: {v.name: v.number for v in e.values} for name, e in _all_enums().items()}
    assert actual == ENUMS


def test_services_match_contract() -> None:
    services = {s.full_name: s for f in FILES for s in f.services_by_name.values()}
    assert sorted(services) == sorted(SERVICES)
    for name, rpcs in SERVICES.items():
        actual = {
            m.name: (m.input_type.full_name, m.output_type.full_name, m.server_streaming)
            for m in services[name].methods
        }
        assert actual == rpcs, name
        assert not any(m.client_streaming for m in services[name].methods), name


def _version(text: str) -> tuple[int, ...]:
    match = re.match(r"\d+(\.\d+)*", text)
    assert match is not None, text
    return tuple(int(part) for part in match.group(0).split("."))


@pytest.mark.parametrize("module", [inference_pb2_grpc, control_pb2_grpc, rlserve_pb2_grpc])
def test_grpcio_not_older_than_generator(module: object) -> None:
    generated = module.GRPC_GENERATED_VERSION  # type: ignore[attr-defined]
    assert _version(grpc.__version__) >= _version(generated), (grpc.__version__, generated)
