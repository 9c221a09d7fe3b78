"""Protobuf <-> domain conversion for generation and server description (with
`convert_lifecycle`, the only modules that read request protos).

Shape checks that need no engine knowledge happen here (oneofs, unsupported fields, JSON);
each refusal names the field. Everything the engine must judge is left to the engine adapter.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2
from google.protobuf.unknown_fields import UnknownFieldSet

from rlserve import types
from rlserve.api.rlserve.v1 import rlserve_pb2
from rlserve.api.vllm import control_pb2, inference_pb2
from rlserve.config import RequestLimits
from rlserve.errors import InvalidRequest, LimitExceeded
from rlserve.payloads import parse_json_object

STRUCTURED_KINDS = {k.value: k for k in types.StructuredOutputKind}


def generate_params(
    req: inference_pb2.GenerateRequest, *, is_stream: bool, limits: RequestLimits
) -> types.GenerateParams:
    _refuse_unsupported(req)
    _check_limits(req, limits)
    prompt = req.WhichOneof("prompt")
    s, d, st, r, kv = req.sampling, req.decoding, req.stopping, req.response, req.kv
    return types.GenerateParams(
        request_id=req.request_id,
        model=req.model,
        prompt_text=req.text if prompt == "text" else None,
        prompt_token_ids=tuple(req.token_ids.ids) if prompt == "token_ids" else None,
        temperature=req.temperature if req.HasField("temperature") else None,
        num_sequences=s.num_sequences or 1,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None,
        presence_penalty=d.presence_penalty,
        frequency_penalty=d.frequency_penalty,
        repetition_penalty=d.repetition_penalty,
        logit_bias=dict(d.logit_bias),
        allowed_token_ids=tuple(d.allowed_token_ids),
        structured_output=_structured_output(d),
        max_new_tokens=st.max_new_tokens,
        min_new_tokens=st.min_new_tokens,
        stop_token_ids=tuple(st.stop_token_ids),
        stop_strings=tuple(st.stop_strings),
        include_stop_strings=st.include_stop_strings,
        ignore_eos=st.ignore_eos,
        return_prompt_token_ids=r.prompt_token_ids,
        return_prompt_logprobs=r.prompt_logprobs,
        prompt_candidates=_candidates(r, "prompt_candidates"),
        return_text=r.output_text if r.HasField("output_text") else True,
        return_token_ids=r.output_token_ids,
        return_logprobs=r.output_logprobs,
        output_candidates=_candidates(r, "output_candidates"),
        skip_special_tokens=r.skip_special_tokens if r.HasField("skip_special_tokens") else True,
        bypass_prefix_cache=kv.bypass_prefix_cache,
        cache_salt=kv.cache_salt,
        kv_transfer_params=_struct(kv.kv_transfer_params) if kv.HasField("kv_transfer_params") else None,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        priority=req.priority,
        lora_name=req.lora_name,
        watermarking=req.watermarking if req.HasField("watermarking") else None,
        native_sampling_params=_native_sampling_params(_native_json(req), limits),
        is_stream=is_stream,
    )


# Where Dynamo's vendored proto carries native_sampling_params_json.
LEGACY_NATIVE_FIELD = 16


def _refuse_unsupported(req: inference_pb2.GenerateRequest) -> None:
    if req.HasField("session_id"):
        raise InvalidRequest("session_id", "sessions are not supported by this server")
    if req.media:
        raise InvalidRequest("media", "multimodal input is not supported by this server")
    if req.kv.HasField("ec_transfer_params"):
        raise InvalidRequest("kv.ec_transfer_params", "encoder-cache transfer is not configured")


def _check_limits(req: inference_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Bound every string and list before anything walks it."""
    d, st = req.decoding, req.stopping
    checks: list[tuple[str, int, str, str, int]] = [
        ("request_id", utf8_len(req.request_id), "bytes", "max_id_bytes", limits.max_id_bytes),
        ("model", utf8_len(req.model), "bytes", "max_id_bytes", limits.max_id_bytes),
        ("lora_name", utf8_len(req.lora_name), "bytes", "max_id_bytes", limits.max_id_bytes),
        ("kv.cache_salt", utf8_len(req.kv.cache_salt), "bytes", "max_id_bytes", limits.max_id_bytes),
        ("text", utf8_len(req.text), "bytes", "max_prompt_text_bytes", limits.max_prompt_text_bytes),
        ("token_ids", len(req.token_ids.ids), "ids", "max_prompt_token_ids", limits.max_prompt_token_ids),
        (
            "sampling.num_sequences",
            req.sampling.num_sequences,
            "sequences",
            "max_num_sequences",
            limits.max_num_sequences,
        ),
        ("stopping.stop_strings", len(st.stop_strings), "strings", "max_stop_strings", limits.max_stop_strings),
        ("decoding.logit_bias", len(d.logit_bias), "entries", "max_logit_bias_entries", limits.max_logit_bias_entries),
        ("decoding.choice", len(d.choice.choices), "choices", "max_choices", limits.max_choices),
        (
            "kv.kv_transfer_params",
            req.kv.kv_transfer_params.ByteSize(),
            "bytes",
            "max_native_json_bytes",
            limits.max_native_json_bytes,
        ),
    ]
    for name, ids in (
        ("stopping.stop_token_ids", st.stop_token_ids),
        ("decoding.allowed_token_ids", d.allowed_token_ids),
        ("response.output_candidates.token_ids", req.response.output_candidates.token_ids.ids),
        ("response.prompt_candidates.token_ids", req.response.prompt_candidates.token_ids.ids),
    ):
        checks.append((name, len(ids), "ids", "max_token_id_list", limits.max_token_id_list))
    which = d.WhichOneof("structured_output")
    if which is not None and which != "json_object":
        spec = sum(map(utf8_len, d.choice.choices)) if which == "choice" else utf8_len(getattr(d, which))
        checks.append(
            (f"decoding.{which}", spec, "bytes", "max_structured_spec_bytes", limits.max_structured_spec_bytes)
        )
    for field, size, unit, limit_name, limit in checks:
        if size > limit:
            raise LimitExceeded(field, size, unit, limit_name, limit)
    longest = max(map(utf8_len, st.stop_strings), default=0)
    if longest > limits.max_stop_string_bytes:
        raise LimitExceeded(
            "stopping.stop_strings",
            longest,
            "bytes in one string",
            "max_stop_string_bytes",
            limits.max_stop_string_bytes,
        )


