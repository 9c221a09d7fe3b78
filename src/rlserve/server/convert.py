"""Protobuf <-> domain conversion for every RPC: the only module that reads request protos.

Shape checks that need no engine knowledge happen here (oneofs, unsupported fields, JSON);
each refusal names the field. Everything the engine must judge is left to the engine adapter.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2
from google.protobuf.unknown_fields import UnknownFieldSet

from rlserve import types
from rlserve.api.rlserve.v1 import lifecycle_pb2, rlserve_pb2
from rlserve.api.vllm import control_pb2, inference_pb2
from rlserve.config import RequestLimits
from rlserve.errors import InvalidRequest, LimitExceeded
from rlserve.lifecycle.state import LifecycleSnapshot, LifecycleState, UpdateSession, check_weight_version
from rlserve.payloads import parse_json_object
from rlserve.types import PauseMode, PausePhase, SleepTag

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
        ("request_id", _utf8_len(req.request_id), "bytes", "max_id_bytes", limits.max_id_bytes),
        ("model", _utf8_len(req.model), "bytes", "max_id_bytes", limits.max_id_bytes),
        ("lora_name", _utf8_len(req.lora_name), "bytes", "max_id_bytes", limits.max_id_bytes),
        ("kv.cache_salt", _utf8_len(req.kv.cache_salt), "bytes", "max_id_bytes", limits.max_id_bytes),
        ("text", _utf8_len(req.text), "bytes", "max_prompt_text_bytes", limits.max_prompt_text_bytes),
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
        spec = sum(map(_utf8_len, d.choice.choices)) if which == "choice" else _utf8_len(getattr(d, which))
        checks.append(
            (f"decoding.{which}", spec, "bytes", "max_structured_spec_bytes", limits.max_structured_spec_bytes)
        )
    for field, size, unit, limit_name, limit in checks:
        if size > limit:
            raise LimitExceeded(field, size, unit, limit_name, limit)
    longest = max(map(_utf8_len, st.stop_strings), default=0)
    if longest > limits.max_stop_string_bytes:
        raise LimitExceeded(
            "stopping.stop_strings",
            longest,
            "bytes in one string",
            "max_stop_string_bytes",
            limits.max_stop_string_bytes,
        )


def _utf8_len(text: str) -> int:
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


def _fill_finish(info: inference_pb2.FinishInfo, finish: types.Finish) -> None:
    info.num_output_tokens = finish.num_output_tokens
    info.finish_reason = finish.reason.value
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
        rl_capabilities=_capabilities(caps),
    )


def _capabilities(caps: types.RlCapabilities) -> control_pb2.RlCapabilities:
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


# Lifecycle ------------------------------------------------------------------------------

PAUSE_MODES = {
    control_pb2.PAUSE_MODE_UNSPECIFIED: PauseMode.ABORT,  # upstream treats unspecified as ABORT
    control_pb2.PAUSE_MODE_ABORT: PauseMode.ABORT,
    control_pb2.PAUSE_MODE_WAIT: PauseMode.WAIT,
    control_pb2.PAUSE_MODE_KEEP: PauseMode.KEEP,
}
PAUSE_MODE_WIRE = {mode: wire for wire, mode in PAUSE_MODES.items() if wire != control_pb2.PAUSE_MODE_UNSPECIFIED}
PAUSE_PHASE_WIRE = {
    PausePhase.RUNNING: lifecycle_pb2.PAUSE_PHASE_RUNNING,
    PausePhase.PAUSING: lifecycle_pb2.PAUSE_PHASE_PAUSING,
    PausePhase.PAUSED: lifecycle_pb2.PAUSE_PHASE_PAUSED,
}
SLEEP_TAGS = {t.value: t for t in SleepTag}


def pause_mode(mode: int) -> PauseMode:
    if mode not in PAUSE_MODES:
        raise InvalidRequest("mode", f"unknown pause mode {mode}")
    return PAUSE_MODES[mode]


def pause_request(req: control_pb2.PauseGenerationRequest) -> tuple[PauseMode, bool]:
    return pause_mode(req.mode), req.clear_cache if req.HasField("clear_cache") else True


def sleep_request(req: control_pb2.SleepRequest) -> tuple[int, PauseMode]:
    return (req.level if req.HasField("level") else 1), pause_mode(req.mode)


def wake_tags(req: control_pb2.WakeUpRequest) -> frozenset[SleepTag]:
    """Empty means everything; unknown tags are INVALID_ARGUMENT."""
    unknown = sorted({t for t in req.tags if t not in SLEEP_TAGS})
    if unknown:
        shown = [t[:32] for t in unknown[:5]]
        raise InvalidRequest("tags", f"unknown {shown}; use {sorted(SLEEP_TAGS)} or none for all")
    return frozenset(SLEEP_TAGS[t] for t in req.tags)


def abort_ids(req: control_pb2.AbortRequest, limits: RequestLimits) -> list[str]:
    if len(req.request_ids) > limits.max_abort_ids:
        raise LimitExceeded("request_ids", len(req.request_ids), "ids", "max_abort_ids", limits.max_abort_ids)
    longest = max(map(_utf8_len, req.request_ids), default=0)
    if longest > limits.max_id_bytes:
        raise LimitExceeded("request_ids", longest, "bytes in one id", "max_id_bytes", limits.max_id_bytes)
    return list(req.request_ids)


def finish_version(req: control_pb2.FinishWeightUpdateRequest) -> str | None:
    return req.weight_version if req.HasField("weight_version") else None


def expected_version(req: lifecycle_pb2.UpdateWeightVersionRequest) -> str | None:
    return req.expected_weight_version if req.HasField("expected_weight_version") else None


def lifecycle_state(state: LifecycleState) -> lifecycle_pb2.LifecycleState:
    msg = lifecycle_pb2.LifecycleState(
        revision=state.revision,
        pause_phase=PAUSE_PHASE_WIRE[state.pause_phase],
        pause_mode=PAUSE_MODE_WIRE[state.pause_mode] if state.pause_mode else 0,
        asleep=sorted(t.value for t in state.asleep),
        sleep_level=state.sleep_level,
        weights_consistent=state.weights_consistent,
        inconsistency_reason=state.inconsistency_reason,
        weight_version=state.weight_version,
        num_held_requests=state.num_held_requests,
        transport_ready=state.transport_ready,
        transport_initializing=state.transport_initializing,
    )
    if state.update_session is not None:
        msg.update_session.CopyFrom(update_session(state.update_session))
    return msg


def update_session(session: UpdateSession) -> lifecycle_pb2.WeightUpdateSession:
    return lifecycle_pb2.WeightUpdateSession(
        session_id=session.session_id,
        is_draft=session.is_draft,
        num_chunks=session.num_chunks,
        num_tensors=session.num_tensors,
        num_bytes=session.num_bytes,
        started_unix_s=session.started_unix_s,
        lora_name=session.lora_name,
        prepared=session.prepared,
    )


def lifecycle_snapshot(snap: LifecycleSnapshot) -> lifecycle_pb2.LifecycleState:
    msg = lifecycle_state(snap.state)
    for e in snap.engines:
        msg.engines.add(data_parallel_rank=e.data_parallel_rank, paused=e.is_paused, weight_version=e.weight_version)
    msg.capabilities.CopyFrom(_capabilities(snap.capabilities))
    msg.weight_dtype = snap.weight_dtype
    msg.stages_updates = snap.stages_updates
    msg.num_frontends = snap.num_frontends
    for f in snap.frontends:
        msg.frontends.add(
            index=f.index,
            pid=f.pid,
            num_requests=f.num_requests,
            num_open_requests=f.num_open_requests,
            num_restarts=f.num_restarts,
        )
    for a in snap.recent_mutations:
        msg.recent_mutations.add(
            sequence=a.sequence,
            operation=a.operation,
            detail=a.detail,
            outcome=a.outcome,
            unix_time_s=a.unix_time_s,
            caller=a.caller,
        )
    return msg


def weight_checksum(served: types.ServedChecksums) -> lifecycle_pb2.WeightChecksum:
    return lifecycle_pb2.WeightChecksum(
        algorithm=served.algorithm,
        overall=served.overall,
        per_tensor=dict(served.per_tensor),
        inconsistent_tensors=list(served.inconsistent),
    )


def load_report(engines: tuple[types.EngineLoad, ...], num_held: int) -> lifecycle_pb2.LoadReport:
    report = lifecycle_pb2.LoadReport(num_held_requests=num_held)
    for e in engines:
        report.engines.add(
            data_parallel_rank=e.data_parallel_rank,
            num_running_requests=e.num_running_requests,
            num_waiting_requests=e.num_waiting_requests,
            kv_cache_usage=e.kv_cache_usage,
            unix_time_s=e.unix_time_s,
        )
    report.num_outstanding_requests = num_held + sum(e.num_running_requests + e.num_waiting_requests for e in engines)
    return report


def lora_adapter(adapter: types.LoraAdapter) -> control_pb2.LoraAdapter:
    return control_pb2.LoraAdapter(
        lora_id=adapter.lora_id, lora_name=adapter.lora_name, source_path=adapter.source_path
    )


# An adapter_config.json is a few hundred bytes, with dicts of lists at most.
MAX_ADAPTER_CONFIG_BYTES = 1 << 16
MAX_ADAPTER_CONFIG_DEPTH = 4


def start_lora_update(req: lifecycle_pb2.StartLoraUpdateRequest) -> tuple[str, str, dict[str, Any], bool]:
    """(name, version, adapter config, new_version); InvalidRequest naming the field."""
    if not req.lora_name or _utf8_len(req.lora_name) > 256:
        raise InvalidRequest("lora_name", "needs a name of 1 to 256 bytes")
    check_weight_version(req.version, "version")
    config = parse_json_object(
        req.adapter_config_json, "adapter_config_json", ("max_adapter_config_bytes", MAX_ADAPTER_CONFIG_BYTES)
    )
    if _depth(config) > MAX_ADAPTER_CONFIG_DEPTH:  # it crosses to the workers pickled
        raise InvalidRequest("adapter_config_json", f"is nested deeper than {MAX_ADAPTER_CONFIG_DEPTH} levels")
    return req.lora_name, req.version, config, req.new_version


def _depth(value: Any) -> int:
    """How deeply JSON containers nest in `value` (without recursion)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            pending.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
