"""The RL lifecycle over real gRPC and a real vLLM CPU engine: pause modes with streams in
flight, held requests, version labels and spans, concurrency, and the RPC x state matrix."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import pytest_asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import inference_pb2 as pb

from helpers import ABORT, KEEP, WAIT, finish, long_request, pause, started_streams, wait_for_state

OK = grpc.StatusCode.OK


@pytest_asyncio.fixture(autouse=True)
async def running_afterwards(control, engine):
    """Every test leaves generation running and the engine empty for the next one."""
    yield
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    assert engine.num_unfinished_requests() == 0


async def test_abort_ends_every_stream_with_its_partial_output(control, inference, engine):
    calls, firsts = await started_streams(inference, 8)
    await pause(control, ABORT)
    results = await asyncio.gather(*(finish(c, f) for c, f in zip(calls, firsts)))
    for tokens, last in results:
        assert last.finish_info.finish_reason == pb.FinishInfo.ABORTED
        assert 0 < last.finish_info.num_output_tokens == len(tokens) < 200


async def test_wait_lets_every_stream_finish_before_returning(control, inference):
    calls, firsts = await started_streams(inference, 8, max_new_tokens=40)
    await pause(control, WAIT)
    assert (await control.IsPaused(cpb.IsPausedRequest())).paused
    results = await asyncio.gather(*(finish(c, f) for c, f in zip(calls, firsts)))
    for tokens, last in results:
        assert last.finish_info.finish_reason == pb.FinishInfo.LENGTH
        assert len(tokens) == last.finish_info.num_output_tokens == 40


async def test_keep_freezes_streams_and_continues_them_identically(control, lifecycle, inference):
    reference = [
        list((await inference.Generate(long_request(f"Story number {i}:", 48))).outputs.token_ids) for i in range(8)
    ]
    calls, firsts = await started_streams(inference, 8, max_new_tokens=48)
    await pause(control, KEEP)
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert state.pause_phase == lpb.PAUSE_PHASE_PAUSED and state.pause_mode == KEEP
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    results = await asyncio.gather(*(finish(c, f) for c, f in zip(calls, firsts)))
    assert [tokens for tokens, _ in results] == reference
    assert all(last.finish_info.finish_reason == pb.FinishInfo.LENGTH for _, last in results)


async def test_requests_sent_while_paused_are_held_then_run(control, inference, lifecycle, engine):
    await pause(control, ABORT)
    watch = lifecycle.WatchState(lpb.WatchStateRequest())
    held = [asyncio.ensure_future(inference.Generate(long_request(f"Story number {i}:", 8))) for i in range(5)]
    while (await watch.read()).num_held_requests < 5:
        pass
    assert engine.num_unfinished_requests() == 0, "held requests must not reach the engine"
    assert not any(t.done() for t in held)
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    results = await asyncio.gather(*held)
    watch.cancel()
    assert [r.outputs.finish_info.num_output_tokens for r in results] == [8] * 5
    assert (await lifecycle.GetState(lpb.GetStateRequest())).num_held_requests == 0


async def test_held_request_honours_its_deadline(control, inference, lifecycle):
    await pause(control, ABORT)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await inference.Generate(long_request("Story number 0:", 8), timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    watch = lifecycle.WatchState(lpb.WatchStateRequest())
    while (await watch.read()).num_held_requests != 0:
        pass
    watch.cancel()


async def test_held_requests_are_capped(engine, engine_config):
    from rlserve.api.vllm import control_pb2_grpc, inference_pb2_grpc
    from rlserve.config import ServeConfig
    from rlserve.server.app import RlserveServer

    srv = RlserveServer(ServeConfig(engine=engine_config, port=0, max_held_requests=1))
    await srv.start()
    await srv.attach_engine(engine)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            control, inference = control_pb2_grpc.ControlStub(ch), inference_pb2_grpc.InferenceStub(ch)
            lifecycle = lifecycle_pb2_grpc.LifecycleStub(ch)
            await pause(control, ABORT)
            watch = lifecycle.WatchState(lpb.WatchStateRequest())
            first = asyncio.ensure_future(inference.Generate(long_request("Story number 0:", 4)))
            while (await watch.read()).num_held_requests < 1:
                pass
            watch.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await inference.Generate(long_request("Story number 1:", 4))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await control.ResumeGeneration(cpb.ResumeGenerationRequest())
            assert (await first).outputs.finish_info.num_output_tokens == 4
    finally:
        await srv.stop(0)


async def test_version_label_change_never_loses_requests_and_splits_spans(control, inference, lifecycle):
    before, after = f"v-{uuid.uuid4().hex[:6]}", f"v-{uuid.uuid4().hex[:6]}"
    await control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version=before))
    calls, firsts = await started_streams(inference, 2, max_new_tokens=64)
    await pause(control, KEEP)
    await control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version=after))
    assert (await control.GetWeightVersion(cpb.GetWeightVersionRequest())).weight_version == after
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert all(e.weight_version == after for e in state.engines)
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    for c, f in zip(calls, firsts):
        tokens, last = await finish(c, f)
        assert last.finish_info.num_output_tokens == len(tokens) == 64
        spans = [(s.weight_version, s.start, s.end) for s in last.weight_version_spans]
        assert len(spans) == 2, spans
        (v0, s0, e0), (v1, s1, e1) = spans
        assert (v0, s0, v1, e1) == (before, 0, after, 64) and e0 == s1
        assert 0 < e0 < 64


async def test_version_span_boundary_equals_tokens_before_the_pause(control, inference):
    before, after = f"v-{uuid.uuid4().hex[:6]}", f"v-{uuid.uuid4().hex[:6]}"
    await control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version=before))
    chunks: list[pb.GenerateResponse] = []
    first_token = asyncio.Event()

    async def read_all() -> None:
        async for r in inference.GenerateStream(long_request("Story number 0:", 64)):
            chunks.append(r)
            first_token.set()

    reader = asyncio.create_task(read_all())
    await first_token.wait()
    await pause(control, KEEP)
    # The engine is idle and its last outputs precede the pause reply on the wire; one more
    # round trip lets the reader take them in.
    await control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version=after))
    produced_before_pause = sum(c.outputs.num_tokens for c in chunks)
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    await reader
    spans = [(s.weight_version, s.start, s.end) for s in chunks[-1].outputs.weight_version_spans]
    assert spans == [(before, 0, produced_before_pause), (after, produced_before_pause, 64)]


async def test_update_weight_version_rules(control, lifecycle):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version=""))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "weight_version" in e.value.details()
    current = (await control.GetWeightVersion(cpb.GetWeightVersionRequest())).weight_version
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await lifecycle.UpdateWeightVersion(
            lpb.UpdateWeightVersionRequest(weight_version="x", expected_weight_version=current + "-stale")
        )
    assert e.value.code() == grpc.StatusCode.ABORTED
    assert (await control.GetWeightVersion(cpb.GetWeightVersionRequest())).weight_version == current
    resp = await lifecycle.UpdateWeightVersion(
        lpb.UpdateWeightVersionRequest(weight_version=current + "-next", expected_weight_version=current)
    )
    assert resp.previous_weight_version == current
    # Same version again: idempotent.
    await control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version=current + "-next"))


async def test_sleep_and_wake_fail_closed_on_cpu(control):
    info = await control.GetServerInfo(cpb.GetServerInfoRequest())
    assert not info.rl_capabilities.sleep_mode_enabled
    for call, req in ((control.Sleep, cpb.SleepRequest(level=1)), (control.WakeUp, cpb.WakeUpRequest())):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(req)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "sleep mode" in e.value.details()
    assert not (await control.IsSleeping(cpb.IsSleepingRequest())).sleeping
    assert not (await control.IsPaused(cpb.IsPausedRequest())).paused, "a refused Sleep changes nothing"


async def test_resume_during_a_wait_drain_is_refused_and_the_drain_completes(control, lifecycle, inference):
    """vLLM cannot resume a data-parallel engine in the middle of a pause, so rlserve refuses
    it for every engine count: the drain is the caller's to wait for (or to ABORT)."""
    calls, firsts = await started_streams(inference, 2, max_new_tokens=120)
    pausing = asyncio.create_task(pause(control, WAIT))
    await wait_for_phase(lifecycle, lpb.PAUSE_PHASE_PAUSING)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    assert e.value.code() == grpc.StatusCode.ABORTED and "draining" in e.value.details()
    await pausing
    for c, f in zip(calls, firsts):
        tokens, last = await finish(c, f)
        assert last.finish_info.finish_reason == pb.FinishInfo.LENGTH and len(tokens) == 120
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert state.pause_phase == lpb.PAUSE_PHASE_PAUSED and state.pause_mode == WAIT


