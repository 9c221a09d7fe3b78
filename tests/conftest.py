"""Shared fixtures: one tiny random-weight model; per session one real vLLM CPU engine per
distinct configuration (`Engines`: the plain one behind a real gRPC server on 127.0.0.1:0, one
with the rlserve_gloo weight-transfer backend that the weight-transfer modules serve with
servers of their own, ...), and the reference engine the comparisons reload checkpoints into."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2_grpc, inference_pb2_grpc
from rlserve.config import EngineConfig, ServeConfig

from tiny_model import KV_CACHE_GIB, make_tiny_model

MAX_MODEL_LEN = 512
INSECURE_SERIALIZATION = "VLLM_ALLOW_INSECURE_SERIALIZATION"
CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


# Modules whose engine tests start server or helper processes of their own (subprocesses,
# Ray, network namespaces), the longest first (seconds of a serial run on two cores: 177, 122,
# 104, 96, 52, 49, 32, 3).
PROCESS_MODULES = (
    "test_ray", "test_shutdown", "test_frontends", "test_fleet", "test_rl", "test_fleet_netns", "test_dynamo",
    "test_vllm_router",
)  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    # No model hub here: everything loads from local directories.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _one_core_per_xdist_worker()


def _one_core_per_xdist_worker() -> None:
    """Under pytest-xdist (`make test`), the engines of worker N, and of the servers its tests
    start, compute on core N (modulo the cores): vLLM's automatic binding would put every
    engine of both workers on the first core and keep the second for other processes."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or CPU_BIND in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ[CPU_BIND] = str(cores[int(worker.removeprefix("gw")) % len(cores)])


@contextlib.contextmanager
def _launch_env(config: EngineConfig) -> Iterator[None]:
    """While an engine this process starts is launched: pickled callables allowed
    (`_insecure_serialization`), and an engine of several data-parallel ranks bound by vLLM
    itself (a core named for the session's engines would not make a list of one per rank)."""
    with _insecure_serialization(), _unset_if(CPU_BIND, config.data_parallel_size > 1):
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`engine`: a test whose fixtures build the tiny model (every engine, in this process or
    another, is of it); `process`: such a test of PROCESS_MODULES. `pytest -m "not engine"` is
    the quick gate. PROCESS_MODULES run first, the longest modules of the suite: `make test`
    shares them out among its workers (pytest-xdist, by module) before the many short ones."""
    first = {module: i for i, module in enumerate(PROCESS_MODULES)}
    items.sort(key=lambda item: first.get(_module_name(item), len(first)))
    for item in items:
        module = _module_name(item)
        uses_model = "tiny_model_dir" in getattr(item, "fixturenames", ())
        if uses_model:
            item.add_marker(pytest.mark.engine)
            if module in PROCESS_MODULES:
                item.add_marker(pytest.mark.process)


def _module_name(item: pytest.Item) -> str:
    return item.module.__name__ if isinstance(item, pytest.Function) else ""


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
        kv_cache_gib=KV_CACHE_GIB,
        # As `rlserve serve --metrics-port` starts it: vLLM's own metrics recorded.
        vllm_metrics=True,
    )


class Engines:
    """One real engine per distinct configuration, started on first use and shared by every
    module that asks for that configuration (an engine starts in tens of seconds on two cores).
    At most MAX_LIVE run at once: the plain one, which the session's server serves, is kept,
    and a start past the cap shuts down the longest unused engine no fixture of the running
    module has asked for (a module later asking for it again waits for a new start). Weights
    a module syncs stay served after it: a module that needs the checkpoint's weights first
    syncs them itself.

    Every engine accepts pickled callables, so that a module can reach into a worker with
    `collective_rpc(callable)` to stage an edge a real engine never reaches by itself; no test
    relies on an engine refusing them. Servers the tests start as processes of their own
    (`rlserve serve`, the demo, fleets in namespaces, Ray) run as in production, without it."""

    # About 1.45 GB resident each (engine core and worker, with the tests' KV cache): a
    # session that kept all six configurations it meets held 11 GB with the old 0.5 GiB
    # caches, and two sessions side by side (pytest -n 2) ran the machine out of memory.
    # With three, a two-process run's peak was 17.8-20.0 GB of 23.5 (Ray kills actors at
    # 95%); with two, 15.0-17.8 GB (the servers the process modules start make the peak),
    # for three more engine starts and runs of 879-975 s against 837-840.
    MAX_LIVE = 3
    PLAIN: tuple = ()
    module = ""  # the module running now (`_running_module`)

    def __init__(self, base: EngineConfig) -> None:
        _pickle_in_this_process()
        self._base = base
        # By the overrides (EngineConfig holds dicts), the least recently asked for first.
        self._started: OrderedDict[tuple, Any] = OrderedDict()
        self._asked_by: dict[tuple, str] = {}  # the module that last asked for each
        self._lock = asyncio.Lock()

    async def get(self, **overrides: Any) -> Any:
        """The session's engine (an EngineAdapter) for the base config with `overrides`."""
        from rlserve.engine.adapter import EngineAdapter
        from rlserve.server.app import freeze_startup_heap

        config, key = replace(self._base, **overrides), tuple(sorted(overrides.items()))
        async with self._lock:
            if key not in self._started:
                await self._make_room()
                with _launch_env(config):
                    self._started[key] = await asyncio.to_thread(EngineAdapter.start, config)
                # As `rlserve serve` does once its engine serves. The servers the tests run in
                # this process share its heap with every module and engine the session has
                # loaded; unfrozen, each full collection walks all of it with their event loop
                # stopped (0.02-0.42 s with one engine, growing with the session).
                freeze_startup_heap()
            self._started.move_to_end(key)
            self._asked_by[key] = self.module
            return self._started[key]

    async def _make_room(self) -> None:
        while len(self._started) >= self.MAX_LIVE:
            idle = [k for k in self._started if k != self.PLAIN and self._asked_by[k] != self.module]
            if not idle:
                return
            await _stop(self._started.pop(idle[0]))
            del self._asked_by[idle[0]]

    @contextlib.asynccontextmanager
    async def own(self, **overrides: Any) -> AsyncIterator[Any]:
        """An engine of its own for one module or test (one it kills, or the second of two
        alike), shut down when the block ends."""
        from rlserve.engine.adapter import EngineAdapter

        config = replace(self._base, **overrides)
        with _launch_env(config):
            adapter = await asyncio.to_thread(EngineAdapter.start, config)
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


@pytest.fixture(scope="module", autouse=True)
def _running_module(request: pytest.FixtureRequest) -> None:
    """Tells the session's engines which module runs: the engines it asks for stay up."""
    Engines.module = request.module.__name__


@pytest_asyncio.fixture(scope="session")
async def engine(engines: Engines):
    return await engines.get()


@pytest_asyncio.fixture(scope="module")
async def wt_engine(engines: Engines):
    return await engines.get(weight_transfer_backend="rlserve_gloo")


@pytest_asyncio.fixture(scope="module")
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
def _insecure_serialization() -> Iterator[None]:
    """While set, the engines this process starts pickle what msgpack cannot carry (vLLM's
    VLLM_ALLOW_INSECURE_SERIALIZATION, which their processes inherit when spawned)."""
    with _env(INSECURE_SERIALIZATION, "1"):
        yield


@contextlib.contextmanager
def _unset_if(name: str, condition: bool) -> Iterator[None]:
    with _env(name, None) if condition else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """The environment variable `name` set to `value` (None: unset) for the block."""
    before = os.environ.get(name)
    _set_env(name, value)
    try:
        yield
    finally:
        _set_env(name, before)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


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
