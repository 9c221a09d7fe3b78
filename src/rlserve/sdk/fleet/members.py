"""What a fleet reports (its errors, a sync's figures, the servers it dropped) and the checks
that its servers fit together. The members and the fan-out are the SDK's (`rlserve.sdk.fanout`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlserve.sdk.fanout import Outcome
from rlserve.sdk.weight_sync import WeightSyncError
from rlserve.wire.protocol import combined_checksum


class FleetError(RuntimeError):
    """A server does not fit the fleet, or none is left; the message names the server."""


class FleetSyncError(WeightSyncError):
    """A fleet sync failed. `outcomes`: per server, what happened (an `Outcome`: `COMMITTED`,
    or the status and reason it failed); `committed`: the servers that serve the new version (empty when the
    sync failed before the vote: every server kept its old weights); `dropped`: the servers
    that left the fleet in this sync."""

    def __init__(
        self, message: str, outcomes: Mapping[str, Outcome], committed: Sequence[str], dropped: Sequence[str]
    ) -> None:
        super().__init__(message, resumed_on_old_weights=not committed)
        self.outcomes = dict(outcomes)
        self.committed = tuple(committed)
        self.dropped = tuple(dropped)


@dataclass(frozen=True)
class Dropped:
    server: str
    reason: str
    unix_time_s: float


@dataclass(frozen=True)
class FleetSyncStats:
    weight_version: str
    servers: tuple[str, ...]
    num_tensors: int
    num_bytes: int
    num_chunks: int
    # Rendezvous included when the group had to be (re)built.
    init_s: float
    transfer_s: float
    prepare_s: float
    commit_s: float
    pause_to_resume_s: float
    checksum: str
    # PauseGeneration on every server, until the slowest had ended its engine step in flight.
    pause_s: float = 0.0
    # Servers someone else had paused when the sync began: left paused, as found.
    left_paused: tuple[str, ...] = ()
    # Staged: every server received and prepared while generating (`stage_s`), and was
    # paused for the commit only (`pause_to_resume_s`).
    staged: bool = False
    stage_s: float = 0.0


def require_same(values: Mapping[str, str], what: str) -> None:
    """FleetError naming the servers that differ from the most common value."""
    counts: dict[str, int] = {}
    for v in values.values():
        counts[v] = counts.get(v, 0) + 1
    if len(counts) <= 1:
        return
    common = max(counts, key=lambda v: counts[v])
    odd = {n: v for n, v in values.items() if v != common}
    raise FleetError("; ".join(f"{n} {what} {v[:32]!r}, the others {common[:32]!r}" for n, v in odd.items()))


def names_digest(names: frozenset[str]) -> str:
    return combined_checksum(dict.fromkeys(names, ""))
