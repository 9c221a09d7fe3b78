"""The one owner of lifecycle state: the immutable `LifecycleState`, the lock that orders
every mutation, the bounded audit ring and the change feed. No engine, no grpc: the
controller and the weight updates change state only through here."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Protocol

from rlserve.caller import CURRENT
from rlserve.lifecycle.state import AuditEntry, LifecycleState

logger = logging.getLogger(__name__)

AUDIT_LENGTH = 256


class Observer(Protocol):
    """Sees every change, in order and synchronously (unlike `watch`, which may skip states):
    each published state with the one before it, then the audit entry of the mutation that
    published it. Must be quick and must not call back into the owner (metrics)."""

    def published(self, before: LifecycleState, after: LifecycleState) -> None: ...

    def recorded(self, entry: AuditEntry) -> None: ...


class StateOwner:
    def __init__(self, initial_version: str, check_alive: Callable[[], None] = lambda: None) -> None:
        """`check_alive()` raises when the engine is gone: every audited mutation calls it
        first, so none answers OK on a dead engine (not even one that changes nothing)."""
        self._state = LifecycleState(weight_version=initial_version)
        self.check_alive = check_alive
        # Every mutation holds this while it checks, calls the engine and publishes.
        self.lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._audit: collections.deque[AuditEntry] = collections.deque(maxlen=AUDIT_LENGTH)
        self._sequence = 0
        self._observers: list[Observer] = []

    @property
    def state(self) -> LifecycleState:
        return self._state

    def observe(self, observer: Observer) -> None:
        """`observer` sees the current state (as a change from itself), then every change."""
        self._observers.append(observer)
        observer.published(self._state, self._state)

    def publish(self, edit: Callable[[LifecycleState], LifecycleState]) -> None:
        """Apply `edit` (a `LifecycleState` transition, or several chained) to the current
        state, as one change with the next revision: built from the state as it is now, so
        an edit computed before an await cannot undo a change made meanwhile."""
        before = self._state
        self._state = replace(edit(before), revision=before.revision + 1)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        self._tell(lambda o: o.published(before, self._state))

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
            self.check_alive()
            yield outcome
        except BaseException as e:
            self.record(operation, detail, type(e).__name__)
            raise
        self.record(operation, detail, outcome[0] if outcome else "ok")

    def record(self, operation: str, detail: str, outcome: str) -> None:
        """Appended with the current caller (see `rlserve.caller`)."""
        self._sequence += 1
        entry = AuditEntry(self._sequence, operation, detail, outcome, time.time(), CURRENT.get().describe())
        self._audit.append(entry)
        self._tell(lambda o: o.recorded(entry))

    def audit_log(self) -> tuple[AuditEntry, ...]:
        return tuple(self._audit)

    def _tell(self, event: Callable[[Observer], None]) -> None:
        for observer in self._observers:
            try:
                event(observer)
            except Exception:  # an observer's bug must not fail the mutation it watches
                logger.exception("a lifecycle observer failed")
