"""Data-parallel size 2: one sync updates both engines, the lifecycle state and the load report
each, and a trainer that stalls mid-chunk is a clear deadline with both engines serving on."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
import pytest_asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.config import ServeConfig
from rlserve.wire.protocol import tensor_checksum

from helpers import (
    KEEP,
    PROMPT,
    HandTrainer,
    checkpoint,
    checksum,
    chunk_of,
    eventually,
    greedy,
    long_request,
    pause,
    perturbed,
    run_trainer,
    save_weights,
    serving,
    wait_for_state,
)

STALL_TIMEOUT_S = 3.0
# The trainer's own wait for the workers to join: each starts a gloo helper process first
# (rlserve.worker.gloo_link.START_S), 2.5-3.5 s on an AVX2 EPYC, longer than STALL_TIMEOUT_S.
# The server caps the workers' deadlines at STALL_TIMEOUT_S all the same.
RENDEZVOUS_S = 30.0


@pytest_asyncio.fixture(scope="module")
async def dp(engines, engine_config):
    config = replace(engine_config, weight_transfer_backend="rlserve_gloo", data_parallel_size=2)
    async with (
        engines.own(weight_transfer_backend="rlserve_gloo", data_parallel_size=2) as adapter,
        serving(adapter, ServeConfig(engine=config, transfer_timeout_s=STALL_TIMEOUT_S)) as stubs,
    ):
        yield stubs


async def test_one_sync_updates_both_engines(dp, tiny_model_dir, tmp_path):
    info = await dp.control.GetServerInfo(cpb.GetServerInfoRequest())
    assert info.parallelism.data_parallel_size == 2
    before = await asyncio.gather(*(greedy(dp.inference) for _ in range(4)))
    assert all(b == before[0] for b in before)
    weights = perturbed(tiny_model_dir, seed=5)
    rc, stats, err = await run_trainer(
        dp.target, save_weights(weights, tmp_path / "w.safetensors"), "dp-1", "--timeout-s", "20"
    )
    assert rc == 0, err
    assert stats["weight_version"] == "dp-1"
    state = await dp.lifecycle.GetState(lpb.GetStateRequest())
    assert [(e.data_parallel_rank, e.weight_version) for e in state.engines] == [(0, "dp-1"), (1, "dp-1")]
    # GetWeightChecksum fails if the engines disagree; both must serve the trainer's bytes.
    served = await dp.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())
    assert dict(served.per_tensor) == {n: tensor_checksum(t) for n, t in weights.items()}
    # Concurrent requests (spread over both engines by vLLM) all see the new weights.
    after = await asyncio.gather(*(greedy(dp.inference, PROMPT) for _ in range(8)))
    assert all(a == after[0] for a in after) and after[0] != before[0]


async def test_a_trainer_that_stalls_mid_chunk_with_two_engines(dp, tiny_model_dir):
    digest, tokens = await checksum(dp.lifecycle), await greedy(dp.inference)
    trainer = HandTrainer(dp.target, timeout_s=RENDEZVOUS_S)
    try:
        await trainer.init(world_size=3)
        await pause(dp.control, KEEP)
        await dp.control.StartWeightUpdate(cpb.StartWeightUpdateRequest())
        name, tensor = "model.norm.weight", checkpoint(tiny_model_dir)["model.norm.weight"] * 2
        t0 = time.perf_counter()
        stalled = asyncio.ensure_future(trainer.send(chunk_of([(name, tensor)]), [tensor], broadcast=False))
        await wait_for_state(dp.lifecycle, lambda s: s.HasField("update_session"))
        state = await asyncio.wait_for(dp.lifecycle.GetState(lpb.GetStateRequest()), 2)
        assert len(state.engines) == 2, "both engines answer while they wait for the trainer"
        try:
            await stalled
            raise AssertionError("a stalled chunk was accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.perf_counter() - t0 < STALL_TIMEOUT_S + 10
    finally:
        trainer.close()
    state = await dp.lifecycle.GetState(lpb.GetStateRequest())
    assert not state.HasField("update_session") and state.weights_consistent and not state.transport_ready
    assert await checksum(dp.lifecycle) == digest
    await dp.control.ResumeGeneration(cpb.ResumeGenerationRequest())
    assert await asyncio.gather(*(greedy(dp.inference) for _ in range(4))) == [tokens] * 4


async def test_get_load_reports_each_engine_with_the_requests_it_runs(dp):
    """vLLM spreads requests over the two engines; the figures each reported after the
    requests started add up to them (with --frontends 2 as well: checked by hand, not here)."""
    calls = [dp.inference.GenerateStream(long_request(f"Spread {i}:", 400)) for i in range(8)]
    await asyncio.gather(*(c.read() for c in calls))
    started = time.time()

    async def fresh() -> bool:
        load = await dp.lifecycle.GetLoad(lpb.GetLoadRequest())
        return all(e.unix_time_s > started for e in load.engines)

    await eventually(fresh, timeout_s=10)
    load = await dp.lifecycle.GetLoad(lpb.GetLoadRequest())
    for c in calls:
        c.cancel()
    assert [e.data_parallel_rank for e in load.engines] == [0, 1]
    assert sum(e.num_running_requests + e.num_waiting_requests for e in load.engines) == 8
    assert load.num_outstanding_requests == 8 and all(e.num_running_requests for e in load.engines)
