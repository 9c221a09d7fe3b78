"""One vLLM engine core for several frontend processes, as `vllm serve --api-server-count N`
lays them out: the leading process binds one input and one output socket per frontend,
launches the engine core (it connects to all of them), and each frontend process makes its
`AsyncLLM` on its own pair (`client_index`). The engine routes each request's outputs to the
frontend that sent it; pause, abort and the weight transport act on the whole engine.

A frontend process that dies cannot be replaced on its own pair: the engine greets each
frontend once, when it starts, and a new `AsyncLLM` waits for that greeting. So the engine is
launched with spare pairs (the greeting waits in each until a frontend takes it): a replaced
frontend takes a spare one.

Owns the launch and the engine processes' lifetime; not the frontend processes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm import AsyncEngineArgs

from rlserve.engine.process_group import SocketDir, engine_in_own_group
from rlserve.engine.vllm_compat import (
    bind_frontend_sockets,
    engine_exit_codes,
    engine_sentinels,
    frontend_engine_config,
    launch_engine_cores,
)
from rlserve.parent import how_it_ended

logger = logging.getLogger(__name__)


@dataclass
class FrontendClient:
    """What frontend `index` of `count` needs to reach the engine (its sockets travel to a
    spawned process with it)."""

    index: int
    count: int
    addresses: dict[str, Any]


class SharedEngine:
    """The engine processes launched for `count` frontends (and `num_spare` spare socket
    pairs, for frontends that replace one that died), and their sockets."""

    def __init__(self, args: AsyncEngineArgs, count: int, log_stats: bool, num_spare: int = 0) -> None:
        total = count + num_spare
        self.vllm_config = frontend_engine_config(args, total, -1)
        self._sockets = SocketDir()
        with self._sockets.in_use():
            # Kept: collecting it closes every socket and removes their paths.
            self._listeners = listeners = bind_frontend_sockets(self.vllm_config, total)
            with engine_in_own_group():
                with launch_engine_cores(self.vllm_config, log_stats, listeners.addresses) as launch:
                    pass  # the block's end waits for the engine to start
        self._manager = launch.engine_manager
        self._coordinator = launch.coordinator
        stats = self._coordinator.get_stats_publish_address() if self._coordinator is not None else None
        self.clients = [
            FrontendClient(
                index,
                total,
                {
                    "input_address": inputs.address,
                    "output_address": outputs.address,
                    "input_listener": inputs.socket,
                    "output_listener": outputs.socket,
                    "client_count": total,
                    "client_index": index,
                    **({"stats_update_address": stats} if stats else {}),
                },
            )
            for index, (inputs, outputs) in enumerate(zip(listeners.inputs, listeners.outputs, strict=True))
        ]
        # Frontends 1.. of the first start take the pairs after frontend 0's; the rest wait.
        self.spares = self.clients[count:]
        self._closing = threading.Event()

    def take_spare(self) -> FrontendClient | None:
        """A pair no frontend has used yet, for one that replaces a dead one (None: none left)."""
        return self.spares.pop(0) if self.spares else None

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """`on_exit(reason)` from a thread of its own once an engine process exits unasked
        (an engine client with engines it did not launch does not notice that itself)."""
        sentinels = engine_sentinels(self._manager) if self._manager is not None else []

        def wait() -> None:
            from multiprocessing.connection import wait as wait_for

            wait_for(sentinels)
            if not self._closing.is_set():
                on_exit("the engine core process exited; restart the server")

        if sentinels:
            threading.Thread(target=wait, name="rlserve-engine-watch", daemon=True).start()

    def shutdown(self) -> None:
        self._closing.set()
        if self._manager is not None:
            self._manager.shutdown()
            log_engine_exits(self._manager)
        if self._coordinator is not None:
            self._coordinator.shutdown()
        self._listeners.cleanup()
        self._sockets.remove()


def log_engine_exits(manager: Any) -> None:
    """After a shutdown: how each engine process ended (vLLM SIGKILLs one still running 5 s
    after it sent SIGTERM)."""
    for name, code in engine_exit_codes(manager).items():
        if code == 0:
            logger.info("engine process %s exited cleanly", name)
        else:
            ended = "is still running" if code is None else f"ended with {how_it_ended(code)}"
            logger.warning("engine process %s %s", name, ended)
