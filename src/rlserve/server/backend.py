"""The servicers' handle on the engine and its lifecycle controller, which arrive only once
the engine has started."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlserve.errors import EngineUnavailable

if TYPE_CHECKING:
    from rlserve.engine.adapter import EngineAdapter
    from rlserve.lifecycle.controller import LifecycleController


class EngineSlot:
    """RPCs before the engine is set, once it is dead, or after shutdown get UNAVAILABLE.

    Every access asks the engine's monitor first, so a call that reads no engine state (IsPaused)
    fails like the rest in the moment between vLLM's verdict and the slot being cleared."""

    def __init__(self) -> None:
        self._engine: EngineAdapter | None = None
        self._lifecycle: LifecycleController | None = None
        self._reason = "the engine is starting; retry when health reports SERVING"

    @property
    def engine(self) -> EngineAdapter:
        if self._engine is None:
            raise EngineUnavailable(self._reason)
        self._engine.monitor.check_alive()
        return self._engine

    @property
    def lifecycle(self) -> LifecycleController:
        if self._engine is None or self._lifecycle is None:
            raise EngineUnavailable(self._reason)
        self._engine.monitor.check_alive()
        return self._lifecycle

    @property
    def is_set(self) -> bool:
        return self._engine is not None

    @property
    def engine_or_none(self) -> EngineAdapter | None:
        return self._engine

    @property
    def lifecycle_or_none(self) -> LifecycleController | None:
        return self._lifecycle

    def set(self, engine: EngineAdapter, lifecycle: LifecycleController) -> None:
        self._engine, self._lifecycle = engine, lifecycle

    def clear(self, reason: str) -> None:
        self._engine, self._lifecycle, self._reason = None, None, reason
