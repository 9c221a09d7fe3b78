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

from conftest import eventually
from helpers import ABORT, KEEP, WAIT, finish, pause, started_streams, wait_for_state

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
    from dataclasses import replace

    from rlserve.config import ServeConfig

    from helpers import HandTrainer, expect, read_rest, serving

    config = ServeConfig(engine=replace(engine_config, weight_transfer_backend="rlserve_gloo"), transfer_timeout_s=10)
    async with serving(wt_engine, config) as s:
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
