"""Server behaviour around generation: concurrency, cancellation, deadlines, Abort, health,
server/model info."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import inference_pb2 as pb
from rlserve.config import ServeConfig
from rlserve.sdk.client import generate_request
from rlserve.server.app import RlserveServer
from rlserve.server.listeners import AddressInUse

from helpers import eventually, long_request, read_rest


async def test_32_concurrent_streams_all_end_with_a_terminal_message(engine, inference):
    async def one(i: int) -> pb.GenerateResponse:
        last = None
        async for r in inference.GenerateStream(generate_request(f"prompt {i}", max_new_tokens=24, ignore_eos=True)):
            last = r
        return last

    finals = await asyncio.gather(*(one(i) for i in range(32)))
    assert len(finals) == 32
    assert all(f.outputs.finish_info.finish_reason == pb.FinishInfo.LENGTH for f in finals)
    assert all(f.outputs.finish_info.num_output_tokens == 24 for f in finals)
    assert engine.num_unfinished_requests() == 0


async def test_cancelled_stream_leaves_no_request_in_the_engine(engine, inference):
    call = inference.GenerateStream(long_request(max_new_tokens=400))
    await call.read()  # the request is running in the engine now
    assert engine.num_unfinished_requests() == 1
    call.cancel()
    await eventually(lambda: engine.num_unfinished_requests() == 0)


async def test_deadline_aborts_the_request(engine, inference):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await inference.Generate(long_request(max_new_tokens=480), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: engine.num_unfinished_requests() == 0)


async def test_abort_ends_a_stream_with_aborted_and_ignores_unknown_ids(engine, inference, control):
    call = inference.GenerateStream(long_request(max_new_tokens=400, request_id="to-abort"))
    first = await call.read()
    await control.Abort(cpb.AbortRequest(request_ids=["to-abort", "never-existed"]))
    rest = await read_rest(call)
    final = (rest or [first])[-1].outputs
    assert final.finish_info.finish_reason == pb.FinishInfo.ABORTED
    produced = first.outputs.num_tokens + sum(r.outputs.num_tokens for r in rest)
    assert final.finish_info.num_output_tokens == produced < 400
    assert engine.num_unfinished_requests() == 0


async def test_server_info_reports_the_real_engine(control):
    info = await control.GetServerInfo(cpb.GetServerInfoRequest())
    import vllm

    assert info.engine_version == vllm.__version__
    assert info.max_model_len == 512
    assert info.kv_block_size > 0 and info.total_kv_blocks > 0
    assert info.max_running_requests == 64 and info.max_batched_tokens > 0
    assert info.parallelism.data_parallel_size == 1 and info.parallelism.world_size == 1
    assert len(info.instance_id) == 32
    caps = info.rl_capabilities
    assert not caps.weight_transfer_enabled and caps.weight_transfer_backend == ""
    assert not caps.sleep_mode_enabled, "vLLM has no sleep mode on the CPU platform"
    assert not caps.draft_weight_updates_enabled


async def test_model_info_and_kv_event_sources(control, engine_config):
    info = await control.GetModelInfo(cpb.GetModelInfoRequest())
    assert info.served_model_name == "tiny"
    assert list(info.served_model_aliases) == [engine_config.model]
    assert info.supports_text_input and info.supports_token_ids_input and not info.supports_multimodal
    assert not (await control.GetKvEventSources(cpb.GetKvEventSourcesRequest())).sources


async def test_model_alias_is_accepted(inference, engine_config):
    r = generate_request("hi", max_new_tokens=2, model=engine_config.model)
    assert (await inference.Generate(r)).outputs.finish_info.num_output_tokens >= 1


async def test_health_not_serving_then_serving_then_not_serving(engine, engine_config):
    srv = RlserveServer(ServeConfig(engine=engine_config, port=0, shutdown_grace_s=5.0))
    port = await srv.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        check = health_pb2.HealthCheckRequest(service="vllm.Inference")
        assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_inference(ch).Generate(generate_request("hi", max_new_tokens=2))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        watch = health.Watch(check)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await srv.attach_engine(engine)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        # A stream in flight at shutdown drains within the grace period.
        stream = pb_inference(ch).GenerateStream(generate_request("drain me", max_new_tokens=32, ignore_eos=True))
        await stream.read()
        stopping = asyncio.create_task(srv.stop())
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        # The watch then ends, so it does not hold the shutdown for the whole grace period.
        assert await watch.read() == grpc.aio.EOF
        assert await watch.code() == grpc.StatusCode.OK
        rest = await read_rest(stream)
        assert rest[-1].outputs.finish_info.finish_reason == pb.FinishInfo.LENGTH
        await stopping
    assert engine.num_unfinished_requests() == 0


def pb_inference(channel):
    from rlserve.api.vllm import inference_pb2_grpc

    return inference_pb2_grpc.InferenceStub(channel)


@pytest.mark.parametrize("service", ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"])
async def test_reflection_answers_under_both_names(channel, service):
    """grpcurl and grpcui ask v1 first, older clients v1alpha: both list and describe every
    service, the reflection services themselves included."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as rpb

    call = channel.stream_stream(
        f"/{service}/ServerReflectionInfo",
        request_serializer=rpb.ServerReflectionRequest.SerializeToString,
        response_deserializer=rpb.ServerReflectionResponse.FromString,
    )()
    await call.write(rpb.ServerReflectionRequest(list_services=""))
    listed = {s.name for s in (await call.read()).list_services_response.service}
    assert {"vllm.Inference", "vllm.Control", "rlserve.v1.Lifecycle", "grpc.health.v1.Health", service} <= listed
    for symbol, method in (
        ("vllm.Inference", "GenerateStream"),
        ("grpc.reflection.v1.ServerReflection", "ServerReflectionInfo"),
    ):
        await call.write(rpb.ServerReflectionRequest(file_containing_symbol=symbol))
        answer = await call.read()
        assert not answer.HasField("error_response"), answer.error_response.error_message
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(b)
            for b in answer.file_descriptor_response.file_descriptor_proto
        ]
        package, _, name = symbol.rpartition(".")
        methods = {m.name for f in files if f.package == package for s in f.service if s.name == name for m in s.method}
        assert method in methods
    await call.write(rpb.ServerReflectionRequest(file_containing_symbol="no.such.Service"))
    assert (await call.read()).error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    await call.done_writing()


@pytest.mark.parametrize("num_frontends", [1, 2])
async def test_a_port_another_server_holds_is_refused_not_shared(engine_config, num_frontends):
    """gRPC binds with SO_REUSEPORT by default: a second server on a port a gRPC server
    already holds bound it too, and the kernel split new connections between the two
    (clients of one server reached the other). Only a server's own frontend processes share
    its inference port."""
    holder = grpc.aio.server()  # another gRPC server (rlserve or not), with gRPC's defaults
    port = holder.add_insecure_port("127.0.0.1:0")
    await holder.start()
    config = ServeConfig(
        engine=engine_config,
        port=port,
        num_frontends=num_frontends,
        control_address="127.0.0.1:0" if num_frontends > 1 else "",
    )
    server = RlserveServer(config)
    try:
        with pytest.raises(AddressInUse, match=rf"127\.0\.0\.1:{port} .*in use"):
            await server.start()
    finally:
        await server.stop(0)
        await holder.stop(0)