def utf8_len(text: str) -> int:
    return len(text.encode())


def _structured_output(d: inference_pb2.DecodingParameters) -> types.StructuredOutput | None:
    which = d.WhichOneof("structured_output")
    if which is None:
        return None
    kind = STRUCTURED_KINDS[which]
    if kind is types.StructuredOutputKind.CHOICE:
        if not d.choice.choices:
            raise InvalidRequest("decoding.choice", "needs at least one choice")
        return types.StructuredOutput(kind, tuple(d.choice.choices))
    if kind is types.StructuredOutputKind.JSON_OBJECT:
        if not d.json_object:
            return None
        return types.StructuredOutput(kind, True)
    spec = getattr(d, which)
    if not spec:
        raise InvalidRequest(f"decoding.{which}", "is empty")
    return types.StructuredOutput(kind, spec)


def _candidates(r: inference_pb2.ResponseOptions, name: str) -> types.CandidateSelection | None:
    if not r.HasField(name):
        return None
    c = getattr(r, name)
    which = c.WhichOneof("select")
    if which == "top_n":
        return types.CandidateSelection(top_n=c.top_n)
    if which == "token_ids":
        if not c.token_ids.ids:
            raise InvalidRequest(f"response.{name}.token_ids", "is empty")
        return types.CandidateSelection(token_ids=tuple(c.token_ids.ids))
    if which == "all" and c.all:
        return types.CandidateSelection(is_all=True)
    raise InvalidRequest(f"response.{name}", "set one of top_n, token_ids or all")


def _struct(s: struct_pb2.Struct) -> dict[str, Any]:
    return json_format.MessageToDict(s)


def _native_json(req: inference_pb2.GenerateRequest) -> bytes:
    """Field 1016, or bytes at field 16 from a client built on Dynamo's vendored proto (it has
    native_sampling_params_json there; upstream's 16 is the bool `watermarking`, so such bytes
    arrive as an unknown field of the wrong wire type)."""
    legacy = [f.data for f in UnknownFieldSet(req) if f.field_number == LEGACY_NATIVE_FIELD and f.wire_type == 2]
    if legacy and req.native_sampling_params_json:
        raise InvalidRequest("native_sampling_params_json", "given both at field 16 (Dynamo's) and at 1016")
    if len(legacy) > 1:
        raise InvalidRequest("native_sampling_params_json", "given more than once at field 16")
    return legacy[0] if legacy else req.native_sampling_params_json


def _native_sampling_params(raw: bytes, limits: RequestLimits) -> dict[str, Any] | None:
    """The JSON object (its values are type-checked by the engine adapter against vLLM's own
    schema); only the server's own limits are applied here."""
    if not raw:
        return None
    field = "native_sampling_params_json"
    native = parse_json_object(raw, field, ("max_native_json_bytes", limits.max_native_json_bytes))
    n = native.get("n")
    if isinstance(n, int) and n > limits.max_num_sequences:
        raise LimitExceeded(f"{field}.n", n, "sequences", "max_num_sequences", limits.max_num_sequences)
    return native


