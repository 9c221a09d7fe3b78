"""The pieces a fleet is made of: its members, what a sync reports, and the fan-out that
calls every member at once and collects each one's answer or error by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc

from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.client import Client
from rlserve.trainer import WeightSyncError
from rlserve.transfer.protocol import combined_checksum

# Codes that say the server is not there (or not answering): it is dropped, not waited for.
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
OK = "ok"
COMMITTED = "committed"


class FleetError(RuntimeError):
    """A server does not fit the fleet, or none is left; the message names the server."""


class FleetSyncError(WeightSyncError):
    """A fleet sync failed. `outcomes`: per server, what happened ("committed", or the
    reason it failed); `committed`: the servers that serve the new version (empty when the
    sync failed before the vote: every server kept its old weights); `dropped`: the servers
    that left the fleet in this sync."""

    def __init__(
        self, message: str, outcomes: Mapping[str, str], committed: Sequence[str], dropped: Sequence[str]
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
    # Servers someone else had paused when the sync began: left paused, as found.
    left_paused: tuple[str, ...] = ()


@dataclass
class Member:
    """One server of the fleet."""

    name: str
    client: Client
    owned: bool
    lifecycle: Any = None
    num_workers: int = 0
    # Joined after the fleet's weights were set: its next sync must carry every tensor.
    fresh: bool = False
    manifest: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        self.lifecycle = lifecycle_pb2_grpc.LifecycleStub(self.client.channel)


class Failed(Exception):
    """Some servers failed a step; `errors` by server name."""

    def __init__(self, step: str, errors: Mapping[str, str]) -> None:
        super().__init__(f"{step}: " + by_name(errors))
        self.step, self.errors = step, dict(errors)


def by_name(errors: Mapping[str, str]) -> str:
    """`errors` (server name -> what went wrong) in one line."""
    return "; ".join(f"{n}: {e}" for n, e in errors.items())


def each(members: Sequence[Member], call: Callable[[Member], grpc.Future]) -> dict[str, Any]:
    """`call` on every member at once: each one's response, or its RpcError."""
    futures = {m.name: call(m) for m in members}
    out: dict[str, Any] = {}
    for name, f in futures.items():
        try:
            out[name] = f.result()
        except grpc.RpcError as e:
            out[name] = e
    return out


def step(members: Sequence[Member], name: str, call: Callable[[Member], grpc.Future]) -> dict[str, Any]:
    """`call` on every member; raises Failed naming those that failed, else returns the
    responses by member name."""
    replies = each(members, call)
    errors = rpc_errors(replies)
    if errors:
        raise Failed(name, errors)
    return replies


def each_outcome(members: Sequence[Member], call: Callable[[Member], grpc.Future]) -> dict[str, str]:
    """`call` on every member: OK (done) or what went wrong, by name."""
    return {n: describe(r) if isinstance(r, BaseException) else OK for n, r in each(members, call).items()}


def future(f: grpc.Future) -> Future:
    """A concurrent.futures view of a gRPC future (to wait on it with others)."""
    out: Future = Future()
    f.add_done_callback(lambda done: out.set_result(None))
    return out


def rpc_errors(replies: Mapping[str, Any]) -> dict[str, str]:
    """The failures among `replies` (responses, RpcErrors or gRPC futures), described."""
    errors: dict[str, str] = {}
    for name, reply in replies.items():
        if isinstance(reply, grpc.Future):
            reply = reply.exception() if reply.done() and not reply.cancelled() else None
        if isinstance(reply, BaseException):
            errors[name] = describe(reply)
    return errors


def describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


def is_gone(outcome: str) -> bool:
    return any(outcome.startswith(code.name) for code in GONE)


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


def check_votes(prepared: Mapping[str, Any], num_chunks: int, num_tensors: int) -> None:
    """Every server staged what was sent: the vote's content, not only its success."""
    wrong = {
        name: f"staged {r.session.num_chunks} chunks / {r.session.num_tensors} tensors, {num_chunks} / {num_tensors} were sent"
        for name, r in prepared.items()
        if (r.session.num_chunks, r.session.num_tensors) != (num_chunks, num_tensors) or not r.session.prepared
    }
    if wrong:
        raise Failed("prepare", wrong)
