"""What an operator and a router see: Prometheus metrics (rlserve's own next to vLLM's) and
Lifecycle/GetLoad, against a real engine, server and trainer process."""

from __future__ import annotations

import asyncio

import grpc

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.config import ServeConfig
from rlserve.sdk.client import generate_request

from helpers import (
    KEEP,
    expect,
    finish,
    gloo_server,
    pause,
    perturbed,
    run_trainer,
    save_weights,
    scrape,
    serving,
    started_streams,
    value,
)

INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


async def load_until(lifecycle, check, timeout_s: float = 20.0) -> lpb.LoadReport:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        report = await lifecycle.GetLoad(lpb.GetLoadRequest())
        if check(report):
            return report
        assert asyncio.get_running_loop().time() < deadline, report
        await asyncio.sleep(0.05)


async def test_load_follows_running_held_and_finished_requests(wt_engine, engine_config):
    async with serving(wt_engine, ServeConfig(engine=engine_config)) as s:
        calls, firsts = await started_streams(s.inference, 3, max_new_tokens=300)
        report = await load_until(s.lifecycle, lambda r: r.engines[0].num_running_requests >= 3)
        assert [e.data_parallel_rank for e in report.engines] == [0]
        assert 0 < report.engines[0].kv_cache_usage <= 1 and report.engines[0].unix_time_s > 0
        await pause(s.control, KEEP)
        held = asyncio.ensure_future(s.inference.Generate(generate_request("held", max_new_tokens=4)))
        report = await load_until(s.lifecycle, lambda r: r.num_held_requests == 1)
        assert report.num_outstanding_requests == 4  # three kept in the engine, one held
        await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
        await held
        for call, first in zip(calls, firsts):
            await finish(call, first)
        await load_until(s.lifecycle, lambda r: r.num_outstanding_requests == 0)


async def test_metrics_count_rpcs_pauses_updates_and_reuse_vllms(wt_engine, engine_config, tiny_model_dir, tmp_path):
    async with gloo_server(wt_engine, engine_config, metrics_port=0, transfer_timeout_s=20) as s:
        port = s.server.metrics_port
        before = await asyncio.to_thread(scrape, port)
        assert value(before, "rlserve_generation_paused") == 0 and value(before, "rlserve_engine_alive") == 1
        await s.inference.Generate(generate_request("hi", max_new_tokens=3))
        await expect(INVALID, s.control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version="")))
        await expect(PRECONDITION, s.control.UpdateWeights(cpb.UpdateWeightsRequest(update_info_json=b"{}")))
        await pause(s.control, KEEP)
        assert value(await asyncio.to_thread(scrape, port), "rlserve_generation_paused") == 1
        await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
        weights = save_weights(perturbed(tiny_model_dir, seed=3), tmp_path / "w.safetensors")
        rc, stats, err = await run_trainer(s.target, weights, "metrics-1")
        assert rc == 0, err
        after = await asyncio.to_thread(scrape, port)

    assert value(after, "rlserve_rpcs_total", method="/vllm.Inference/Generate", code="OK") == 1
    assert value(after, "rlserve_rpcs_total", method="/vllm.Control/UpdateWeightVersion", code="INVALID_ARGUMENT") == 1
    assert value(after, "rlserve_rpc_duration_seconds_count", method="/vllm.Inference/Generate") == 1
    assert (
        value(after, "rlserve_weight_update_failures_total", operation="update_weights", reason="NoUpdateSession") == 1
    )
    assert value(after, "rlserve_weight_updates_total", outcome="committed") == 1
    assert value(after, "rlserve_weight_update_bytes_total") == stats["num_bytes"]
    assert value(after, "rlserve_weight_update_duration_seconds_count") == 1
    # Our pause, and the trainer's KEEP pause around its sync.
    assert value(after, "rlserve_pause_duration_seconds_count") == 2
    assert value(after, "rlserve_weight_version_info", weight_version="metrics-1") == 1
    assert value(after, "rlserve_weights_consistent") == 1 and value(after, "rlserve_held_requests") == 0
    # Generation is counted once, by vLLM, on the same endpoint.
    assert any(name == "vllm:generation_tokens_total" for name, _ in after)
