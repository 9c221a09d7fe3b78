"""The servicers' handle on the engine and on what serves it, which arrive only once the
engine has started: the lifecycle controller in frontend 0 (or the only frontend), a
`FollowerLifecycle` in a following frontend process (see `rlserve.lifecycle.interfaces`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlserve.errors import EngineUnavailable

if TYPE_CHECKING:
    from rlserve.engine.adapter import EngineAdapter
    from rlserve.lifecycle.controller import LifecycleController
    from rlserve.lifecycle.interfaces import Serving


class EngineSlot:
    """RPCs before the engine is set, once it is dead, or after shutdown get UNAVAILABLE.

    Every access asks the engine's monitor first, so a call that reads no engine state (IsPaused)
    fails like the rest in the moment between vLLM's verdict and the slot being cleared."""

    def __init__(self) -> None:
        self._engine: EngineAdapter | None = None
        self._serving: Serving | None = None
        self._controller: LifecycleController | None = None
        self._reason = "the engine is starting; retry when health reports SERVING"

    @property
    def engine(self) -> EngineAdapter:
        if self._engine is None:
            raise EngineUnavailable(self._reason)
        self._engine.monitor.check_alive()
        return self._engine

    @property
    def serving(self) -> Serving:
        """Generation, LoRA listing and audit, in every frontend process."""
        if self._engine is None or self._serving is None:
            raise EngineUnavailable(self._reason)
        self._engine.monitor.check_alive()
        return self._serving

    @property
    def lifecycle(self) -> LifecycleController:
        """The controller, for the control RPCs; a following frontend serves none of those
        (its listener refuses them), so it has none."""
        serving = self.serving
        if self._controller is None:
            raise EngineUnavailable("this frontend process does not serve the control plane")
        assert serving is self._controller
        return self._controller

    @property
    def is_set(self) -> bool:
        return self._engine is not None

    @property
    def engine_or_none(self) -> EngineAdapter | None:
        return self._engine

    @property
    def serving_or_none(self) -> Serving | None:
        return self._serving

    def set(self, engine: EngineAdapter, controller: LifecycleController) -> None:
        self._engine, self._serving, self._controller = engine, controller, controller

    def set_follower(self, engine: EngineAdapter, serving: Serving) -> None:
        self._engine, self._serving, self._controller = engine, serving, None

    def clear(self, reason: str) -> None:
        self._engine, self._serving, self._controller, self._reason = None, None, None, reason
