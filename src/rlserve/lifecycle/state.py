"""The typed lifecycle state and its transition rules. Pure data: no engine, no grpc.

`LifecycleState` is immutable; the controller replaces it under its lock. Each `check_*`
function states one rule and raises the named domain error when the state breaks it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlserve.errors import (
    InvalidRequest,
    LimitExceeded,
    MemoryAsleep,
    NotPaused,
    NoUpdateSession,
    PauseDraining,
    TransportNotReady,
    UpdateInProgress,
    WeightsInconsistent,
    WrongState,
)
from rlserve.types import MEMORY_TAGS, EngineStatus, FrontendStatus, PauseMode, PausePhase, RlCapabilities, SleepTag

DEFAULT_WEIGHT_VERSION = "default"
# A label, not a payload: it travels on every output's version spans and in the audit ring.
MAX_WEIGHT_VERSION_BYTES = 256


@dataclass(frozen=True)
class UpdateSession:
    """An open weight update: StartWeightUpdate happened, FinishWeightUpdate not yet."""

    session_id: str
    is_draft: bool
    started_unix_s: float
    num_chunks: int = 0
    num_tensors: int = 0
    num_bytes: int = 0
    # A session that pushes a LoRA adapter (StartLoraUpdate): its name; "" for model weights.
    lora_name: str = ""
    # PrepareWeightUpdate succeeded: only the commit (or an abort) is left.
    prepared: bool = False
    # Opened by StageWeightUpdate: received while generation runs, committed under a pause.
    staged: bool = False
    # What the update's shadows hold beside the served weights (the largest worker's).
    shadow_bytes: int = 0


@dataclass(frozen=True)
class LifecycleState:
    revision: int = 0
    pause_phase: PausePhase = PausePhase.RUNNING
    pause_mode: PauseMode | None = None
    asleep: frozenset[SleepTag] = frozenset()
    sleep_level: int = 0
    weights_consistent: bool = True
    inconsistency_reason: str = ""
    weight_version: str = DEFAULT_WEIGHT_VERSION
    num_held_requests: int = 0
    transport_ready: bool = False
    transport_initializing: bool = False
    update_session: UpdateSession | None = None

    @property
    def is_paused(self) -> bool:
        return self.pause_phase is not PausePhase.RUNNING

    @property
    def is_sleeping(self) -> bool:
        """True only while memory is released; a merely paused engine is not sleeping."""
        return bool(self.asleep)

    # Transitions: each returns the edited state (the owner publishes it with the next
    # revision); chained where one mutation changes several things at once.

    def paused_as(self, phase: PausePhase, mode: PauseMode | None) -> LifecycleState:
        return replace(self, pause_phase=phase, pause_mode=mode)

    def paused_fully(self) -> LifecycleState:
        """PAUSING -> PAUSED, the mode kept."""
        return replace(self, pause_phase=PausePhase.PAUSED)

    def running(self) -> LifecycleState:
        return replace(self, pause_phase=PausePhase.RUNNING, pause_mode=None)

    def sleeping(self, asleep: frozenset[SleepTag], level: int) -> LifecycleState:
        return replace(self, asleep=asleep, sleep_level=level)

    def slept(self, level: int) -> LifecycleState:
        """After an engine sleep of `level` (0: scheduling only; 2 also discards the weights)."""
        state = self.paused_fully()
        if level >= 1:
            state = state.sleeping(MEMORY_TAGS, level)
        return state.mark_inconsistent("a level-2 sleep discarded them") if level == 2 else state

    def holding(self, num_held_requests: int) -> LifecycleState:
        return replace(self, num_held_requests=num_held_requests)

    def transport(self, *, ready: bool | None = None, initializing: bool | None = None) -> LifecycleState:
        """None keeps what is."""
        return replace(
            self,
            transport_ready=self.transport_ready if ready is None else ready,
            transport_initializing=self.transport_initializing if initializing is None else initializing,
        )

    def in_session(self, session: UpdateSession | None) -> LifecycleState:
        return replace(self, update_session=session)

    def mark_inconsistent(self, reason: str) -> LifecycleState:
        """The served weights are no complete set (`reason` says why); generation stays
        paused until a full update commits."""
        return replace(self, weights_consistent=False, inconsistency_reason=reason)

    def consistent(self) -> LifecycleState:
        return replace(self, weights_consistent=True, inconsistency_reason="")

    def versioned(self, weight_version: str) -> LifecycleState:
        return replace(self, weight_version=weight_version)


@dataclass(frozen=True)
class AuditEntry:
    sequence: int
    operation: str
    detail: str
    outcome: str
    unix_time_s: float
    caller: str = ""


@dataclass(frozen=True)
class LifecycleSnapshot:
    state: LifecycleState
    engines: tuple[EngineStatus, ...]
    capabilities: RlCapabilities
    recent_mutations: tuple[AuditEntry, ...]
    weight_dtype: str = ""
    weight_bytes: int = 0
    logprobs_mode: str = ""
    # Updates are built beside the served weights: an abort or failure leaves them intact.
    stages_updates: bool = False
    frontends: tuple[FrontendStatus, ...] = ()
    num_frontends: int = 1  # configured (--frontends); `frontends` lists those serving


def is_stronger(requested: PauseMode, state: LifecycleState) -> bool:
    """Whether a pause in `requested` mode changes anything: always when running, otherwise
    only a stronger mode than the current one (it applies to what the weaker one left)."""
    return state.pause_mode is None or requested.strength > state.pause_mode.strength


def check_pause_change(state: LifecycleState, requested: PauseMode) -> None:
    """KEEP -> WAIT lets the kept requests run to their end, which an open weight update
    forbids (they would sample from weights that are being replaced)."""
    if state.update_session is not None and state.pause_mode is PauseMode.KEEP and requested is PauseMode.WAIT:
        raise WrongState(
            f"weight update {state.update_session.session_id} is open; WAIT would run the kept "
            "requests: finish or abort the update first, or pause with ABORT"
        )


def check_can_resume(state: LifecycleState, is_draining: bool) -> None:
    """A staged session may stay open across a resume: the served weights are the old ones."""
    if state.update_session is not None and not state.update_session.staged:
        raise WrongState(
            f"weight update {state.update_session.session_id} is open; "
            "FinishWeightUpdate or AbortWeightUpdate before ResumeGeneration"
        )
    if state.asleep:
        tags = ", ".join(sorted(t.value for t in state.asleep))
        raise MemoryAsleep(f"memory is asleep ({tags}); call WakeUp before ResumeGeneration")
    if not state.weights_consistent:
        raise WeightsInconsistent(
            f"the weights are not a complete set ({state.inconsistency_reason}); "
            "load new weights with a weight update before ResumeGeneration"
        )
    if is_draining:
        raise PauseDraining(
            "a WAIT pause is draining in-flight requests; ResumeGeneration once PauseGeneration "
            "returns, or end the drain with PauseGeneration(ABORT)"
        )


def check_can_open_session(state: LifecycleState) -> None:
    """What any update session needs: no other one, and a ready transport."""
    if state.update_session is not None:
        raise UpdateInProgress(
            f"weight update {state.update_session.session_id} is already open; finish or abort it first"
        )
    if state.transport_initializing:
        raise UpdateInProgress("InitWeightTransferEngine is in progress; start the update once it returns")
    if not state.transport_ready:
        raise TransportNotReady("no weight transport; call InitWeightTransferEngine first")


def check_can_start_update(state: LifecycleState, staged: bool = False) -> None:
    """A session StartWeightUpdate opens needs the pause; a staged one does not (its commit
    does, `check_can_commit`)."""
    check_can_open_session(state)
    call = "StageWeightUpdate" if staged else "StartWeightUpdate"
    if not staged and state.pause_phase is not PausePhase.PAUSED:
        raise NotPaused(
            f"pause generation before {call} (state: {state.pause_phase.name}); "
            "PauseGeneration returns once the pause is complete"
        )
    if SleepTag.WEIGHTS in state.asleep:
        raise MemoryAsleep(f"the weights are asleep; WakeUp with tags=[weights] before {call}")


def check_can_commit(state: LifecycleState, session: UpdateSession) -> None:
    """A staged session is committed under a pause (a session StartWeightUpdate opened was
    paused from its start on)."""
    if session.staged and state.pause_phase is not PausePhase.PAUSED:
        raise NotPaused(
            f"weight update {session.session_id} was staged while generating: pause generation "
            f"before FinishWeightUpdate (state: {state.pause_phase.name}); the pause is only for the swap"
        )


def check_can_init_transport(state: LifecycleState) -> None:
    if state.update_session is not None:
        raise UpdateInProgress("finish or abort the open weight update before re-initializing")
    if state.transport_initializing:
        raise UpdateInProgress("another InitWeightTransferEngine is in progress")


def require_session(state: LifecycleState, call: str, lora: bool | None = None) -> UpdateSession:
    """The open session; of the kind asked for (a LoRA adapter or model weights) unless None."""
    session = state.update_session
    if session is None:
        raise NoUpdateSession(f"no weight update is open; StartWeightUpdate before {call}")
    if lora is not None and bool(session.lora_name) != lora:
        kind = f"pushes LoRA adapter {session.lora_name!r}" if session.lora_name else "updates the model's weights"
        raise NoUpdateSession(f"the open session {kind}: {call} does not finish it")
    return session


def check_sleep_request(level: int, mode: PauseMode) -> None:
    if level not in (0, 1, 2):
        raise InvalidRequest("level", f"must be 0, 1 or 2, got {level}")
    if level == 2 and mode is PauseMode.KEEP:
        raise InvalidRequest(
            "mode", "level 2 discards the weights, so kept requests could not continue; use ABORT or WAIT"
        )


def check_weight_version(version: str, field: str = "weight_version") -> None:
    if not version:
        raise InvalidRequest(field, "must be a non-empty string")
    size = len(version.encode())
    if size > MAX_WEIGHT_VERSION_BYTES:
        raise LimitExceeded(field, size, "bytes", "max_weight_version_bytes", MAX_WEIGHT_VERSION_BYTES)