async def test_abort_over_a_running_wait_applies_to_what_is_left(control, lifecycle, inference):
    calls, firsts = await started_streams(inference, 4, max_new_tokens=300)
    waiting = asyncio.create_task(pause(control, WAIT))
    await wait_for_phase(lifecycle, lpb.PAUSE_PHASE_PAUSING)
    await pause(control, ABORT)
    await waiting
    for c, f in zip(calls, firsts):
        tokens, last = await finish(c, f)
        assert last.finish_info.finish_reason == pb.FinishInfo.ABORTED and len(tokens) < 300
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert state.pause_phase == lpb.PAUSE_PHASE_PAUSED and state.pause_mode == ABORT


async def test_twenty_concurrent_clients_leave_a_consistent_state_and_ordered_audit(control, lifecycle):
    versions = [f"c{i}-{uuid.uuid4().hex[:4]}" for i in range(20)]

    async def client(i: int) -> None:
        for step in range(3):
            op = (i + step) % 3
            if op == 0:
                await pause(control, (ABORT, WAIT, KEEP)[i % 3])
            elif op == 1:
                await control.ResumeGeneration(cpb.ResumeGenerationRequest())
            else:
                await control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version=versions[i]))

    results = await asyncio.gather(*(client(i) for i in range(20)), return_exceptions=True)
    # A pause overtaken by a resume is ABORTED by design; nothing else may fail.
    failures = [r for r in results if isinstance(r, Exception)]
    assert all(isinstance(f, grpc.aio.AioRpcError) and f.code() == grpc.StatusCode.ABORTED for f in failures)
    state = await lifecycle.GetState(lpb.GetStateRequest())
    audit = list(state.recent_mutations)
    sequences = [a.sequence for a in audit]
    assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences)
    assert len([a for a in audit if a.operation in ("pause", "resume", "update_weight_version")]) >= 60
    last_version = [a for a in audit if a.operation == "update_weight_version" and a.outcome in ("ok", "noop")][-1]
    assert state.weight_version in last_version.detail
    last_switch = [a for a in audit if a.operation in ("pause", "resume") and a.outcome == "ok"][-1]
    is_paused = last_switch.operation == "pause"
    assert (state.pause_phase != lpb.PAUSE_PHASE_RUNNING) == is_paused
    assert all(e.paused == is_paused for e in state.engines), "the engine agrees with the controller"
    assert all(e.weight_version == state.weight_version for e in state.engines)


