"""The lifecycle controller: the one owner of pause / sleep / weight-version state.

Every mutation runs under one lock, checks its transition, calls the engine, publishes the new
state and appends to the audit log, in that order. It also gates generation: while paused, new
requests wait here (bounded) until resume. No grpc here; the engine adapter does the vLLM calls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from rlserve.engine.adapter import EngineAdapter
from rlserve.errors import (
    CapabilityMissing,
    PauseSuperseded,
    TooManyHeldRequests,
    VersionMismatch,
    WrongState,
)
from rlserve.lifecycle.mutation import survives_caller_cancellation as _survives_caller_cancellation
from rlserve.lifecycle.weight_updates import DEFAULT_TRANSFER_TIMEOUT_S, WeightUpdates
from rlserve.lifecycle.state import (
    MEMORY_TAGS,
    AuditEntry,
    LifecycleState,
    PauseMode,
    PausePhase,
    SleepTag,
    check_can_resume,
    check_sleep_request,
    check_weight_version,
    parse_wake_tags,
)
from rlserve.types import EngineStatus, GenerateChunk, GenerateParams, RlCapabilities

AUDIT_LENGTH = 256


@dataclass(frozen=True)
class LifecycleSnapshot:
    state: LifecycleState
    engines: tuple[EngineStatus, ...]
    capabilities: RlCapabilities
    recent_mutations: tuple[AuditEntry, ...]


class LifecycleController(WeightUpdates):
    def __init__(
        self,
        engine: EngineAdapter,
        *,
        max_held_requests: int,
        initial_version: str,
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> None:
        self._engine = engine
        self._max_held = max_held_requests
        self._transfer_timeout_s = transfer_timeout_s
        self._state = LifecycleState(weight_version=initial_version)
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._running = asyncio.Event()
        self._running.set()
        self._in_flight = 0
        self._drained = asyncio.Event()
        self._drained.set()
        self._audit: collections.deque[AuditEntry] = collections.deque(maxlen=AUDIT_LENGTH)
        self._audit_sequence = 0

    @classmethod
    async def create(
        cls, engine: EngineAdapter, *, max_held_requests: int, transfer_timeout_s: float
    ) -> LifecycleController:
        return cls(
            engine,
            max_held_requests=max_held_requests,
            initial_version=await engine.weight_version(),
            transfer_timeout_s=transfer_timeout_s,
        )

    @property
    def state(self) -> LifecycleState:
        return self._state

    # Generation -------------------------------------------------------------------------

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerateChunk]:
        """Generate through the admission gate, counting admitted requests until they end
        (a WAIT pause drains them)."""
        admitted = False

        async def admit() -> None:
            nonlocal admitted
            await self._admit()
            admitted = True
            self._in_flight += 1
            self._drained.clear()

        try:
            async for chunk in self._engine.generate(params, admit=admit):
                yield chunk
        finally:
            if admitted:
                self._in_flight -= 1
                if not self._in_flight:
                    self._drained.set()

    async def _admit(self) -> None:
        """Hold a validated request while generation is paused. A held request that is
        cancelled (deadline, client gone) simply leaves; the engine never saw it."""
        if not self._state.is_paused:
            return
        if self._state.num_held_requests >= self._max_held:
            raise TooManyHeldRequests(self._max_held)
        self._publish(num_held_requests=self._state.num_held_requests + 1)
        try:
            while self._state.is_paused:
                await self._running.wait()
        finally:
            self._publish(num_held_requests=self._state.num_held_requests - 1)

    # Pause and resume -------------------------------------------------------------------

    @_survives_caller_cancellation
    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """Return once the engine is idle. Pausing when paused is a no-op unless `mode` is
        stronger (ABORT > WAIT > KEEP), which then applies to what is left.
        Raises PauseSuperseded when generation was resumed before a WAIT drain completed."""
        detail = f"mode={mode.name} clear_cache={clear_cache}"
        async with self._lock:
            with self._audited("pause", detail) as outcome:
                st = self._state
                if st.is_paused and st.pause_mode is not None and mode.strength <= st.pause_mode.strength:
                    outcome.append("noop")
                    wait_for = st.pause_phase is PausePhase.PAUSING
                else:
                    self._running.clear()
                    self._publish(pause_phase=PausePhase.PAUSING, pause_mode=mode)
                    wait_for = mode is PauseMode.WAIT
                    if not wait_for:
                        # Engine calls happen under the lock, so the engine sees them in order.
                        await self._engine.pause(mode.value, clear_cache)
                        self._publish(pause_phase=PausePhase.PAUSED)
        if wait_for:
            await self._drain_then_pause(clear_cache)

    async def _drain_then_pause(self, clear_cache: bool) -> None:
        """WAIT: new requests are already held; let admitted ones finish without holding the
        lock, so a stronger pause or a resume can still come in."""
        while self._in_flight and self._state.pause_phase is PausePhase.PAUSING:
            changed, drained = self._changed, self._drained
            waiters = {asyncio.ensure_future(changed.wait()), asyncio.ensure_future(drained.wait())}
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
        async with self._lock:
            st = self._state
            if not st.is_paused:
                raise PauseSuperseded("generation was resumed before the WAIT pause drained")
            if st.pause_phase is PausePhase.PAUSING:
                # Nothing admitted is left; the engine's own WAIT returns as soon as it is idle.
                await self._engine.pause(PauseMode.WAIT.value, clear_cache)
                self._publish(pause_phase=PausePhase.PAUSED)

    @_survives_caller_cancellation
    async def resume(self) -> None:
        """Raises MemoryAsleep / WeightsInconsistent (FAILED_PRECONDITION). OK when running."""
        async with self._lock:
            with self._audited("resume", "") as outcome:
                st = self._state
                check_can_resume(st)
                if not st.is_paused:
                    outcome.append("noop")
                    return
                await self._engine.resume()
                self._set_running()

    def _set_running(self) -> None:
        self._publish(pause_phase=PausePhase.RUNNING, pause_mode=None)
        self._running.set()

    # Sleep and wake ---------------------------------------------------------------------

    @_survives_caller_cancellation
    async def sleep(self, level: int, mode: PauseMode) -> None:
        """Raises CapabilityMissing without sleep mode, InvalidRequest for a bad level/mode."""
        async with self._lock:
            with self._audited("sleep", f"level={level} mode={mode.name}") as outcome:
                self._require_sleep_mode()
                check_sleep_request(level, mode)
                st = self._state
                if st.update_session is not None:
                    raise WrongState("a weight update is open; finish or abort it before Sleep")
                if st.is_sleeping and level <= st.sleep_level:
                    outcome.append("noop")
                    return
                self._running.clear()
                self._publish(pause_phase=PausePhase.PAUSING, pause_mode=mode)
                await self._engine.sleep(level, mode.value)
                changes: dict[str, object] = {"pause_phase": PausePhase.PAUSED}
                if level >= 1:
                    changes.update(asleep=MEMORY_TAGS, sleep_level=level)
                if level == 2:
                    changes.update(weights_consistent=False, inconsistency_reason="a level-2 sleep discarded them")
                self._publish(**changes)

    @_survives_caller_cancellation
    async def wake_up(self, tags: list[str]) -> None:
        """Wake the named memory (empty: all). Generation resumes when everything is resident
        and the weights are consistent (as upstream); after a level-2 sleep it stays paused
        until new weights arrive. Raises CapabilityMissing, InvalidRequest."""
        async with self._lock:
            with self._audited("wake_up", f"tags={sorted(tags)}") as outcome:
                self._require_sleep_mode()
                wanted = parse_wake_tags(tags)
                st = self._state
                if not st.asleep:
                    outcome.append("noop")
                    return
                names = None if wanted >= MEMORY_TAGS else [t.value for t in wanted if t is not SleepTag.SCHEDULING]
                fully_awake = await self._engine.wake_up(names)
                asleep = frozenset() if fully_awake else st.asleep - wanted
                self._publish(asleep=asleep, sleep_level=st.sleep_level if asleep else 0)
                if fully_awake and self._state.weights_consistent:
                    self._set_running()
                elif fully_awake:
                    # vLLM resumed its scheduler; keep it paused until new weights are loaded.
                    await self._engine.pause(PauseMode.KEEP.value, clear_cache=True)

    def _require_sleep_mode(self) -> None:
        if not self._engine.capabilities().sleep_mode_enabled:
            raise CapabilityMissing(
                "sleep mode is not available: it needs a GPU platform and --enable-sleep-mode "
                "(see rl_capabilities.sleep_mode_enabled)"
            )

    # Weight version ---------------------------------------------------------------------

    @_survives_caller_cancellation
    async def update_weight_version(self, version: str, expected: str | None = None) -> str:
        """Relabel the weights without touching requests; returns the previous version.
        Raises InvalidRequest (empty), VersionMismatch (compare-and-set failed)."""
        detail = f"version={version!r}" + (f" expected={expected!r}" if expected is not None else "")
        async with self._lock:
            with self._audited("update_weight_version", detail) as outcome:
                check_weight_version(version)
                previous = self._state.weight_version
                if expected is not None and expected != previous:
                    raise VersionMismatch(expected, previous)
                if version == previous:
                    outcome.append("noop")
                    return previous
                await self._engine.set_weight_version(version)
                self._publish(weight_version=version)
                return previous

    # Observation ------------------------------------------------------------------------

    async def snapshot(self) -> LifecycleSnapshot:
        return LifecycleSnapshot(
            state=self._state,
            engines=tuple(await self._engine.engine_statuses()),
            capabilities=self._engine.capabilities(),
            recent_mutations=tuple(self._audit),
        )

    def audit_log(self) -> tuple[AuditEntry, ...]:
        return tuple(self._audit)

    async def watch(self) -> AsyncIterator[LifecycleState]:
        """The current state, then each newer one; a slow reader skips to the latest."""
        while True:
            changed = self._changed
            yield self._state
            await changed.wait()

    def _publish(self, **changes: object) -> None:
        self._state = self._state.evolve(**changes)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    @contextlib.contextmanager
    def _audited(self, operation: str, detail: str) -> Iterator[list[str]]:
        outcome: list[str] = []
        try:
            yield outcome
        except BaseException as e:
            self._record(operation, detail, type(e).__name__)
            raise
        self._record(operation, detail, outcome[0] if outcome else "ok")

    def _record(self, operation: str, detail: str, outcome: str) -> None:
        self._audit_sequence += 1
        self._audit.append(AuditEntry(self._audit_sequence, operation, detail, outcome, time.time()))
