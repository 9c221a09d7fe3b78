"""Several frontend processes over one engine (`rlserve serve --frontends N`), for frontend CPU
beyond one core. The process `rlserve serve` runs leads: it launches the engine for all of
them, owns the lifecycle, the control plane, the audit and the metrics, and starts the others.
Each following process is its own engine client and gRPC server on the same inference port
(SO_REUSEPORT: the kernel spreads connections over the processes), and asks the leader to
admit every request, so a pause holds requests in every process and Abort reaches them all.
A following process (it runs `rlserve.server.app.run_follower`) ends with the leader; one
that dies has its requests aborted and is not replaced (the port stays served by the others).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rlserve.config import ServeConfig
from rlserve.engine.adapter import EngineAdapter, engine_args
from rlserve.engine.shared import FrontendClient, SharedEngine
from rlserve.frontends.leader import FrontendHub
from rlserve.lifecycle.state import LifecycleState

if TYPE_CHECKING:
    from rlserve.lifecycle.controller import LifecycleController

logger = logging.getLogger(__name__)

# A following process still there this long after the grace period is killed.
STOP_MARGIN_S = 5.0
PROCESS_TITLE = "rlserve::frontend"


# What a following process runs: (config, its engine client, the leader's socket, the server's
# instance id); a module-level function, so that spawn can start it.
FollowerMain = Callable[[ServeConfig, FrontendClient, str, str], None]


class Frontends:
    """The leader's side: the shared engine, the hub the others talk to, their processes."""

    def __init__(self, config: ServeConfig, follower_main: FollowerMain) -> None:
        self._config = config
        self._follower_main = follower_main
        self._engine: SharedEngine | None = None
        self._hub: FrontendHub | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="rlserve-frontends-")
        self._processes: list[multiprocessing.process.BaseProcess] = []

    async def launch_engine(self) -> EngineAdapter:
        """Launch the engine for every frontend; returns the leader's own engine client."""
        config = self._config.engine
        self._engine = shared = await asyncio.to_thread(
            SharedEngine, engine_args(config), self._config.num_frontends, config.log_stats
        )
        engine = await asyncio.to_thread(EngineAdapter.connect, config, shared.clients[0], shared.vllm_config)
        loop = asyncio.get_running_loop()
        shared.watch(lambda reason: loop.call_soon_threadsafe(engine.monitor.declare_dead, reason))
        return engine

    async def start(
        self,
        lifecycle: LifecycleController,
        engine: EngineAdapter,
        port: int,
        serving: Callable[[LifecycleState], bool],
        observe_rpc: Callable[[str, str, float], None],
    ) -> None:
        """Listen for the other frontends, then start them on the inference `port`."""
        assert self._engine is not None
        path = str(Path(self._dir.name) / "leader.sock")
        self._hub = FrontendHub(lifecycle, path, engine.abort_internal, serving, observe_rpc)
        await self._hub.start()
        config = replace(self._config, port=port, metrics_port=None, exit_with_parent=True)
        spawn = multiprocessing.get_context("spawn")
        for client in self._engine.clients[1:]:
            process = spawn.Process(
                target=self._follower_main,
                args=(config, client, path, engine.instance_id),
                name=f"rlserve-frontend-{client.index}",
            )
            process.start()
            self._processes.append(process)
        # The sockets went to the processes that use them.
        for client in self._engine.clients[1:]:
            client.addresses["input_listener"].close()
            client.addresses["output_listener"].close()
        logger.info("started %d more frontend processes on port %d", len(self._processes), port)

    def reload_credentials(self) -> None:
        """SIGHUP to every frontend that has joined: it handles the signal by then (one still
        starting reads the tokens file as it starts)."""
        for pid in self._hub.pids() if self._hub is not None else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)

    async def stop(self, grace_s: float) -> None:
        """Each following process drains its own streams for `grace_s`, as this one does."""
        for process in self._processes:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        await asyncio.to_thread(self._join, grace_s + STOP_MARGIN_S)
        if self._hub is not None:
            await self._hub.close()

    def _join(self, timeout_s: float) -> None:
        for process in self._processes:
            process.join(timeout_s)
            if process.is_alive():
                logger.warning("frontend process %d did not stop in time: killing it", process.pid)
                process.kill()
                process.join()

    def shutdown_engine(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
        self._dir.cleanup()