def generate_response(chunk: types.GenerateChunk, params: types.GenerateParams) -> inference_pb2.GenerateResponse:
    resp = inference_pb2.GenerateResponse()
    if chunk.prompt is not None:
        _fill_prompt_info(resp.prompt_info, chunk.prompt)
    seq, out = chunk.sequence, resp.outputs
    out.index = seq.index
    out.text = seq.text
    out.num_tokens = len(seq.token_ids)
    if params.return_token_ids:
        out.token_ids.extend(seq.token_ids)
    _fill_scores(out, seq.scores)
    if seq.finish is not None:
        _fill_finish(out.finish_info, seq.finish)
    for span in seq.weight_version_spans:
        out.weight_version_spans.append(
            rlserve_pb2.WeightVersionSpan(weight_version=span.weight_version, start=span.start, end=span.end)
        )
    if seq.lora_version:
        out.lora_version = seq.lora_version
    return resp


def _fill_prompt_info(info: inference_pb2.PromptInfo, prompt: types.PromptDetails) -> None:
    info.num_prompt_tokens = prompt.num_prompt_tokens
    info.token_ids.extend(prompt.token_ids)
    _fill_scores(info, prompt.scores)


def _fill_scores(msg: Any, scores: types.TokenScores) -> None:
    msg.logprobs.extend(scores.logprobs)
    msg.ranks.extend(scores.ranks)
    for position in scores.candidates:
        info = msg.candidate_tokens.add()
        for c in position:
            info.tokens.add(id=c.token_id, logprob=c.logprob, rank=c.rank)


FINISH_REASON_WIRE = {
    types.FinishReason.LENGTH: inference_pb2.FinishInfo.LENGTH,
    types.FinishReason.STOP: inference_pb2.FinishInfo.STOP,
    types.FinishReason.ABORTED: inference_pb2.FinishInfo.ABORTED,
}


def _fill_finish(info: inference_pb2.FinishInfo, finish: types.Finish) -> None:
    info.num_output_tokens = finish.num_output_tokens
    info.finish_reason = FINISH_REASON_WIRE[finish.reason]
    if finish.stop_token_id is not None:
        info.stop_token_id = finish.stop_token_id
    elif finish.stop_string is not None:
        info.stop_string = finish.stop_string
    elif finish.eos_token_id is not None:
        info.eos_token_id = finish.eos_token_id
    if finish.kv_transfer_params:
        info.kv_transfer_params.update(dict(finish.kv_transfer_params))


def server_info(info: types.ServerInfo) -> control_pb2.ServerInfo:
    p, caps = info.parallelism, info.rl_capabilities
    parallelism = control_pb2.ParallelismInfo(
        tensor_parallel_size=p.tensor_parallel_size,
        pipeline_parallel_size=p.pipeline_parallel_size,
        data_parallel_size=p.data_parallel_size,
        data_parallel_rank=p.data_parallel_rank,
        decode_context_parallel_size=p.decode_context_parallel_size,
        world_size=p.world_size,
    )
    if p.data_parallel_size_local is not None:
        parallelism.data_parallel_size_local = p.data_parallel_size_local
    return control_pb2.ServerInfo(
        engine_version=info.engine_version,
        api_version=info.api_version,
        instance_id=info.instance_id,
        parallelism=parallelism,
        max_model_len=info.max_model_len,
        kv_block_size=info.kv_block_size,
        total_kv_blocks=info.total_kv_blocks,
        max_running_requests=info.max_running_requests,
        max_batched_tokens=info.max_batched_tokens,
        max_loras=info.max_loras,
        effective_attention_block_size=info.effective_attention_block_size,
        rl_capabilities=capabilities(caps),
    )


def capabilities(caps: types.RlCapabilities) -> control_pb2.RlCapabilities:
    return control_pb2.RlCapabilities(
        weight_transfer_enabled=caps.weight_transfer_enabled,
        weight_transfer_backend=caps.weight_transfer_backend,
        sleep_mode_enabled=caps.sleep_mode_enabled,
        draft_weight_updates_enabled=caps.draft_weight_updates_enabled,
    )


def model_info(info: types.ModelInfo) -> control_pb2.ModelInfo:
    return control_pb2.ModelInfo(
        model_id=info.model_id,
        served_model_name=info.served_model_name,
        served_model_aliases=list(info.served_model_aliases),
        supports_text_input=info.supports_text_input,
        supports_token_ids_input=info.supports_token_ids_input,
        supports_lora=info.supports_lora,
        supports_multimodal=info.supports_multimodal,
        reasoning_parser=info.reasoning_parser,
        tool_call_parser=info.tool_call_parser,
    )


def kv_event_sources(sources: tuple[types.KvEventSource, ...]) -> control_pb2.GetKvEventSourcesResponse:
    resp = control_pb2.GetKvEventSourcesResponse()
    for s in sources:
        src = resp.sources.add(
            transport=s.transport,
            endpoint=s.endpoint,
            topic=s.topic,
            replay_endpoint=s.replay_endpoint,
            encoding=s.encoding,
            schema_version=s.schema_version,
            buffer_steps=s.buffer_steps,
            hwm=s.hwm,
            max_queue_size=s.max_queue_size,
        )
        if s.data_parallel_rank is not None:
            src.data_parallel_rank = s.data_parallel_rank
    return resp
