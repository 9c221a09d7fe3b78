"""The servicers' handle on the engine, which arrives only once it has started."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlserve.errors import EngineUnavailable

if TYPE_CHECKING:
    from rlserve.engine.adapter import EngineAdapter


class EngineSlot:
    """Holds the engine adapter; RPCs before it is set (or after shutdown) get UNAVAILABLE."""

    def __init__(self) -> None:
        self._engine: EngineAdapter | None = None
        self._reason = "the engine is starting; retry when health reports SERVING"

    @property
    def engine(self) -> EngineAdapter:
        if self._engine is None:
            raise EngineUnavailable(self._reason)
        return self._engine

    def set(self, engine: EngineAdapter) -> None:
        self._engine = engine

    def clear(self, reason: str) -> None:
        self._engine, self._reason = None, reason
