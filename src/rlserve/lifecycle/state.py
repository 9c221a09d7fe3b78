"""The typed lifecycle state and its transition rules. Pure data: no engine, no grpc.

`LifecycleState` is immutable; the controller replaces it under its lock. Each `check_*`
function states one rule and raises the named domain error when the state breaks it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from rlserve.errors import (
    InvalidRequest,
    MemoryAsleep,
    NotPaused,
    NoUpdateSession,
    TransportNotReady,
    UpdateInProgress,
    WeightsInconsistent,
    WrongState,
)

DEFAULT_WEIGHT_VERSION = "default"


class PauseMode(enum.Enum):
    """How a pause treats in-flight requests; values are vLLM's spelling."""

    KEEP = "keep"  # freeze them, continue after resume
    WAIT = "wait"  # let them finish
    ABORT = "abort"  # end them now with their partial output

    @property
    def strength(self) -> int:
        return _STRENGTH[self]


_STRENGTH = {PauseMode.KEEP: 0, PauseMode.WAIT: 1, PauseMode.ABORT: 2}


class PausePhase(enum.Enum):
    RUNNING = 1
    PAUSING = 2  # requested; the engine is not idle yet
    PAUSED = 3  # the engine is idle; new requests are held


class SleepTag(enum.Enum):
    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    SCHEDULING = "scheduling"


MEMORY_TAGS = frozenset({SleepTag.WEIGHTS, SleepTag.KV_CACHE})


@dataclass(frozen=True)
class UpdateSession:
    """An open weight update: StartWeightUpdate happened, FinishWeightUpdate not yet."""

    session_id: str
    is_draft: bool
    started_unix_s: float
    num_chunks: int = 0
    num_tensors: int = 0
    num_bytes: int = 0


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
    update_session: UpdateSession | None = None

    @property
    def is_paused(self) -> bool:
        return self.pause_phase is not PausePhase.RUNNING

    @property
    def is_sleeping(self) -> bool:
        """True only while memory is released; a merely paused engine is not sleeping."""
        return bool(self.asleep)

    def evolve(self, **changes: object) -> LifecycleState:
        return replace(self, revision=self.revision + 1, **changes)


@dataclass(frozen=True)
class AuditEntry:
    sequence: int
    operation: str
    detail: str
    outcome: str
    unix_time_s: float


def check_can_resume(state: LifecycleState) -> None:
    if state.update_session is not None:
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


def check_can_start_update(state: LifecycleState) -> None:
    if state.update_session is not None:
        raise UpdateInProgress(
            f"weight update {state.update_session.session_id} is already open; finish or abort it first"
        )
    if not state.transport_ready:
        raise TransportNotReady("no weight transport; call InitWeightTransferEngine first")
    if state.pause_phase is not PausePhase.PAUSED:
        raise NotPaused(
            f"pause generation before StartWeightUpdate (state: {state.pause_phase.name}); "
            "PauseGeneration returns once the pause is complete"
        )
    if SleepTag.WEIGHTS in state.asleep:
        raise MemoryAsleep("the weights are asleep; WakeUp with tags=[weights] before StartWeightUpdate")


def require_session(state: LifecycleState, call: str) -> UpdateSession:
    if state.update_session is None:
        raise NoUpdateSession(f"no weight update is open; StartWeightUpdate before {call}")
    return state.update_session


def check_sleep_request(level: int, mode: PauseMode) -> None:
    if level not in (0, 1, 2):
        raise InvalidRequest("level", f"must be 0, 1 or 2, got {level}")
    if level == 2 and mode is PauseMode.KEEP:
        raise InvalidRequest(
            "mode", "level 2 discards the weights, so kept requests could not continue; use ABORT or WAIT"
        )


def parse_wake_tags(tags: list[str]) -> frozenset[SleepTag]:
    """Empty means everything; unknown tags are INVALID_ARGUMENT."""
    if not tags:
        return frozenset(SleepTag)
    known = {t.value: t for t in SleepTag}
    unknown = [t for t in tags if t not in known]
    if unknown:
        raise InvalidRequest("tags", f"unknown {unknown}; use {sorted(known)} or none for all")
    return frozenset(known[t] for t in tags)


def check_weight_version(version: str) -> None:
    if not version:
        raise InvalidRequest("weight_version", "must be a non-empty string")
