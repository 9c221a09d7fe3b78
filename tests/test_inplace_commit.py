"""`--weight-update-mode in-place`, against an engine of its own: each layer goes live as soon
as its tensors have arrived (no shadow copy of the model). A sync serves what a fresh engine
serves; an open update marks the weights inconsistent, and an abort or a failure half way
leaves them so (resume refused) until a complete update makes them whole again."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import cloudpickle
import grpc
import pytest
import pytest_asyncio
import worker_faults
from worker_faults import fail_next_load

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.config import ServeConfig
from rlserve.sdk.client import Client
from rlserve.sdk.weight_sync import WeightSync, WeightSyncError
from rlserve.wire.protocol import tensor_checksum

from helpers import (
    HandTrainer,
    begin_update,
    checkpoint,
    chunk_of,
    expect,
    greedy,
    perturbed,
    serving,
)

# Sent to the worker by value: the worker cannot import the test modules.
cloudpickle.register_pickle_by_value(worker_faults)


@pytest_asyncio.fixture(scope="module")
async def in_place_engine(engines):
    async with engines.own(weight_transfer_backend="rlserve_gloo", weight_update_mode="in-place") as adapter:
        yield adapter


@pytest_asyncio.fixture(scope="module")
async def s(in_place_engine, engine_config):
    config = ServeConfig(
        engine=replace(engine_config, weight_transfer_backend="rlserve_gloo", weight_update_mode="in-place"),
        transfer_timeout_s=10.0,
    )
    async with serving(in_place_engine, config) as stubs:
        yield stubs


def sync(target: str, weights, version: str):
    with Client(target) as client:
        weight_sync = WeightSync(client)
        try:
            return weight_sync.sync(weights, version)
        finally:
            weight_sync.close()


async def served(s) -> dict[str, str]:
    return dict((await s.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())).per_tensor)


async def restored(s, tiny_model_dir) -> None:
    """A complete update makes the weights whole again, and generation can resume. The pause
    is the hand trainer's, so the sync leaves it in place; resuming it is allowed again."""
    weights = checkpoint(tiny_model_dir)
    stats = await asyncio.to_thread(sync, s.target, weights, "whole")
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert state.weights_consistent and state.weight_version == "whole"
    assert not stats.resumed and state.pause_phase == lpb.PAUSE_PHASE_PAUSED
    await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert state.pause_phase == lpb.PAUSE_PHASE_RUNNING
    assert await served(s) == {n: tensor_checksum(t) for n, t in weights.items()}


async def test_an_in_place_sync_serves_what_a_fresh_engine_serves(
    s, tiny_model_dir, tmp_path, engine_config, reference
):
    weights = perturbed(tiny_model_dir, seed=51)
    await asyncio.to_thread(sync, s.target, weights, "in-place-1")
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert not state.stages_updates
    assert state.weights_consistent and state.weight_version == "in-place-1"
    assert await served(s) == {n: tensor_checksum(t) for n, t in weights.items()}
    assert await greedy(s.inference) == await reference.outputs(weights, tmp_path)


async def test_an_aborted_in_place_update_leaves_the_weights_inconsistent(s, tiny_model_dir):
    weights = perturbed(tiny_model_dir, seed=52)
    before = await served(s)
    trainer = HandTrainer(s.target)
    try:
        await begin_update(s, trainer)
        state = await s.lifecycle.GetState(lpb.GetStateRequest())
        assert not state.weights_consistent and "in-place" in state.inconsistency_reason
        # Half the tensors: the layers they complete are live at once.
        pairs = sorted(weights.items())[: len(weights) // 2]
        await trainer.send(chunk_of(pairs), [t for _, t in pairs])
        now = await served(s)
        assert {n for n, _ in pairs if now[n] == tensor_checksum(weights[n])} and now != before
        await s.lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
    finally:
        trainer.close()
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert not state.weights_consistent and not state.HasField("update_session")
    await expect(grpc.StatusCode.FAILED_PRECONDITION, s.control.ResumeGeneration(cpb.ResumeGenerationRequest()))
    await restored(s, tiny_model_dir)


async def test_an_in_place_load_that_fails_half_way_is_reported_and_recovered(s, in_place_engine, tiny_model_dir):
    weights = perturbed(tiny_model_dir, seed=53)
    await in_place_engine.llm.collective_rpc(fail_next_load)
    trainer = HandTrainer(s.target)
    try:
        await begin_update(s, trainer)
        pairs = sorted(weights.items())
        with pytest.raises(grpc.RpcError) as e:
            await trainer.send(chunk_of(pairs), [t for _, t in pairs])
        assert e.value.code() == grpc.StatusCode.INTERNAL and "simulated failure" in e.value.details()
    finally:
        trainer.close()
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert not state.weights_consistent
    await expect(grpc.StatusCode.FAILED_PRECONDITION, s.control.ResumeGeneration(cpb.ResumeGenerationRequest()))
    await restored(s, tiny_model_dir)


async def test_an_in_place_backend_offers_no_staged_update_and_syncs_under_a_pause(s, tiny_model_dir):
    """Writing into the served weights while they serve would mix old and new weights in one
    forward pass: StageWeightUpdate is refused and nothing changes; the SDK then pauses for
    the whole sync (and refuses staged=True), as before staged updates existed."""
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert not state.staged_weight_updates and not state.stages_updates
    message = await expect(
        grpc.StatusCode.FAILED_PRECONDITION, s.lifecycle.StageWeightUpdate(lpb.StageWeightUpdateRequest())
    )
    assert "in place" in message
    after = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert not after.HasField("update_session") and after.weights_consistent
    assert after.pause_phase == lpb.PAUSE_PHASE_RUNNING

    def staged_sync() -> None:
        with Client(s.target) as client:
            WeightSync(client).sync(checkpoint(tiny_model_dir), "never", staged=True)

    with pytest.raises(WeightSyncError, match="cannot stage"):
        await asyncio.to_thread(staged_sync)
    stats = await asyncio.to_thread(sync, s.target, perturbed(tiny_model_dir, seed=57), "paused-sync")
    assert not stats.staged and stats.stage_s == 0
