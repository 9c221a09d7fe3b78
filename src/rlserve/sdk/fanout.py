"""The servers a sync drives (its members, one for `WeightSync`, many for a fleet), and the
fan-out that calls every member at once and keeps each one's answer as a typed `Outcome`: a
gRPC status and a message, never a string to parse back."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc

from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.config import chunk_deadline_s
from rlserve.sdk.client import Client

# Codes that say the server is not there (or not answering): it is dropped, not waited for.
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# On top of the server's own deadline, so the server's reason arrives before ours expires.
RPC_MARGIN_S = 10.0


def step_timeout_s(timeout_s: float, num_bytes: int) -> float:
    """The deadline of an RPC that moves `num_bytes`: the server's own, and our margin."""
    return chunk_deadline_s(timeout_s, num_bytes) + RPC_MARGIN_S


@dataclass(frozen=True)
class Outcome:
    """What one server's call or step came to. `code`: the call's gRPC status (OK when it
    succeeded), or None for a failure that is no call's (the digests differ, the trainer's
    side broke); `message`: what happened, in words."""

    code: grpc.StatusCode | None
    message: str

    @classmethod
    def of(cls, reply: Any) -> Outcome:
        """A call's reply (success) or its error."""
        if isinstance(reply, grpc.RpcError):
            return cls(reply.code(), reply.details() or "")
        if isinstance(reply, BaseException):
            return cls(None, f"{type(reply).__name__}: {reply}")
        return cls(grpc.StatusCode.OK, "ok")

    @classmethod
    def failure(cls, message: str) -> Outcome:
        return cls(None, message)

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    @property
    def gone(self) -> bool:
        """The server is not there, or does not answer: it is dropped, not waited for."""
        return self.code in GONE

    def at(self, context: str) -> Outcome:
        """The same outcome, its message saying where it happened."""
        return Outcome(self.code, f"{context}: {self.message}")

    def __str__(self) -> str:
        return self.message if self.code in (None, grpc.StatusCode.OK) else f"{self.code.name}: {self.message}"


COMMITTED = Outcome(grpc.StatusCode.OK, "committed")


@dataclass
class Member:
    """One server a sync drives."""

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

    def __init__(self, step: str, errors: Mapping[str, Outcome]) -> None:
        super().__init__(f"{step}: " + by_name(errors))
        self.step, self.errors = step, dict(errors)


def by_name(errors: Mapping[str, Outcome]) -> str:
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


def each_outcome(members: Sequence[Member], call: Callable[[Member], grpc.Future]) -> dict[str, Outcome]:
    """`call` on every member: its outcome, by name."""
    return {n: Outcome.of(r) for n, r in each(members, call).items()}


def future(f: grpc.Future) -> Future:
    """A concurrent.futures view of a gRPC future (to wait on it with others)."""
    out: Future = Future()
    f.add_done_callback(lambda done: out.set_result(None))
    return out


def rpc_errors(replies: Mapping[str, Any]) -> dict[str, Outcome]:
    """The failures among `replies` (responses, RpcErrors or gRPC futures), by name."""
    errors: dict[str, Outcome] = {}
    for name, reply in replies.items():
        if isinstance(reply, grpc.Future):
            reply = reply.exception() if reply.done() and not reply.cancelled() else None
        if isinstance(reply, BaseException):
            errors[name] = Outcome.of(reply)
    return errors
