"""The lifecycle controller: the one owner of pause / sleep / weight-version state.

Every mutation runs under one lock, checks its transition, calls the engine, publishes the new
state and appends to the audit log, in that order. It also gates generation: while paused, new
requests wait here (bounded) until resume. No grpc here; the engine adapter does the vLLM calls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from rlserve.engine.adapter import EngineAdapter
from rlserve.errors import (
    CapabilityMissing,
    InvalidRequest,
    PauseSuperseded,
    TooManyHeldRequests,
    UpdateInProgress,
    VersionMismatch,
    WrongState,
)
from rlserve.lifecycle.state import (
    MEMORY_TAGS,
    UpdateSession,
    check_can_start_update,
    require_session,
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
from rlserve.payloads import parse_json_object
from rlserve.transfer.protocol import BACKEND_NAME as STAGING_BACKEND
from rlserve.transfer.protocol import ChunkInfo, ProtocolError
from rlserve.types import EngineStatus, GenerateChunk, GenerateParams, RlCapabilities

AUDIT_LENGTH = 256
T = TypeVar("T")


def _survives_caller_cancellation(
    method: Callable[..., Coroutine[Any, Any, T]],
) -> Callable[..., Coroutine[Any, Any, T]]:
    """A mutation runs to its end (bounded by its own deadlines) even if the RPC that asked
    for it is cancelled, e.g. because the trainer died: a half-applied transition would
    leave the state and the engine disagreeing."""

    @functools.wraps(method)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
        task = asyncio.ensure_future(method(self, *args, **kwargs))
        # If nobody awaits the result any more, still consume its exception (it is audited).
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)

    return wrapper
DEFAULT_TRANSFER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LifecycleSnapshot:
    state: LifecycleState
    engines: tuple[EngineStatus, ...]
    capabilities: RlCapabilities
    recent_mutations: tuple[AuditEntry, ...]


class LifecycleController:
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

    # Weight updates ----------------------------------------------------------------------

    @_survives_caller_cancellation
    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Set up (or replace) the transport with the trainer, bounded by a deadline.
        Raises CapabilityMissing, UpdateInProgress, InvalidRequest, TransferTimeout; on any
        failure the previous transport (if any) stays as it was."""
        async with self._lock:
            with self._audited("init_weight_transfer", _init_detail(init_info)):
                self._require_weight_transfer()
                if self._state.update_session is not None:
                    raise UpdateInProgress("finish or abort the open weight update before re-initializing")
                timeout_s = float(init_info.get("timeout_s", self._transfer_timeout_s))
                await self._engine.weights.init(init_info, timeout_s)
                self._publish(transport_ready=True)

    @_survives_caller_cancellation
    async def start_weight_update(self, is_draft: bool = False) -> UpdateSession:
        """Open a session. Raises CapabilityMissing, UpdateInProgress (ABORTED),
        TransportNotReady / NotPaused / MemoryAsleep (FAILED_PRECONDITION)."""
        async with self._lock:
            with self._audited("start_weight_update", f"draft={is_draft}"):
                caps = self._require_weight_transfer()
                if is_draft and not caps.draft_weight_updates_enabled:
                    raise CapabilityMissing("this engine has no draft model whose weights could be updated")
                check_can_start_update(self._state)
                await self._engine.weights.start(is_draft, self._transfer_timeout_s)
                session = UpdateSession(uuid.uuid4().hex, is_draft, time.time())
                changes: dict[str, Any] = {"update_session": session}
                if not self._stages_updates(caps):
                    changes.update(weights_consistent=False, inconsistency_reason="an in-place weight update is open")
                self._publish(**changes)
                return session

    @_survives_caller_cancellation
    async def update_weights(self, update_info_json: bytes) -> None:
        """Receive one chunk (the backend's update_info as JSON). Any failure, bad JSON
        included, drops the session; with a staging backend the served weights are
        unchanged. Raises NoUpdateSession, InvalidRequest, TransferTimeout."""
        async with self._lock:
            with self._audited("update_weights", f"{len(update_info_json)} bytes of update_info"):
                session = require_session(self._state, "UpdateWeights")
                try:
                    update_info = parse_json_object(update_info_json, "update_info_json")
                    num_tensors, num_bytes = self._chunk_size(update_info)
                    # The worker bounds each collective; this bounds the whole chunk.
                    timeout_s = self._transfer_timeout_s * (1 + num_bytes // (256 * 2**20))
                    await self._engine.weights.update(update_info, timeout_s)
                except BaseException:
                    await self._drop_session("an update chunk failed")
                    raise
                self._publish(
                    update_session=replace(
                        session,
                        num_chunks=session.num_chunks + 1,
                        num_tensors=session.num_tensors + num_tensors,
                        num_bytes=session.num_bytes + num_bytes,
                    )
                )

    @_survives_caller_cancellation
    async def finish_weight_update(self, version: str | None) -> None:
        """Commit: new weights go live, every cached KV block is dropped, the version (if
        given) is published. A commit that fails half way marks the weights inconsistent
        (resume refused until a complete update succeeds)."""
        async with self._lock:
            with self._audited("finish_weight_update", f"version={version!r}"):
                require_session(self._state, "FinishWeightUpdate")
                if version is not None:
                    check_weight_version(version)
                try:
                    await self._engine.weights.finish(self._transfer_timeout_s)
                except BaseException as e:
                    self._publish(
                        update_session=None,
                        weights_consistent=False,
                        inconsistency_reason=f"the commit failed half way ({type(e).__name__})",
                    )
                    raise
                await self._engine.reset_prefix_cache()
                changes: dict[str, Any] = {
                    "update_session": None,
                    "weights_consistent": True,
                    "inconsistency_reason": "",
                }
                if version is not None and version != self._state.weight_version:
                    await self._engine.set_weight_version(version)
                    changes["weight_version"] = version
                self._publish(**changes)

    @_survives_caller_cancellation
    async def abort_weight_update(self) -> None:
        """Drop the open session (no-op without one). With a staging backend the model keeps
        the weights and version it had; an in-place backend leaves them inconsistent."""
        async with self._lock:
            with self._audited("abort_weight_update", "") as outcome:
                if self._state.update_session is None:
                    outcome.append("noop")
                    return
                await self._drop_session("an in-place update was aborted half way")

    async def weight_checksums(self) -> dict[str, Any]:
        """Digests of the served weights (HF names), identical across data-parallel engines
        or the call fails: a mismatch is an engine bug worth a loud error."""
        self._require_weight_transfer()
        per_worker = await self._engine.weights.checksums(self._transfer_timeout_s)
        overall = {w["overall"] for w in per_worker}
        if len(overall) != 1:
            raise RuntimeError(f"data-parallel engines serve different weights: {sorted(overall)}")
        return per_worker[0]

    def _chunk_size(self, update_info: dict[str, Any]) -> tuple[int, int]:
        """(tensors, bytes) of a chunk; rlserve_gloo's update_info is checked for shape here,
        other backends' is passed through as vLLM defines it."""
        if not self._stages_updates(self._engine.capabilities()):
            names = update_info.get("names")
            return (len(names) if isinstance(names, list) else 0), 0
        try:
            chunk = ChunkInfo.parse(update_info)
        except ProtocolError as e:
            raise InvalidRequest("update_info_json", str(e)) from e
        return len(chunk.tensors), sum(t.num_bytes for t in chunk.tensors)

    async def _drop_session(self, inplace_reason: str) -> None:
        caps = self._engine.capabilities()
        with contextlib.suppress(Exception):
            await self._engine.weights.abort(self._transfer_timeout_s)
        changes: dict[str, Any] = {"update_session": None}
        if not self._stages_updates(caps):
            changes.update(weights_consistent=False, inconsistency_reason=inplace_reason)
        self._publish(**changes)

    def _require_weight_transfer(self) -> RlCapabilities:
        caps = self._engine.capabilities()
        if not caps.weight_transfer_enabled:
            raise CapabilityMissing(
                "weight transfer is not configured; start the server with --weight-transfer-backend"
            )
        return caps

    @staticmethod
    def _stages_updates(caps: RlCapabilities) -> bool:
        """Only rlserve's own backend stages updates; vLLM's write into the live weights."""
        return caps.weight_transfer_backend == STAGING_BACKEND

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


def _init_detail(init_info: dict[str, Any]) -> str:
    keys = ("master_address", "master_port", "rank_offset", "world_size", "timeout_s")
    return " ".join(f"{k}={init_info[k]}" for k in keys if k in init_info)