async def test_watch_state_streams_transitions(control, lifecycle):
    watch = lifecycle.WatchState(lpb.WatchStateRequest())
    first = await watch.read()
    assert first.pause_phase == lpb.PAUSE_PHASE_RUNNING
    await pause(control, KEEP)
    phases = []
    while lpb.PAUSE_PHASE_PAUSED not in phases:
        phases.append((await watch.read()).pause_phase)
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    while (s := await watch.read()).pause_phase != lpb.PAUSE_PHASE_RUNNING:
        pass
    assert s.revision > first.revision
    watch.cancel()


# The RPC x state matrix ------------------------------------------------------------------

STATES = {
    "running": None,
    "paused_abort": ABORT,
    "paused_wait": WAIT,
    "paused_keep": KEEP,
}
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
# (name, call builder, expected code, expected paused afterwards: True/False/"same")
MATRIX = [
    ("pause_abort", lambda c: pause(c, ABORT), OK, True),
    ("pause_wait", lambda c: pause(c, WAIT), OK, True),
    ("pause_keep", lambda c: pause(c, KEEP), OK, True),
    ("pause_unspecified", lambda c: pause(c, cpb.PAUSE_MODE_UNSPECIFIED, clear_cache=False), OK, True),
    ("pause_bad_mode", lambda c: pause(c, 42), INVALID, "same"),
    ("resume", lambda c: c.ResumeGeneration(cpb.ResumeGenerationRequest()), OK, False),
    ("is_paused", lambda c: c.IsPaused(cpb.IsPausedRequest()), OK, "same"),
    ("sleep", lambda c: c.Sleep(cpb.SleepRequest(level=1)), PRECONDITION, "same"),
    ("sleep_level2", lambda c: c.Sleep(cpb.SleepRequest(level=2, mode=ABORT)), PRECONDITION, "same"),
    ("wake_up", lambda c: c.WakeUp(cpb.WakeUpRequest(tags=["weights"])), PRECONDITION, "same"),
    ("is_sleeping", lambda c: c.IsSleeping(cpb.IsSleepingRequest()), OK, "same"),
    ("version_empty", lambda c: c.UpdateWeightVersion(cpb.UpdateWeightVersionRequest()), INVALID, "same"),
    ("version_set", lambda c: c.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version="m")), OK, "same"),
    ("version_get", lambda c: c.GetWeightVersion(cpb.GetWeightVersionRequest()), OK, "same"),
    ("server_info", lambda c: c.GetServerInfo(cpb.GetServerInfoRequest()), OK, "same"),
    ("abort_unknown", lambda c: c.Abort(cpb.AbortRequest(request_ids=["nope"])), OK, "same"),
    # This engine has no weight-transfer backend: every transfer RPC fails closed.
    (
        "init_transfer",
        lambda c: c.InitWeightTransferEngine(cpb.InitWeightTransferEngineRequest(init_info_json=b"{}")),
        PRECONDITION,
        "same",
    ),
    ("start_update", lambda c: c.StartWeightUpdate(cpb.StartWeightUpdateRequest()), PRECONDITION, "same"),
    (
        "update_no_session",
        lambda c: c.UpdateWeights(cpb.UpdateWeightsRequest(update_info_json=b"{}")),
        PRECONDITION,
        "same",
    ),
    ("finish_no_session", lambda c: c.FinishWeightUpdate(cpb.FinishWeightUpdateRequest()), PRECONDITION, "same"),
]


@pytest.mark.parametrize("state_name", list(STATES))
@pytest.mark.parametrize("name,call,code,paused_after", MATRIX, ids=[m[0] for m in MATRIX])
async def test_matrix(control, lifecycle, state_name, name, call, code, paused_after):
    mode = STATES[state_name]
    if mode is not None:
        await pause(control, mode)
    try:
        await call(control)
        got = OK
    except grpc.aio.AioRpcError as e:
        got = e.code()
    assert got == code
    expected = (mode is not None) if paused_after == "same" else paused_after
    assert (await control.IsPaused(cpb.IsPausedRequest())).paused == expected
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert all(e.paused == expected for e in state.engines)
    assert state.pause_phase == (lpb.PAUSE_PHASE_PAUSED if expected else lpb.PAUSE_PHASE_RUNNING)
    assert not state.asleep and state.weights_consistent


async def wait_for_phase(lifecycle, phase) -> None:
    await wait_for_state(lifecycle, lambda s: s.pause_phase == phase)
