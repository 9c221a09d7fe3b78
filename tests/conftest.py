"""Shared fixtures: one tiny random-weight model; per session one real vLLM CPU engine with a
real gRPC server on 127.0.0.1:0 in front of it, and one engine with the rlserve_gloo
weight-transfer backend that the weight-transfer modules serve with servers of their own."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2_grpc, inference_pb2_grpc
from rlserve.config import EngineConfig, ServeConfig

from tiny_model import make_tiny_model

MAX_MODEL_LEN = 512
INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"


# Modules whose engine tests start server or helper processes of their own (subprocesses,
# Ray, network namespaces).
PROCESS_MODULES = {
    "test_dynamo", "test_fleet", "test_fleet_netns", "test_frontends", "test_ray", "test_rl",
    "test_shutdown", "test_vllm_router",
}  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    # No model hub here: everything loads from local directories.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`engine`: a test whose fixtures build the tiny model (every engine, in this process or
    another, is of it); `process`: such a test of PROCESS_MODULES. `pytest -m "not engine"` is
    the quick gate."""
    for item in items:
        module = item.module.__name__ if isinstance(item, pytest.Function) else ""
        uses_model = "tiny_model_dir" in getattr(item, "fixturenames", ())
        if uses_model:
            item.add_marker(pytest.mark.engine)
            if module in PROCESS_MODULES:
                item.add_marker(pytest.mark.process)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def engine_config(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=64,
        enforce_eager=True,
        kv_cache_gib=0.5,
        # As `rlserve serve --metrics-port` starts it: vLLM's own metrics recorded.
        vllm_metrics=True,
    )


@pytest_asyncio.fixture(scope="session")
async def engine(engine_config: EngineConfig):
    from rlserve.engine.adapter import EngineAdapter

    adapter = await asyncio.to_thread(EngineAdapter.start, engine_config)
    yield adapter
    adapter.shutdown()


@pytest_asyncio.fixture(scope="session")
async def wt_engine(engine_config: EngineConfig):
    from rlserve.engine.adapter import EngineAdapter

    config = replace(engine_config, weight_transfer_backend="rlserve_gloo")
    adapter = await asyncio.to_thread(EngineAdapter.start, config)
    yield adapter
    await adapter.close()
    adapter.shutdown()


@contextlib.contextmanager
def insecure_serialization():
    """While set, this process and the engines it starts pickle what msgpack cannot carry
    (vLLM's VLLM_ALLOW_INSECURE_SERIALIZATION), so that a test can reach into a worker with
    `collective_rpc(callable)`. An engine started inside needs it for as long as it lives."""
    before = os.environ.get(INSECURE_SERIALIZATION)
    os.environ[INSECURE_SERIALIZATION] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[INSECURE_SERIALIZATION]
        else:
            os.environ[INSECURE_SERIALIZATION] = before


@pytest_asyncio.fixture(scope="session")
async def server(engine, engine_config: EngineConfig):
    from rlserve.server.app import RlserveServer

    srv = RlserveServer(ServeConfig(engine=engine_config, port=0, shutdown_grace_s=1.0))
    await srv.start()
    await srv.attach_engine(engine)
    yield srv
    await srv.stop()


@pytest_asyncio.fixture(scope="session")
async def channel(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


@pytest.fixture(scope="session")
def inference(channel) -> inference_pb2_grpc.InferenceStub:
    return inference_pb2_grpc.InferenceStub(channel)


@pytest.fixture(scope="session")
def control(channel) -> control_pb2_grpc.ControlStub:
    return control_pb2_grpc.ControlStub(channel)


@pytest.fixture(scope="session")
def lifecycle(channel) -> lifecycle_pb2_grpc.LifecycleStub:
    return lifecycle_pb2_grpc.LifecycleStub(channel)


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Wait (bounded) for state another process changes asynchronously, e.g. an abort that
    reaches the engine core after the client's cancel returned."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.05)
