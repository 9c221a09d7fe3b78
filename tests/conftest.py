"""Shared fixtures: one tiny random-weight model; per session one real vLLM CPU engine per
distinct configuration (`Engines`: the plain one behind a real gRPC server on 127.0.0.1:0, one
with the rlserve_gloo weight-transfer backend that the weight-transfer modules serve with
servers of their own, ...), and the reference engine the comparisons reload checkpoints into."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

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


class Engines:
    """One real engine per distinct configuration, started on first use and shared by every
    module that asks for that configuration, shut down when the session ends (an engine starts
    in tens of seconds on two cores). Weights a module syncs stay served after it: a module that
    needs the checkpoint's weights first syncs them itself.

    Every engine accepts pickled callables, so that a module can reach into a worker with
    `collective_rpc(callable)` to stage an edge a real engine never reaches by itself; no test
    relies on an engine refusing them. Servers the tests start as processes of their own
    (`rlserve serve`, the demo, fleets in namespaces, Ray) run as in production, without it."""

    def __init__(self, base: EngineConfig) -> None:
        _pickle_in_this_process()
        self._base = base
        self._started: dict[tuple, Any] = {}  # by the overrides (EngineConfig holds dicts)
        self._lock = asyncio.Lock()

    async def get(self, **overrides: Any) -> Any:
        """The session's engine (an EngineAdapter) for the base config with `overrides`."""
        from rlserve.engine.adapter import EngineAdapter
        from rlserve.server.app import freeze_startup_heap

        config, key = replace(self._base, **overrides), tuple(sorted(overrides.items()))
        async with self._lock:
            if key not in self._started:
                with _insecure_serialization():
                    self._started[key] = await asyncio.to_thread(EngineAdapter.start, config)
                # As `rlserve serve` does once its engine serves. The servers the tests run in
                # this process share its heap with every module and engine the session has
                # loaded; unfrozen, each full collection walks all of it with their event loop
                # stopped (0.02-0.42 s with one engine, growing with the session).
                freeze_startup_heap()
            return self._started[key]

    @contextlib.asynccontextmanager
    async def own(self, **overrides: Any) -> AsyncIterator[Any]:
        """An engine of its own for one module or test (one it kills, or the second of two
        alike), shut down when the block ends."""
        from rlserve.engine.adapter import EngineAdapter

        with _insecure_serialization():
            adapter = await asyncio.to_thread(EngineAdapter.start, replace(self._base, **overrides))
        try:
            yield adapter
        finally:
            await _stop(adapter)

    async def close(self) -> None:
        for adapter in self._started.values():
            await _stop(adapter)
        self._started.clear()


async def _stop(adapter: Any) -> None:
    await adapter.close()
    adapter.shutdown()


@pytest_asyncio.fixture(scope="session")
async def engines(engine_config: EngineConfig):
    cache = Engines(engine_config)
    yield cache
    await cache.close()


@pytest_asyncio.fixture(scope="session")
async def engine(engines: Engines):
    return await engines.get()


@pytest_asyncio.fixture(scope="session")
async def wt_engine(engines: Engines):
    return await engines.get(weight_transfer_backend="rlserve_gloo")


@pytest_asyncio.fixture(scope="session")
async def lora_engine(engines: Engines):
    """LoRA enabled, over rlserve_gloo (its LoRA pushes): test_dynamo, test_lora."""
    return await engines.get(enable_lora=True, max_loras=2, max_lora_rank=8, weight_transfer_backend="rlserve_gloo")


@pytest_asyncio.fixture(scope="session")
async def reference(engines: Engines, tiny_model_dir: Path):
    """The plain engine, which the comparisons reload each checkpoint into (`helpers.Reference`)."""
    from helpers import Reference

    return Reference(await engines.get(), tiny_model_dir)


def _pickle_in_this_process() -> None:
    """This process pickles what msgpack cannot carry, and reads the type tags of an engine
    that does (vLLM's VLLM_ALLOW_INSECURE_SERIALIZATION), for the whole session, without
    setting the variable: processes the tests start inherit it unset. vLLM reads the variable
    on every message, and an engine started with it tags every utility result: had this
    process stopped reading the tags while that engine lived, every call to it would hang."""
    import vllm.envs

    vllm.envs.environment_variables[INSECURE_SERIALIZATION] = lambda: True


@contextlib.contextmanager
def _insecure_serialization():
    """While set, the engines this process starts pickle what msgpack cannot carry (vLLM's
    VLLM_ALLOW_INSECURE_SERIALIZATION, which their processes inherit when spawned)."""
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
