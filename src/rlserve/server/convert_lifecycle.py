"""Protobuf <-> domain conversion for the lifecycle RPCs of `vllm.Control` and
`rlserve.v1.Lifecycle` (pause, sleep, weight updates, state, load, LoRA adapters); generation
and server description are `convert`'s. Each refusal names the field."""

from __future__ import annotations

from typing import Any

from rlserve import types
from rlserve.api.rlserve.v1 import lifecycle_pb2
from rlserve.api.vllm import control_pb2
from rlserve.config import RequestLimits
from rlserve.errors import InvalidRequest, LimitExceeded
from rlserve.lifecycle.lora_adapters import MAX_LORA_NAME_BYTES
from rlserve.lifecycle.state import LifecycleSnapshot, LifecycleState, UpdateSession, check_weight_version
from rlserve.payloads import parse_json_object
from rlserve.server.convert import capabilities, utf8_len
from rlserve.types import PauseMode, PausePhase, SleepTag

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


def pause_mode(mode: control_pb2.PauseMode) -> PauseMode:
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
    longest = max(map(utf8_len, req.request_ids), default=0)
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
        pause_mode=PAUSE_MODE_WIRE[state.pause_mode] if state.pause_mode else control_pb2.PAUSE_MODE_UNSPECIFIED,
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
        staged=session.staged,
        shadow_bytes=session.shadow_bytes,
    )


def lifecycle_snapshot(snap: LifecycleSnapshot) -> lifecycle_pb2.LifecycleState:
    msg = lifecycle_state(snap.state)
    for e in snap.engines:
        msg.engines.add(data_parallel_rank=e.data_parallel_rank, paused=e.is_paused, weight_version=e.weight_version)
    msg.capabilities.CopyFrom(capabilities(snap.capabilities))
    msg.weight_dtype = snap.weight_dtype
    msg.weight_bytes = snap.weight_bytes
    msg.logprobs_mode = snap.logprobs_mode
    msg.stages_updates = snap.stages_updates
    # A backend that stages updates stages them while generating too (StageWeightUpdate).
    msg.staged_weight_updates = snap.stages_updates
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
    if not req.lora_name or utf8_len(req.lora_name) > MAX_LORA_NAME_BYTES:
        raise InvalidRequest("lora_name", f"needs a name of 1 to {MAX_LORA_NAME_BYTES} bytes")
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
