"""The one owner of lifecycle state: the immutable `LifecycleState`, the lock that orders
every mutation, the bounded audit ring and the change feed. No engine, no grpc: the
controller and the weight updates change state only through here."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Iterator

from rlserve.lifecycle.state import AuditEntry, LifecycleState

AUDIT_LENGTH = 256


class StateOwner:
    def __init__(self, initial_version: str) -> None:
        self._state = LifecycleState(weight_version=initial_version)
        # Every mutation holds this while it checks, calls the engine and publishes.
        self.lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._audit: collections.deque[AuditEntry] = collections.deque(maxlen=AUDIT_LENGTH)
        self._sequence = 0

    @property
    def state(self) -> LifecycleState:
        return self._state

    def publish(self, **changes: object) -> LifecycleState:
        self._state = self._state.evolve(**changes)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return self._state

    async def next_change(self) -> LifecycleState:
        await self._changed.wait()
        return self._state

    async def watch(self) -> AsyncIterator[LifecycleState]:
        """The current state, then each newer one; a slow reader skips to the latest."""
        while True:
            changed = self._changed
            yield self._state
            await changed.wait()

    @contextlib.contextmanager
    def audited(self, operation: str, detail: str) -> Iterator[list[str]]:
        """Record the operation with its outcome: "ok", what the body appends (e.g. "noop"),
        or the name of the error it raised."""
        outcome: list[str] = []
        try:
            yield outcome
        except BaseException as e:
            self.record(operation, detail, type(e).__name__)
            raise
        self.record(operation, detail, outcome[0] if outcome else "ok")

    def record(self, operation: str, detail: str, outcome: str) -> None:
        self._sequence += 1
        self._audit.append(AuditEntry(self._sequence, operation, detail, outcome, time.time()))

    def audit_log(self) -> tuple[AuditEntry, ...]:
        return tuple(self._audit)
