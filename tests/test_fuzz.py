"""Property-based fuzzing of every request message of every served service, against the real
server and engine: each answer is a response or a status other than INTERNAL and UNKNOWN
(those mean a bug in rlserve), and the server stays healthy. Derandomized, so CI runs the
same examples every time; `RLSERVE_FUZZ_EXAMPLES` scales the count for a longer hunt."""

from __future__ import annotations

import asyncio
import functools
import json
import os

import grpc
import pytest
import pytest_asyncio
from fuzz_messages import json_payload, messages, native_sampling_params
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlserve.api.rlserve.v1 import lifecycle_pb2
from rlserve.api.vllm import control_pb2, inference_pb2, inference_pb2_grpc
from rlserve.sdk.client import generate_request

from helpers import gloo_server

SCALE = float(os.environ.get("RLSERVE_FUZZ_EXAMPLES", "1"))
BUGS = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
RPC_DEADLINE_S = 30.0
EXAMPLES: dict[str, int] = {}


def fuzz_settings(n: int):
    return settings(
        max_examples=max(1, int(n * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    )


def methods(service_pb2, service: str) -> list[tuple[str, type]]:
    desc = service_pb2.DESCRIPTOR.services_by_name[service]
    return [(m.name, m.input_type._concrete_class) for m in desc.methods]


async def call(stub, name: str, request, *, streaming: bool = False) -> grpc.StatusCode:
    EXAMPLES[name] = EXAMPLES.get(name, 0) + 1
    try:
        rpc = getattr(stub, name)(request, timeout=RPC_DEADLINE_S)
        if streaming:
            async for _ in rpc:
                pass
        else:
            await rpc
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        assert e.code() not in BUGS, f"{name}: {e.code()} {e.details()}\nrequest: {str(request)[:2000]}"
        return e.code()


def bounded(request: inference_pb2.GenerateRequest) -> inference_pb2.GenerateRequest:
    """Keep the engine time of one example small: few new tokens (the fuzzed JSON may still
    ask for more, up to the model's context)."""
    request.stopping.max_new_tokens = min(request.stopping.max_new_tokens, 8)
    return request


@pytest_asyncio.fixture(scope="module", autouse=True)
async def healthy_afterwards(server, control):
    yield
    await control.ResumeGeneration(control_pb2.ResumeGenerationRequest())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        status = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        r = await inference_pb2_grpc.InferenceStub(ch).Generate(generate_request("still fine", max_new_tokens=3))
        assert r.outputs.finish_info.num_output_tokens >= 1
    print(f"fuzz examples per RPC: {dict(sorted(EXAMPLES.items()))} ({sum(EXAMPLES.values())} in all)")


@fuzz_settings(150)
@given(request=messages(inference_pb2.GenerateRequest), stream=st.booleans())
async def test_fuzz_inference(inference, request, stream):
    await call(inference, "GenerateStream" if stream else "Generate", bounded(request), streaming=stream)


@fuzz_settings(400)
@given(native=native_sampling_params(), stream=st.booleans())
async def test_fuzz_native_sampling_params(inference, native, stream):
    """Every SamplingParams field, valued by its declared type: each answer is OK or a clear
    status (vLLM's own validation raises plain ValueErrors that once answered INTERNAL)."""
    request = generate_request("fuzz", max_new_tokens=4)
    request.native_sampling_params_json = json.dumps(native).encode()
    await call(inference, "GenerateStream" if stream else "Generate", request, streaming=stream)


CONTROL = [m for m in methods(control_pb2, "Control")]


@fuzz_settings(400)
@given(data=st.data())
async def test_fuzz_control(control, data):
    name, cls = data.draw(st.sampled_from(CONTROL))
    await call(control, name, data.draw(messages(cls)))
    await control.ResumeGeneration(control_pb2.ResumeGenerationRequest())


LIFECYCLE = [m for m in methods(lifecycle_pb2, "Lifecycle") if m[0] != "WatchState"]


@fuzz_settings(150)
@given(data=st.data())
async def test_fuzz_lifecycle(lifecycle, control, data):
    name, cls = data.draw(st.sampled_from(LIFECYCLE))
    await call(lifecycle, name, data.draw(messages(cls)))
    await control.ResumeGeneration(control_pb2.ResumeGenerationRequest())


@pytest_asyncio.fixture(scope="module")
async def wt(wt_engine, engine_config):
    """The weight-transfer RPCs for real, with a rendezvous deadline short enough that an
    init naming some random address ends fast."""
    async with gloo_server(wt_engine, engine_config, transfer_timeout_s=0.5) as stubs:
        yield stubs
        await stubs.lifecycle.AbortWeightUpdate(lifecycle_pb2.AbortWeightUpdateRequest())
        await stubs.control.ResumeGeneration(control_pb2.ResumeGenerationRequest())


TRANSFER = ["InitWeightTransferEngine", "StartWeightUpdate", "UpdateWeights", "FinishWeightUpdate", "PauseGeneration"]


@fuzz_settings(200)
@given(data=st.data())
async def test_fuzz_weight_transfer(wt, data):
    name = data.draw(st.sampled_from(TRANSFER))
    cls = dict(CONTROL)[name]
    await call(wt.control, name, data.draw(messages(cls)))
    if data.draw(st.booleans()):
        await call(wt.lifecycle, "AbortWeightUpdate", lifecycle_pb2.AbortWeightUpdateRequest())


async def test_watch_state_survives_a_fuzzed_request(lifecycle):
    watch = lifecycle.WatchState(lifecycle_pb2.WatchStateRequest())
    assert (await asyncio.wait_for(watch.read(), 5)).revision >= 0
    watch.cancel()


pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")


# The parsers alone, fast enough for many more examples: they are total (every input is a
# value or a ProtocolError / InvalidRequest), so no malformed payload reaches the workers.


@functools.cache
def _parsing_transport(cls):
    """A transport for two workers whose parsers need no engine (one for every example)."""
    return cls(None, None, 2)


@fuzz_settings(2000)
@given(raw=st.one_of(json_payload("init_info_json"), json_payload("update_info_json")))
def test_fuzz_transfer_payload_parsers(raw):
    from rlserve.engine.transport import GlooTransport
    from rlserve.errors import InvalidRequest
    from rlserve.payloads import parse_json

    transport = _parsing_transport(GlooTransport)
    try:
        value = parse_json(raw, "payload", ("max_transfer_info_bytes", 1 << 20))
    except InvalidRequest:
        return
    for parse in (lambda v: transport.parse_init(v, 5.0), transport.parse_chunk):
        try:
            parse(value)
        except InvalidRequest:
            pass


@fuzz_settings(1000)
@given(request=messages(inference_pb2.GenerateRequest), stream=st.booleans())
def test_fuzz_generate_request_conversion(request, stream):
    from rlserve.config import RequestLimits
    from rlserve.errors import InvalidRequest
    from rlserve.server import convert

    try:
        convert.generate_params(request, is_stream=stream, limits=RequestLimits())
    except InvalidRequest:
        pass
