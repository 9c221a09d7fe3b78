"""Every reach of the server's process past vLLM's public `AsyncLLM` API, in one place, for the
vLLM minor version rlserve pins (pyproject: 0.32). Importing this module on another minor fails
loudly, naming what to re-check; the worker side has its own (`rlserve.worker.vllm_compat`).

Each function says why rlserve needs the reach and what breaks if vLLM moves it. The rest of
`engine/` speaks `AsyncLLM`'s public methods and calls these for everything else."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import vllm
from vllm import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.utils import CoreEngineProcManager, bind_engine_zmq_listeners, launch_core_engines
from vllm.v1.executor import Executor

from rlserve.config import check_vllm_version

REACHES = (
    "AsyncEngineArgs._api_process_count / _api_process_rank (several frontends)",
    "vllm.v1.engine.utils.bind_engine_zmq_listeners / launch_core_engines (several frontends)",
    "CoreEngineProcManager.sentinels / .processes (a shared engine's exit; how each engine process ended)",
    "AsyncLLM.engine_core.resources.engine_manager (how the engine processes it started ended)",
    "AsyncLLM.engine_core: pause_scheduler_async, reset_prefix_cache_async, abort_requests_async, "
    "call_utility_all_async (pause without a fixed sleep, per-engine state, collective_rpc)",
    "AsyncLLM.output_handler (a clean shutdown)",
)


def check_version(version: str) -> None:
    """Raises RuntimeError unless `version` (vllm.__version__) is of the pinned minor."""
    check_vllm_version(version, REACHES, other_side="rlserve.worker.vllm_compat")


check_version(vllm.__version__)


# Several frontend processes over one engine (rlserve.engine.shared) ------------------------


def frontend_engine_config(args: AsyncEngineArgs, count: int, index: int) -> Any:
    """The vLLM config of frontend `index` of `count` (-1: the launcher). vLLM sets these two
    private fields only from `vllm serve --api-server-count`; without them each frontend's
    engine client would expect to be the only one."""
    args._api_process_count = count
    args._api_process_rank = index
    return args.create_engine_config(UsageContext.OPENAI_API_SERVER)


def bind_frontend_sockets(vllm_config: Any, count: int) -> Any:
    """One input and one output socket per frontend (vLLM's own multi-API-server helper)."""
    return bind_engine_zmq_listeners(vllm_config, count)


@contextmanager
def launch_engine_cores(vllm_config: Any, log_stats: bool, addresses: Any) -> Iterator[Any]:
    """Launch the engine core processes connected to `addresses`; the block's end waits for
    them to start. Yields vLLM's launch record (`engine_manager`, `coordinator`)."""
    with launch_core_engines(vllm_config, Executor.get_class(vllm_config), log_stats, addresses) as launch:
        yield launch


def engine_sentinels(manager: Any) -> list[Any]:
    """The engine processes' sentinels, readable once one exits; none for managers that do not
    run local processes (Ray's), which rlserve never launches."""
    return manager.sentinels() if isinstance(manager, CoreEngineProcManager) else []


def engine_exit_codes(manager: Any) -> dict[str, int | None]:
    """Per engine process `manager` launched, by vLLM's name for it: its exit code (negative:
    the signal that ended it; None: still running). Empty for managers that run no local
    processes."""
    if not isinstance(manager, CoreEngineProcManager):
        return {}
    return {proc.name: proc.exitcode for proc in manager.processes}


def engine_manager(llm: Any) -> Any:
    """The launch record of the engine processes `llm` started itself (None when it connected
    to engines another process launched)."""
    return getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)


# Past AsyncLLM to its engine-core client (rlserve.engine.adapter, rlserve.engine.transport) ---


async def pause_scheduler(llm: Any, mode: str, clear_cache: bool) -> None:
    """`AsyncLLM.pause_generation` sleeps a fixed time before it pauses; the engine core's own
    call returns once every engine is idle."""
    await llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)


async def reset_prefix_cache_everywhere(llm: Any) -> bool:
    """Also the blocks of running (kept) requests: after a weight update no KV computed with
    the old weights may be reused. AsyncLLM's own reset keeps those."""
    return bool(await llm.engine_core.reset_prefix_cache_async(reset_running_requests=True))


async def abort_internal_requests(llm: Any, internal_ids: list[str]) -> None:
    """By vLLM's internal ids, whichever frontend submitted them (AsyncLLM aborts only its own)."""
    await llm.engine_core.abort_requests_async(internal_ids)


async def call_every_engine(llm: Any, method: str, *args: Any) -> list[Any]:
    """A utility method on every data-parallel engine core, one reply each (AsyncLLM's public
    calls answer for the first engine only)."""
    return list(await llm.engine_core.call_utility_all_async(method, *args))


async def collective_rpc_everywhere(llm: Any, method: str, args: tuple[Any, ...]) -> list[list[Any]]:
    """`collective_rpc(method, args)` on every worker of every engine: per engine, per worker."""
    return await call_every_engine(llm, "collective_rpc", method, None, args, None)


def cancel_output_handler(llm: Any) -> None:
    """vLLM cancels its output handler only after the engine has stopped, from the thread that
    stops it: the handler could see the engine gone first and log a clean shutdown as a failure."""
    handler = getattr(llm, "output_handler", None)
    if handler is not None:
        handler.cancel()
