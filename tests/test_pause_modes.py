"""Every pair of pause modes (current -> requested) with requests in flight, on a real engine.

A pause in a mode no stronger than the current one changes nothing (it returns once the
current pause is complete); a stronger one applies to what is left: KEEP -> WAIT lets the
kept requests finish, anything -> ABORT ends them. A WAIT pause is "current" while it drains.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import inference_pb2 as pb

from helpers import ABORT, KEEP, WAIT, eventually, finish, gloo_server, pause, started_streams, wait_for_state

NAMES = {ABORT: "ABORT", WAIT: "WAIT", KEEP: "KEEP"}
LENGTH, ABORTED = pb.FinishInfo.LENGTH, pb.FinishInfo.ABORTED
NUM_TOKENS = 300
# (current, requested) -> (final mode, how the in-flight streams end)
PAIRS = {
    (ABORT, ABORT): (ABORT, ABORTED),
    (ABORT, WAIT): (ABORT, ABORTED),
    (ABORT, KEEP): (ABORT, ABORTED),
    (WAIT, ABORT): (ABORT, ABORTED),
    (WAIT, WAIT): (WAIT, LENGTH),
    (WAIT, KEEP): (WAIT, LENGTH),
    (KEEP, ABORT): (ABORT, ABORTED),
    (KEEP, WAIT): (WAIT, LENGTH),
    (KEEP, KEEP): (KEEP, LENGTH),  # frozen, then continued after resume
}


@pytest_asyncio.fixture(autouse=True)
async def running_afterwards(control, engine):
    yield
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    await eventually(lambda: engine.num_unfinished_requests() == 0)


@pytest.mark.parametrize("current,requested", list(PAIRS), ids=[f"{NAMES[c]}-{NAMES[r]}" for c, r in PAIRS])
async def test_pause_mode_pair(current, requested, control, inference, lifecycle):
    final_mode, ending = PAIRS[(current, requested)]
    calls, firsts = await started_streams(inference, 3, max_new_tokens=NUM_TOKENS, prefix=f"pair {current}{requested}")
    first = asyncio.ensure_future(pause(control, current))
    if current == WAIT:
        await wait_for_state(lifecycle, lambda s: s.pause_phase == lpb.PAUSE_PHASE_PAUSING)
    else:
        await first
    await asyncio.wait_for(pause(control, requested), 60)
    await asyncio.wait_for(first, 60)
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert state.pause_phase == lpb.PAUSE_PHASE_PAUSED and state.pause_mode == final_mode
    assert all(e.paused for e in state.engines), "the engine is paused too"
    if final_mode != KEEP:  # nothing is left running: every stream has ended by now
        results = await asyncio.wait_for(asyncio.gather(*(finish(c, f) for c, f in zip(calls, firsts))), 10)
    else:
        await control.ResumeGeneration(cpb.ResumeGenerationRequest())
        results = await asyncio.gather(*(finish(c, f) for c, f in zip(calls, firsts)))
    for tokens, last in results:
        assert last.finish_info.finish_reason == ending
        assert last.finish_info.num_output_tokens == len(tokens)
        assert (len(tokens) == NUM_TOKENS) == (ending == LENGTH)


async def test_keep_then_wait_is_refused_while_an_update_is_open(wt_engine, engine_config):
    """The kept requests would run during the update; ABORT is still allowed."""

    from helpers import HandTrainer, expect, read_rest

    async with gloo_server(wt_engine, engine_config, transfer_timeout_s=10) as s:
        trainer = HandTrainer(s.target)
        try:
            await trainer.init()
            calls, _ = await started_streams(s.inference, 2, max_new_tokens=NUM_TOKENS, prefix="kept during update")
            await pause(s.control, KEEP)
            await s.control.StartWeightUpdate(cpb.StartWeightUpdateRequest())
            await expect(grpc.StatusCode.FAILED_PRECONDITION, pause(s.control, WAIT))
            await pause(s.control, ABORT)
            await s.lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
            state = await s.lifecycle.GetState(lpb.GetStateRequest())
            assert state.pause_mode == ABORT and state.weights_consistent
            await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
            for call in calls:
                rest = await read_rest(call)
                assert rest[-1].outputs.finish_info.finish_reason == ABORTED
        finally:
            trainer.close()


async def test_a_pause_that_changes_nothing_waits_for_the_pause_under_way(control, inference, lifecycle, server):
    """Client B's no-op pause, sent while client A's pause is still under way, returns only
    once A's pause is complete: the engine is idle when either call returns."""
    import grpc

    from rlserve.api.vllm import control_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as other:
        control_b = control_pb2_grpc.ControlStub(other)
        for first, second in ((ABORT, KEEP), (ABORT, ABORT), (KEEP, KEEP)):
            for _ in range(3):
                calls, _ = await started_streams(inference, 8, max_new_tokens=NUM_TOKENS, prefix="noop race")
                a = asyncio.ensure_future(pause(control, first))
                await wait_for_state(lifecycle, lambda st: st.pause_phase != lpb.PAUSE_PHASE_RUNNING)
                await pause(control_b, second)  # A's pause is under way, or done
                state = await lifecycle.GetState(lpb.GetStateRequest())
                assert state.pause_phase == lpb.PAUSE_PHASE_PAUSED, "B returned before the pause was complete"
                await a
                await control.ResumeGeneration(cpb.ResumeGenerationRequest())
                for call in calls:
                    call.cancel()


async def test_a_burst_of_held_requests_reaches_the_servers_own_cap(engine, engine_config):
    """2,600 requests over 4 connections while paused, against a cap of 2,500: gRPC's own
    queue limits (which cancel calls at random past 1,000 waiting ones) do not get there
    first. Exactly the requests over the cap are refused, and every held one runs."""
    import collections

    import grpc

    from rlserve.api.vllm import inference_pb2_grpc
    from rlserve.config import ServeConfig

    from helpers import long_request, serving

    async with serving(engine, ServeConfig(engine=engine_config, max_held_requests=2500)) as s:
        await pause(s.control, ABORT)
        channels = [
            grpc.aio.insecure_channel(s.target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)
        ]
        stubs = [inference_pb2_grpc.InferenceStub(ch) for ch in channels]

        async def one(i: int) -> str:
            try:
                await stubs[i % 4].Generate(long_request("burst", max_new_tokens=1), timeout=120)
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name

        calls = [asyncio.ensure_future(one(i)) for i in range(2600)]
        await wait_for_state(s.lifecycle, lambda st: st.num_held_requests == 2500, timeout_s=60)
        await eventually(lambda: sum(c.done() for c in calls) == 100, timeout_s=60)  # the refused ones
        await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
        outcomes = collections.Counter(await asyncio.gather(*calls))
        for ch in channels:
            await ch.close()
    assert outcomes == {"OK": 2500, "RESOURCE_EXHAUSTED": 100}, outcomes
