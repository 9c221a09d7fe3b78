"""Data-parallel size 2: one sync updates both engines, and the lifecycle state reports each."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest_asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import control_pb2_grpc, inference_pb2_grpc
from rlserve.config import ServeConfig
from rlserve.transfer.protocol import tensor_checksum

from helpers import PROMPT, greedy, perturbed, run_trainer, save_weights


@pytest_asyncio.fixture(scope="module")
async def dp_server(engine_config):
    from rlserve.engine.adapter import EngineAdapter
    from rlserve.server.app import RlserveServer

    config = replace(engine_config, weight_transfer_backend="rlserve_gloo", data_parallel_size=2)
    adapter = await asyncio.to_thread(EngineAdapter.start, config)
    srv = RlserveServer(ServeConfig(engine=config, port=0, transfer_timeout_s=20.0))
    await srv.start()
    await srv.attach_engine(adapter)
    yield srv
    await srv.stop(0)
    adapter.shutdown()


async def test_one_sync_updates_both_engines(dp_server, tiny_model_dir, tmp_path):
    target = f"127.0.0.1:{dp_server.port}"
    async with grpc.aio.insecure_channel(target) as ch:
        control = control_pb2_grpc.ControlStub(ch)
        inference = inference_pb2_grpc.InferenceStub(ch)
        lifecycle = lifecycle_pb2_grpc.LifecycleStub(ch)
        info = await control.GetServerInfo(cpb.GetServerInfoRequest())
        assert info.parallelism.data_parallel_size == 2
        before = await asyncio.gather(*(greedy(inference) for _ in range(4)))
        assert all(b == before[0] for b in before)
        weights = perturbed(tiny_model_dir, seed=5)
        rc, stats, err = await run_trainer(target, save_weights(weights, tmp_path / "w.safetensors"), "dp-1")
        assert rc == 0, err
        state = await lifecycle.GetState(lpb.GetStateRequest())
        assert [(e.data_parallel_rank, e.weight_version) for e in state.engines] == [(0, "dp-1"), (1, "dp-1")]
        # GetWeightChecksum fails if the engines disagree; both must serve the trainer's bytes.
        served = await lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())
        assert dict(served.per_tensor) == {n: tensor_checksum(t) for n, t in weights.items()}
        # Concurrent requests spread over both engines; every one sees the new weights.
        after = await asyncio.gather(*(greedy(inference, PROMPT) for _ in range(8)))
        assert all(a == after[0] for a in after) and after[0] != before[0]
