"""Several frontend processes over one engine (`rlserve serve --frontends N`), for frontend CPU
beyond one core. The process `rlserve serve` runs leads: it launches the engine for all of
them, owns the lifecycle, the control plane, the credentials, the audit and the metrics, and
starts the others. Each following process is its own engine client and gRPC server on the
same inference port (SO_REUSEPORT: the kernel spreads connections over the processes), takes
its credentials from the leader, and asks the leader to admit every request, so a pause holds
requests in every process and Abort reaches them all.

The leader supervises them by their processes (a process's sentinel, not its stream, says it
died): a dead frontend's requests are aborted in the engine at once, whatever it left behind
in its process group is killed, and it is started again after a bounded back-off on a spare
engine socket pair, up to `max_frontend_restarts` times. A following process (it runs
`rlserve.server.app.run_follower`) ends with the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rlserve.config import ServeConfig
from rlserve.engine.adapter import EngineAdapter
from rlserve.engine.args import engine_args
from rlserve.engine.shared import FrontendClient, SharedEngine
from rlserve.frontends.leader import FrontendHub
from rlserve.lifecycle.state import LifecycleState

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from rlserve.lifecycle.controller import LifecycleController
    from rlserve.server.auth import CredentialSource
    from rlserve.server.metrics import Metrics

logger = logging.getLogger(__name__)

# A following process still there this long after the grace period is killed.
STOP_MARGIN_S = 5.0
PROCESS_TITLE = "rlserve::frontend"
# Seconds before the n-th restart of one frontend (the last one repeats).
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


# What a following process runs: (config, its engine client, the leader's socket, the server's
# instance id, its frontend number); a module-level function, so that spawn can start it.
FollowerMain = Callable[[ServeConfig, FrontendClient, str, str, int], None]


@dataclass(eq=False)
class _Seat:
    """Frontend `index` (1..N-1): its current process and how often it was replaced."""

    index: int
    process: BaseProcess
    num_restarts: int = 0
    supervisor: asyncio.Task[None] | None = None


class Frontends:
    """The leader's side: the shared engine, the hub the others talk to, their processes."""

    def __init__(self, config: ServeConfig, follower_main: FollowerMain) -> None:
        self._config = config
        self._follower_main = follower_main
        self._engine: SharedEngine | None = None
        self._hub: FrontendHub | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="rlserve-frontends-")
        self._path = str(Path(self._dir.name) / "leader.sock")
        self._seats: dict[int, _Seat] = {}
        self._instance_id = ""
        self._metrics: Metrics | None = None
        self._stopping = False
        self._all_ready = asyncio.Event()

    async def launch_engine(self) -> EngineAdapter:
        """Launch the engine for every frontend; returns the leader's own engine client."""
        config = self._config.engine
        self._engine = shared = await asyncio.to_thread(
            SharedEngine,
            engine_args(config),
            self._config.num_frontends,
            config.log_stats,
            self._config.max_frontend_restarts,
        )
        engine = await asyncio.to_thread(EngineAdapter.connect, config, shared.clients[0], shared.vllm_config)
        loop = asyncio.get_running_loop()
        shared.watch(lambda reason: _call_soon(loop, engine.monitor.declare_dead, reason))
        return engine

    async def start(
        self,
        lifecycle: LifecycleController,
        engine: EngineAdapter,
        port: int,
        serving: Callable[[LifecycleState], bool],
        credentials: CredentialSource | None,
        metrics: Metrics,
    ) -> None:
        """Listen for the other frontends, then start them on the inference `port`."""
        assert self._engine is not None
        self._metrics = metrics
        self._instance_id = engine.instance_id
        self._hub = FrontendHub(
            lifecycle,
            self._path,
            engine.abort_internal,
            serving,
            metrics.observe_rpc,
            engine.load.merge if engine.load is not None else lambda load: None,
            lambda: credentials.text if credentials is not None else None,
            lambda index: self._seats[index].num_restarts if index in self._seats else 0,
            self._config.num_frontends,
        )
        self._hub.on_ready = self._joined
        await self._hub.start()
        self._config = replace(self._config, port=port, metrics_port=None, exit_with_parent=True)
        for client in self._engine.clients[1 : self._config.num_frontends]:
            seat = self._seats[client.index] = _Seat(client.index, self._spawn(client.index, client))
            seat.supervisor = asyncio.ensure_future(self._supervise(seat))
        metrics.frontends_serving.set(1)
        logger.info("starting %d more frontend processes on port %d", len(self._seats), port)

    async def wait_ready(self) -> None:
        """Until every frontend serves the inference port (each restarted as needed)."""
        await self._all_ready.wait()

    def _joined(self, index: int) -> None:
        ready = self._hub.ready_indexes() if self._hub is not None else set()
        if self._metrics is not None:
            self._metrics.frontends_serving.set(1 + len(ready))
        if ready >= set(self._seats):
            self._all_ready.set()

    def _spawn(self, index: int, client: FrontendClient) -> BaseProcess:
        process = multiprocessing.get_context("spawn").Process(
            target=self._follower_main,
            args=(self._config, client, self._path, self._instance_id, index),
            name=f"rlserve-frontend-{index}",
        )
        process.start()
        # The sockets went to the process that uses them; nobody else may take this pair.
        client.addresses["input_listener"].close()
        client.addresses["output_listener"].close()
        return process

    async def _supervise(self, seat: _Seat) -> None:
        """Watch seat's process; when it exits unasked, clean up after it and start another."""
        while True:
            process = seat.process
            await _exited(process)
            if self._stopping:
                return
            await asyncio.to_thread(process.join)  # reaped only now: its pid is not reused before
            pid, code = process.pid or 0, process.exitcode
            # Whatever it started and left behind (holding its sockets) goes with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            assert self._hub is not None and self._engine is not None and self._metrics is not None
            await self._hub.process_gone(seat.index, pid)
            self._joined(seat.index)
            client = self._engine.take_spare()
            if client is None:
                logger.error(
                    "frontend %d (pid %d) exited with %s and is not restarted: its %d restarts are used "
                    "(--max-frontend-restarts); the other frontends serve the port",
                    seat.index,
                    pid,
                    code,
                    seat.num_restarts,
                )
                return
            delay = RESTART_BACKOFF_S[min(seat.num_restarts, len(RESTART_BACKOFF_S) - 1)]
            logger.warning(
                "frontend %d (pid %d) exited with %s; starting it again in %.0f s", seat.index, pid, code, delay
            )
            await asyncio.sleep(delay)
            if self._stopping:
                return
            seat.num_restarts += 1
            self._metrics.frontend_restarts.labels(str(seat.index)).inc()
            seat.process = self._spawn(seat.index, client)

    def reload_credentials(self) -> None:
        """The leader reloaded its credentials: every frontend takes them."""
        if self._hub is not None:
            self._hub.push_credentials()

    async def stop(self, grace_s: float) -> None:
        """Each following process drains its own streams for `grace_s`, as this one does."""
        self._stopping = True
        for seat in self._seats.values():
            if seat.supervisor is not None:
                seat.supervisor.cancel()
            process = seat.process
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        await asyncio.to_thread(self._join, grace_s + STOP_MARGIN_S)
        if self._hub is not None:
            await self._hub.close()

    def _join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for seat in self._seats.values():
            process = seat.process
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.warning("frontend process %d did not stop in time: killing it", process.pid)
                process.kill()
                process.join()

    def shutdown_engine(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
        self._dir.cleanup()


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[str], None], reason: str) -> None:
    """From another thread: `callback(reason)` on `loop`."""
    loop.call_soon_threadsafe(callback, reason)


async def _exited(process: BaseProcess) -> None:
    """Until `process` exits (its sentinel turns readable), however it ends."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(process.sentinel, lambda: None if done.done() else done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(process.sentinel)
