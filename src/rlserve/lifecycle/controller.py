"""The lifecycle controller: pause / resume, sleep / wake and the weight-version label, and the
admission of generation through them. Weight updates are `WeightUpdates`, over the same state.

Every mutation takes the state owner's lock, checks its transition, calls the engine,
publishes the new state and is audited. A pause publishes PAUSING before its engine call, so
that new requests are held from that moment; a WAIT pause then waits for the engine to drain
without the lock, so a stronger pause can still come in. No grpc here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from rlserve.errors import (
    CapabilityMissing,
    EngineUnavailable,
    InvalidRequest,
    PauseDraining,
    VersionMismatch,
    WrongState,
)
from rlserve.lifecycle.gate import Admission, GenerationGate, Ticket
from rlserve.lifecycle.lease import SessionLease
from rlserve.lifecycle.lora_adapters import LoraAdapters, stamp_lora_version
from rlserve.lifecycle.mutation import survives_caller_cancellation
from rlserve.lifecycle.owner import Observer, StateOwner
from rlserve.lifecycle.state import (
    LifecycleSnapshot,
    LifecycleState,
    check_can_resume,
    check_pause_change,
    check_sleep_request,
    check_weight_version,
    is_stronger,
)
from rlserve.lifecycle.weight_updates import WeightUpdates
from rlserve.types import (
    MEMORY_TAGS,
    EngineLoad,
    FrontendStatus,
    GenerateChunk,
    GenerateParams,
    LoraAdapter,
    PauseMode,
    PausePhase,
    SleepTag,
)

if TYPE_CHECKING:
    from rlserve.lifecycle.interfaces import ControlledEngine


class LifecycleController:
    def __init__(
        self,
        engine: ControlledEngine,
        *,
        initial_version: str,
        max_held_requests: int,
        max_held_bytes: int = 1 << 30,
        transfer_timeout_s: float = 60.0,
        lease_s: float | None = None,
        max_transfer_info_bytes: int = 16 << 20,
        transfer_allowed_hosts: tuple[str, ...] = (),
    ) -> None:
        self._engine = engine
        self._owner = StateOwner(initial_version, engine.monitor.check_alive)
        self._gate = GenerationGate(
            max_held=max_held_requests,
            max_held_bytes=max_held_bytes,
            on_held=lambda n: self._owner.publish(lambda s: s.holding(n)),
        )
        # The WAIT drain in progress, if any (phase PAUSING, mode WAIT), and whether the engine
        # still has to be paused once it is over (with this clear_cache) or paused itself.
        self._drain: asyncio.Future[None] | None = None
        self._drain_then_pause: bool | None = None
        self._abort_forwards: list[Callable[[list[str]], None]] = []
        # This process's generation requests, and the other frontend processes' (a hub's).
        self._num_requests = self._num_open_requests = 0
        self._other_frontends: Callable[[], tuple[FrontendStatus, ...]] = tuple
        self._num_frontends = 1
        engine.monitor.on_dead(lambda reason: self._gate.fail_all(EngineUnavailable(reason)))
        # The pause a trainer holds for an update is this controller's, and so is its lease.
        self._lease = SessionLease(lease_s if lease_s is not None else transfer_timeout_s, self._lease_expired)
        self.weights = WeightUpdates(
            self._owner,
            engine,
            timeout_s=transfer_timeout_s,
            max_info_bytes=max_transfer_info_bytes,
            allowed_hosts=transfer_allowed_hosts,
            lease=self._lease,
        )
        self.loras = LoraAdapters(self._owner, engine, self.weights.transport, self._lease, transfer_timeout_s)

    @classmethod
    async def create(cls, engine: ControlledEngine, **kwargs: Any) -> LifecycleController:
        return cls(engine, initial_version=await engine.weight_version(), **kwargs)

    @property
    def state(self) -> LifecycleState:
        return self._owner.state

    # Generation -------------------------------------------------------------------------

    def generate(self, params: GenerateParams) -> AsyncGenerator[GenerateChunk, None]:
        """Validate, hold while paused, hand to the engine, stream its outputs. Every request
        ends with a terminal chunk or an error, also one aborted while held. A request naming
        a LoRA adapter keeps it loaded until it ends. (No wrapper around the base-model
        stream: one async generator less per token.)"""
        return self._generate(params, None) if not params.lora_name else self._generate_with_lora(params)

    async def _generate_with_lora(self, params: GenerateParams) -> AsyncGenerator[GenerateChunk, None]:
        if not self._engine.lora_enabled:
            raise InvalidRequest("lora_name", "LoRA adapters are not enabled on this server (--enable-lora)")
        with self.loras.registry.using(params.lora_name) as lora:
            async with contextlib.aclosing(self._generate(params, lora)) as chunks:
                async for chunk in chunks:
                    yield stamp_lora_version(chunk, lora)

    async def _generate(self, params: GenerateParams, lora: LoraAdapter | None) -> AsyncGenerator[GenerateChunk, None]:
        request = await self._engine.validate(params, lora)
        ticket = Ticket(params.request_id, request.num_bytes)
        self._num_requests += 1
        self._num_open_requests += 1
        try:
            if not await self._gate.admit(ticket):
                for chunk in self._engine.aborted_before_start(request):
                    yield chunk
                return
            try:
                stream = await self._engine.submit(request)
            finally:
                self._gate.entered(ticket)
            if ticket.aborted:  # Abort named it on its way in
                await self._engine.abort([params.request_id])
            async with contextlib.aclosing(stream.chunks()) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._num_open_requests -= 1

    @contextlib.asynccontextmanager
    async def admission(self, request_id: str, num_bytes: int, lora_name: str) -> AsyncIterator[Admission]:
        """A request of another frontend process of this server, at this one gate: held while
        paused, counted on its way into the engine (the caller submits it, then calls
        `entered`), its adapter kept loaded until the block ends. `Admission.lora` is None
        without one; `aborted` when it was aborted while held (it must not run). Raises what
        admitting a local request raises."""
        with self.loras.registry.using(lora_name) if lora_name else contextlib.nullcontext() as lora:
            ticket = Ticket(request_id, num_bytes)
            admission = Admission(ticket, lora, self._gate, aborted=not await self._gate.admit(ticket))
            try:
                yield admission
            finally:
                admission.entered()

    def attach_frontends(
        self,
        forward_abort: Callable[[list[str]], None],
        statuses: Callable[[], tuple[FrontendStatus, ...]],
        num_frontends: int,
    ) -> None:
        """Other frontend processes admit through this one: `forward_abort(ids)` hears every
        Abort (they abort their requests), `statuses()` says what those serving have
        (GetState), of `num_frontends` configured in all."""
        self._abort_forwards.append(forward_abort)
        self._other_frontends = statuses
        self._num_frontends = num_frontends

    def frontends(self) -> tuple[FrontendStatus, ...]:
        """This process (frontend 0) and the other frontend processes."""
        own = FrontendStatus(0, os.getpid(), self._num_requests, self._num_open_requests)
        return (own, *self._other_frontends())

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests by id, held ones included, in every frontend process; unknown ids
        are ignored."""
        self._gate.abort(request_ids)
        for forward in self._abort_forwards:
            forward(request_ids)
        await self._engine.abort(request_ids)

    async def abort_everything(self) -> None:
        """Shutdown: every held request and every request in the engine ends ABORTED now."""
        self._gate.abort_all()
        await self._engine.abort_all()

    async def list_loras(self) -> tuple[LoraAdapter, ...]:
        """As the servicers ask for it (a following frontend process asks the leader)."""
        return self.loras.adapters()

    # Pause and resume -------------------------------------------------------------------

    @survives_caller_cancellation
    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """Return once the engine is idle. Pausing when paused changes nothing unless `mode`
        is stronger (ABORT > WAIT > KEEP), which then applies to what is left: KEEP -> WAIT
        lets the kept requests finish, anything -> ABORT ends them.
        Raises WrongState (KEEP -> WAIT with an update open)."""
        detail = f"mode={mode.name} clear_cache={clear_cache}"
        st = self._owner.state
        if st.pause_phase is PausePhase.PAUSED and not is_stronger(mode, st):
            # A complete pause already holds: no lock, so it never waits behind a transfer. (A
            # pause still under way is waited for below, behind the lock it holds.)
            self._owner.check_alive()
            self._owner.record("pause", detail, "noop")
            self._rearm_lease()
            drain = None
        else:
            async with self._owner.lock:
                with self._owner.audited("pause", detail) as outcome:
                    st = self._owner.state
                    self._rearm_lease()
                    if st.is_paused and not is_stronger(mode, st):
                        outcome.append("noop")
                        drain = self._drain
                    else:
                        check_pause_change(st, mode)
                        drain = await self._pause_engine(mode, clear_cache)
        if drain is not None:
            await self._finish_drain(drain)

    async def _pause_engine(self, mode: PauseMode, clear_cache: bool) -> asyncio.Future[None] | None:
        """Under the lock. Returns the drain to wait for (WAIT), or None once paused."""
        was_keep = self._owner.state.pause_mode is PauseMode.KEEP
        self._gate.close()
        self._owner.publish(lambda s: s.paused_as(PausePhase.PAUSING, mode))
        # A request admitted before the gate closed reaches the engine before the pause does.
        await self._gate.wait_entered()
        if mode is PauseMode.WAIT and was_keep:
            # KEEP -> WAIT: the kept requests may have lost their KV to the pause's cache reset,
            # and vLLM's WAIT pause never schedules such requests; so run the engine (new
            # requests stay held here) until the kept ones have ended, then pause it.
            await self._engine.resume()
            self._drain = asyncio.ensure_future(self._engine.requests_done())
            self._drain_then_pause = clear_cache
            return self._drain
        if mode is PauseMode.WAIT:
            # Engine calls are made under the lock, so the engine sees them in order; only
            # waiting for the drain happens outside it.
            self._drain = asyncio.ensure_future(self._engine.pause(mode, clear_cache))
            self._drain_then_pause = None
            return self._drain
        await self._engine.pause(mode, clear_cache)
        self._drain = None
        self._owner.publish(LifecycleState.paused_fully)
        return None

    async def _finish_drain(self, drain: asyncio.Future[None]) -> None:
        """The engine finishes the draining requests whether or not their clients read them."""
        try:
            await asyncio.shield(drain)
        finally:
            if drain.done():
                async with self._owner.lock:
                    if self._drain is drain:
                        self._drain = None
                        if not drain.cancelled() and drain.exception() is None:
                            if self._drain_then_pause is not None:
                                await self._engine.pause(PauseMode.WAIT, self._drain_then_pause)
                            self._owner.publish(LifecycleState.paused_fully)

    @survives_caller_cancellation
    async def resume(self) -> None:
        """Raises MemoryAsleep / WeightsInconsistent / WrongState (FAILED_PRECONDITION),
        PauseDraining (ABORTED) while a WAIT pause drains. OK when running."""
        async with self._owner.lock:
            with self._owner.audited("resume", "") as outcome:
                st = self._owner.state
                check_can_resume(st, is_draining=self._drain is not None)
                self._rearm_lease()
                if not st.is_paused:
                    outcome.append("noop")
                    return
                await self._resume_locked()

    async def _resume_locked(self) -> None:
        await self._engine.resume()
        self._owner.publish(LifecycleState.running)
        self._gate.open()

    def _rearm_lease(self) -> None:
        """Whoever decides about the pause takes over its lease; an open session (a staged
        one is open across pauses and resumes) keeps its own: a trainer that vanishes after
        pausing for the commit still has its session dropped and generation resumed."""
        session = self._owner.state.update_session
        if session is None:
            self._lease.disarm()
        else:
            self._lease.arm(session.session_id)

    async def _lease_expired(self, session_id: str | None, token: int) -> None:
        """No update call within the lease: the trainer is gone. Abort its session and, when
        the old weights are intact, let generation go on."""
        async with self._owner.lock:
            session = self._owner.state.update_session
            current = session.session_id if session is not None else None
            if not self._lease.is_current(token) or current != session_id:
                return
            what = f"session={session_id}" if session_id else "after a failed update"
            with self._owner.audited("session_lease_expired", f"{what} lease_s={self._lease.lease_s:g}"):
                if session is not None:
                    await self.weights.drop_session("an in-place update's session lease expired")
                st = self._owner.state
                if st.weights_consistent and not st.asleep and st.pause_phase is PausePhase.PAUSED:
                    await self._resume_locked()
                    self._owner.record("resume", "the update's lease expired", "ok")

    # Sleep and wake ---------------------------------------------------------------------

    @survives_caller_cancellation
    async def sleep(self, level: int, mode: PauseMode) -> None:
        """Raises CapabilityMissing without sleep mode, InvalidRequest for a bad level/mode."""
        async with self._owner.lock:
            with self._owner.audited("sleep", f"level={level} mode={mode.name}") as outcome:
                self._require_sleep_mode()
                check_sleep_request(level, mode)
                st = self._owner.state
                if st.update_session is not None:
                    # Refused before the lease is touched: the session's lease stays armed.
                    raise WrongState("a weight update is open; finish or abort it before Sleep")
                self._rearm_lease()
                if self._drain is not None:
                    raise PauseDraining("a WAIT pause is draining; Sleep once PauseGeneration returns")
                if st.is_sleeping and level <= st.sleep_level:
                    outcome.append("noop")
                    return
                self._gate.close()
                self._owner.publish(lambda s: s.paused_as(PausePhase.PAUSING, mode))
                await self._gate.wait_entered()
                await self._engine.sleep(level, mode)
                self._owner.publish(lambda s: s.slept(level))

    @survives_caller_cancellation
    async def wake_up(self, tags: frozenset[SleepTag]) -> None:
        """Wake the named memory (empty: all). Generation resumes when everything is resident
        and the weights are consistent (as upstream); after a level-2 sleep it stays paused
        until new weights arrive. Raises CapabilityMissing."""
        wanted = tags or frozenset(SleepTag)
        async with self._owner.lock:
            with self._owner.audited("wake_up", f"tags={sorted(t.value for t in wanted)}") as outcome:
                self._require_sleep_mode()
                st = self._owner.state
                if not st.asleep:
                    outcome.append("noop")
                    return
                names = None if wanted >= MEMORY_TAGS else [t.value for t in wanted if t is not SleepTag.SCHEDULING]
                fully_awake = await self._engine.wake_up(names)
                asleep = frozenset() if fully_awake else st.asleep - wanted
                self._owner.publish(lambda s: s.sleeping(asleep, st.sleep_level if asleep else 0))
                if fully_awake and self._owner.state.weights_consistent:
                    self._owner.publish(LifecycleState.running)
                    self._gate.open()
                elif fully_awake:
                    # vLLM resumed its scheduler; keep it paused until new weights are loaded.
                    await self._engine.pause(PauseMode.KEEP, clear_cache=True)

    def _require_sleep_mode(self) -> None:
        if not self._engine.capabilities().sleep_mode_enabled:
            raise CapabilityMissing(
                "sleep mode is not available: it needs a GPU platform and --enable-sleep-mode "
                "(see rl_capabilities.sleep_mode_enabled)"
            )

    # Weight version ---------------------------------------------------------------------

    @survives_caller_cancellation
    async def update_weight_version(self, version: str, expected: str | None = None) -> str:
        """Relabel the weights without touching requests; returns the previous version.
        Raises InvalidRequest (empty or too long), VersionMismatch (compare-and-set failed)."""
        detail = f"version={version[:64]!r}" + (f" expected={expected[:64]!r}" if expected is not None else "")
        async with self._owner.lock:
            with self._owner.audited("update_weight_version", detail) as outcome:
                check_weight_version(version)
                previous = self._owner.state.weight_version
                if expected is not None and expected != previous:
                    raise VersionMismatch(expected, previous)
                if version == previous:
                    outcome.append("noop")
                    return previous
                await self._engine.set_weight_version(version)
                self._owner.publish(lambda s: s.versioned(version))
                return previous

    # Observation ------------------------------------------------------------------------

    async def snapshot(self) -> LifecycleSnapshot:
        return LifecycleSnapshot(
            state=self._owner.state,
            engines=tuple(await self._engine.engine_statuses()),
            capabilities=self._engine.capabilities(),
            recent_mutations=self._owner.audit_log(),
            weight_dtype=self._engine.weight_dtype,
            weight_bytes=self._engine.weight_bytes,
            logprobs_mode=self._engine.logprobs_mode,
            stages_updates=self._engine.transport is not None and self._engine.transport.stages_updates,
            frontends=self.frontends(),
            num_frontends=self._num_frontends,
        )

    def watch(self) -> AsyncIterator[LifecycleState]:
        return self._owner.watch()

    def observe(self, observer: Observer) -> None:
        """See `StateOwner.observe` (metrics)."""
        self._owner.observe(observer)

    def load(self) -> tuple[tuple[EngineLoad, ...], int]:
        """Each engine's load as its scheduler last reported it, and the held requests."""
        board = self._engine.load
        if board is None:
            raise CapabilityMissing("the server runs without engine stats (--disable-log-stats)")
        return board.engines(), self._owner.state.num_held_requests

    def record(self, operation: str, detail: str, outcome: str) -> None:
        """Audit a call refused before it reached the controller (e.g. by access control)."""
        self._owner.record(operation, detail, outcome)
