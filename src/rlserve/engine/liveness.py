"""Engine liveness: the one place that decides that the engine is dead.

vLLM reports a dead engine-core process (EngineDeadError), but not an engine that still runs
and takes no work (its input thread died, a worker is stuck). The monitor probes the engine
with a cheap call once per `interval_s` (a heartbeat, so a period is the point) and declares it
dead when a probe fails, or stays unanswered past the hang timeout, extended while rlserve
itself runs a long engine call (`busy`). Every engine call of the adapter races the monitor
(`guard`), so none outlives a dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from rlserve.errors import EngineUnavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineMonitor:
    def __init__(
        self,
        probe: Callable[[], Awaitable[object]],
        *,
        hang_timeout_s: float,
        errored: Callable[[], bool] = lambda: False,
        dead_errors: tuple[type[BaseException], ...] = (),
        interval_s: float = 1.0,
    ) -> None:
        self._probe = probe
        # The engine's own verdict (vLLM notices a dead engine process at once), checked on
        # every beat: a call to a dead engine may never return.
        self._errored = errored
        # What the engine raises once it is dead: any call may be the first to see it.
        self._dead_errors = dead_errors
        self._hang_timeout_s = hang_timeout_s
        self._interval_s = interval_s
        self._dead = asyncio.Event()
        self._reason = ""
        self._busy_deadline = 0.0
        self._listeners: list[Callable[[str], None]] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def is_dead(self) -> bool:
        return self._dead.is_set()

    @property
    def reason(self) -> str:
        return self._reason

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="rlserve-engine-monitor")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def on_dead(self, listener: Callable[[str], None]) -> None:
        """`listener(reason)` runs once, when the engine is declared dead."""
        self._listeners.append(listener)

    def declare_dead(self, reason: str) -> None:
        if self._dead.is_set():
            return
        self._reason = f"the engine is dead ({reason}); restart the server"
        logger.error("%s", self._reason)
        self._dead.set()
        for listener in self._listeners:
            try:
                listener(self._reason)
            except Exception:  # one failing listener must not keep the others from hearing it
                logger.exception("an engine-death listener failed")

    @contextlib.contextmanager
    def busy(self, timeout_s: float) -> Iterator[None]:
        """A call that may keep the engine from answering probes for up to `timeout_s`."""
        loop = asyncio.get_running_loop()
        self._busy_deadline = max(self._busy_deadline, loop.time() + timeout_s + self._hang_timeout_s)
        try:
            yield
        finally:
            # A probe queued behind the call is answered right after it: give it a fresh wait.
            self._busy_deadline = max(self._busy_deadline, loop.time() + self._hang_timeout_s)

    def check_alive(self) -> None:
        """Raises EngineUnavailable once the engine is dead (asking vLLM first)."""
        if not self._dead.is_set() and self._errored():
            self.declare_dead("its process exited")
        if self._dead.is_set():
            raise EngineUnavailable(self._reason)

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, or raise EngineUnavailable as soon as the engine is dead."""
        if not self._dead.is_set() and self._errored():
            self.declare_dead("its process exited")
        if self._dead.is_set():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise EngineUnavailable(self._reason)
        task = asyncio.ensure_future(awaitable)
        dead = asyncio.ensure_future(self._dead.wait())
        try:
            await asyncio.wait((task, dead), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            dead.cancel()
        if not task.done():
            task.cancel()
            raise EngineUnavailable(self._reason)
        error = task.exception()
        if isinstance(error, self._dead_errors):
            self.declare_dead(f"{type(error).__name__}: {error}")
            raise EngineUnavailable(self._reason) from error
        return task.result()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._dead.is_set():
            probe = asyncio.ensure_future(self._probe())
            started = loop.time()
            while not probe.done():
                if self._errored():
                    probe.cancel()
                    self.declare_dead("its process exited")
                    return
                deadline = max(started + self._hang_timeout_s, self._busy_deadline)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    probe.cancel()
                    self.declare_dead(f"no answer for {loop.time() - started:.0f} s")
                    return
                await asyncio.wait((probe,), timeout=min(remaining, self._interval_s))
            if probe.cancelled():
                return
            error = probe.exception()
            if error is not None:
                self.declare_dead(f"{type(error).__name__}: {error}")
                return
            await asyncio.sleep(self._interval_s)
            if self._errored():
                self.declare_dead("its process exited")
                return
