"""Many rlserve servers, on any hosts, driven by the trainer as one: `Fleet`.

One gloo group spans the trainer (rank 0) and the workers of every server (each server its
own range of ranks), so each chunk is voted on once and one broadcast reaches every server.
A sync is a two-phase commit:

    pause all -> start all -> chunks (every server stages and verifies each) ->
    prepare all (the vote) -> finish all with one version -> verify digests -> resume all

All or nothing holds up to the vote: a server that refuses a chunk, whose link breaks, that
dies or whose prepare fails makes every server abort; each keeps the weights and version it
served and generation resumes (`FleetSyncError.committed` is empty). After the vote a
server's commit is only a swap of tensors it already holds. A server that fails or dies
there is reported by name and dropped from the fleet (its own weights are inconsistent; it
refuses resume), the others serve the new version, and the call raises with per-server
outcomes. What no protocol gives: the servers do not switch in the same instant (requests
on one may see the new version a few milliseconds before those on another; every output
names its version), and a server that dies after the vote cannot be made to keep the old
weights.

`AsyncFleet` is its asyncio twin (the same fleet, its blocking calls in worker threads).

Membership changes between syncs: `add()` and `remove()` take effect at the next sync,
which rebuilds the group (a new rendezvous with every member); a server found unreachable
when a sync begins is dropped with a report and the sync goes on with the rest. Rollouts
over the same servers: `FleetRouter` (`fleet.generate`, `fleet.stream`,
`fleet.generate_many`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from rlserve.api.rlserve.v1 import lifecycle_pb2, lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.client import ChannelCredentials, Client
from rlserve.config import DEFAULT_TRANSFER_TIMEOUT_S
from rlserve.routing import FleetRouter, Routed
from rlserve.trainer import PAUSE_MODES, RPC_MARGIN_S, TensorSender, WeightSyncError, step_timeout_s
from rlserve.transfer.plan import DEFAULT_CHUNK_BYTES, NamedTensors, plan_sync
from rlserve.transfer.protocol import BACKEND_NAME, DEFAULT_BUCKET_BYTES, ChunkInfo, combined_checksum
from rlserve.types import PauseMode

logger = logging.getLogger(__name__)

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


class _Failed(Exception):
    """Some servers failed a step; `errors` by server name."""

    def __init__(self, step: str, errors: Mapping[str, str]) -> None:
        super().__init__(f"{step}: " + "; ".join(f"{n}: {e}" for n, e in errors.items()))
        self.step, self.errors = step, dict(errors)


class Fleet:
    """Several rlserve servers (rlserve_gloo, staged updates) synced as one. Blocking; one
    sync at a time. `servers`: addresses ("host:port") or `Client`s."""

    def __init__(
        self,
        servers: Iterable[str | Client],
        *,
        credentials: ChannelCredentials | None = None,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        rpc_timeout_s: float = 30.0,
        pause_timeout_s: float = 600.0,
    ) -> None:
        """`master_address`: the trainer's address every server's workers can reach (not
        loopback when they are on other hosts); `master_port`: 0 picks a free one. Timeouts
        as `WeightSync`'s."""
        if bucket_bytes <= 0 or chunk_bytes < bucket_bytes:
            raise ValueError("need 0 < bucket_bytes <= chunk_bytes")
        self._credentials = credentials
        self._address, self._port, self._timeout_s = master_address, master_port, timeout_s
        self._bucket_bytes, self._chunk_bytes = bucket_bytes, chunk_bytes
        self._rpc_timeout_s, self._pause_timeout_s = rpc_timeout_s, pause_timeout_s
        self._members: dict[str, Member] = {}
        for server in servers:
            self._add(server, fresh=False)
        if not self._members:
            raise ValueError("a fleet needs at least one server")
        self.dropped: list[Dropped] = []
        self._sender: TensorSender | None = None
        # The members the group was built with; another set needs a new rendezvous.
        self._group_of: tuple[str, ...] = ()
        # A collective abandoned after a refusal ends only at its own deadline: room for it.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlserve-fleet")
        self.router = FleetRouter(lambda: self.clients)

    # Membership --------------------------------------------------------------------------

    @property
    def servers(self) -> tuple[str, ...]:
        return tuple(self._members)

    @property
    def clients(self) -> list[Client]:
        return [m.client for m in self._members.values()]

    def add(self, server: str | Client) -> str:
        """A server that joins at the next sync (a new rendezvous with every member; that
        sync must carry every tensor of the checkpoint). Returns its name."""
        return self._add(server, fresh=True).name

    def remove(self, server: str) -> None:
        """Out of the fleet from now on (routing too); the group is rebuilt at the next sync.
        The server itself is left as it is."""
        member = self._members.pop(server, None)
        if member is None:
            raise KeyError(f"{server!r} is not in the fleet (servers: {list(self._members)})")
        if member.owned:
            member.client.close()

    def _add(self, server: str | Client, *, fresh: bool) -> Member:
        client, owned = (
            (Client(server, credentials=self._credentials), True) if isinstance(server, str) else (server, False)
        )
        name = client.target
        if name in self._members:
            if owned:
                client.close()
            raise ValueError(f"{name!r} is already in the fleet")
        member = Member(name, client, owned, fresh=fresh)
        self._members[name] = member
        return member

    def _drop(self, name: str, reason: str) -> None:
        member = self._members.pop(name, None)
        if member is None:
            return
        logger.warning("fleet: dropped %s: %s", name, reason)
        self.dropped.append(Dropped(name, reason, time.time()))
        if member.owned:
            member.client.close()

    # Rendezvous --------------------------------------------------------------------------

    def init(self, *, require_same_weights: bool = True) -> None:
        """Check every server, then build one group with all their workers (bounded by the
        transfer timeout). Raises FleetError naming the server that does not fit: not
        reachable or not authenticated, no rlserve_gloo, in-place updates (the fleet's
        all-or-nothing needs staged ones), another checkpoint or dtype, or (with
        `require_same_weights`, servers that are not new) other weights than the rest."""
        self._sender, self._group_of = None, ()
        members = list(self._members.values())
        if not members:
            raise FleetError("no server is left in the fleet")
        infos = self._each(
            members,
            lambda m: m.client.control.GetServerInfo.future(cpb.GetServerInfoRequest(), timeout=self._rpc_timeout_s),
        )
        states = self._states(members)
        unfit = {**_rpc_errors(infos), **_rpc_errors(states)}
        if unfit:
            raise FleetError("servers that cannot be reached: " + "; ".join(f"{n}: {e}" for n, e in unfit.items()))
        for m in members:
            info, state = infos[m.name], states[m.name]
            backend = info.rl_capabilities.weight_transfer_backend
            if backend != BACKEND_NAME:
                raise FleetError(
                    f"{m.name}: its weight-transfer backend is {backend or 'none'!r}; a fleet needs {BACKEND_NAME!r}"
                )
            if not state.stages_updates:
                raise FleetError(
                    f"{m.name}: it installs updates in place (--weight-update-mode in-place); a fleet needs staged updates"
                )
            m.num_workers = info.parallelism.world_size * max(1, info.parallelism.data_parallel_size)
        dtypes = {m.name: states[m.name].weight_dtype for m in members}
        _require_same(dtypes, "serves weights in")
        sums = self._checksums(members)
        unfit = _rpc_errors(sums)
        if unfit:
            raise FleetError(
                "servers whose weights cannot be digested: " + "; ".join(f"{n}: {e}" for n, e in unfit.items())
            )
        for m in members:
            m.manifest = frozenset(sums[m.name].per_tensor)
        _require_same({m.name: _names_digest(m.manifest) for m in members}, "serves another checkpoint (tensor names):")
        if require_same_weights:
            settled = {m.name: sums[m.name].overall for m in members if not m.fresh}
            _require_same(settled, "serves other weights, digest")
        self._rendezvous(members)

    def _rendezvous(self, members: list[Member]) -> None:
        sender = TensorSender(
            sum(m.num_workers for m in members),
            master_address=self._address,
            master_port=self._port,
            timeout_s=self._timeout_s,
        )
        offsets, offset = {}, 1
        for m in members:
            offsets[m.name], offset = offset, offset + m.num_workers
        rpcs = {
            m.name: m.client.control.InitWeightTransferEngine.future(
                cpb.InitWeightTransferEngineRequest(
                    init_info_json=json.dumps(sender.init_info(offsets[m.name])).encode()
                ),
                timeout=self._timeout_s + RPC_MARGIN_S,
            )
            for m in members
        }
        join = self._pool.submit(sender.join)
        pending: set[Future] = {join, *(_future(f) for f in rpcs.values())}
        # A server's refusal ends the rendezvous at once (the others are cancelled).
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            errors = _rpc_errors({n: f for n, f in rpcs.items() if f.done()})
            if errors:
                for f in rpcs.values():
                    f.cancel()
                raise FleetError("the rendezvous failed: " + "; ".join(f"{n}: {e}" for n, e in errors.items()))
            if join in done:
                try:
                    join.result()
                except RuntimeError as e:
                    raise FleetError(f"the rendezvous failed on the trainer's side: {e}") from e
        self._sender, self._group_of = sender, tuple(m.name for m in members)

    # Sync --------------------------------------------------------------------------------

    def sync(
        self,
        weights: NamedTensors,
        version: str,
        *,
        pause_mode: PauseMode | str = PauseMode.KEEP,
        verify: bool = True,
    ) -> FleetSyncStats:
        """Push `weights` (checkpoint names; a subset updates only those, unless a server
        joined since the last sync) into every server and publish `version` on all of them,
        as described in the module's docstring. Raises FleetSyncError."""
        mode = PauseMode(pause_mode)
        t_init = time.perf_counter()
        states = self._current_states()
        members = list(self._members.values())
        stale = self._sender is None or not self._sender.joined or self._group_of != tuple(self._members)
        if stale or not all(s.transport_ready for s in states.values()):
            self.init(require_same_weights=False)
        init_s = time.perf_counter() - t_init
        dtype = getattr(torch, states[members[0].name].weight_dtype, None)
        tensors, chunks = plan_sync(weights, dtype, chunk_bytes=self._chunk_bytes, bucket_bytes=self._bucket_bytes)
        self._check_partial(members, set(tensors))
        num_bytes = sum(c.num_bytes for c in chunks)
        t_pause = time.perf_counter()
        pause = cpb.PauseGenerationRequest(mode=PAUSE_MODES[mode])
        replies = self._each(
            members, lambda m: m.client.control.PauseGeneration.future(pause, timeout=self._pause_timeout_s)
        )
        paused = [m for m in members if not isinstance(replies[m.name], BaseException)]
        try:
            if len(paused) < len(members):
                raise _Failed("pause", _rpc_errors(replies))
            self._step(
                members,
                "start",
                lambda m: m.client.control.StartWeightUpdate.future(
                    cpb.StartWeightUpdateRequest(), timeout=self._rpc_timeout_s
                ),
            )
            t0 = time.perf_counter()
            for chunk in chunks:
                self._send_chunk(members, chunk, tensors)
            transfer_s = time.perf_counter() - t0
            prepared = self._step(
                members,
                "prepare",
                lambda m: m.lifecycle.PrepareWeightUpdate.future(
                    lifecycle_pb2.PrepareWeightUpdateRequest(), timeout=self._step_timeout_s(num_bytes)
                ),
                results=True,
            )
            _check_votes(prepared, len(chunks), sum(len(c.tensors) for c in chunks))
        except _Failed as e:
            raise self._abandon(members, paused, e) from e
        prepare_s = time.perf_counter() - t0 - transfer_s
        # The vote is in: from here on a server that fails is dropped, the others commit.
        t_commit = time.perf_counter()
        finish = cpb.FinishWeightUpdateRequest(weight_version=version)
        finished = self._outcomes(
            members,
            lambda m: m.client.control.FinishWeightUpdate.future(finish, timeout=self._step_timeout_s(num_bytes)),
        )
        commit_s = time.perf_counter() - t_commit
        mine = {t.name: t.checksum for c in chunks for t in c.tensors}
        outcomes = {n: COMMITTED if r == OK else f"commit failed: {r}" for n, r in finished.items()}
        committed = [m for m in members if outcomes[m.name] == COMMITTED]
        if verify:
            for name, wrong in self._wrong_digests(committed, mine).items():
                outcomes[name] = f"serves other weights after its commit: {wrong}"
            committed = [m for m in committed if outcomes[m.name] == COMMITTED]
        failed = [m for m in members if m not in committed]
        for m in failed:
            self._drop(m.name, f"sync to {version!r}: {outcomes[m.name]}")
        resumed = self._outcomes(
            committed,
            lambda m: m.client.control.ResumeGeneration.future(
                cpb.ResumeGenerationRequest(), timeout=self._rpc_timeout_s
            ),
        )
        pause_to_resume_s = time.perf_counter() - t_pause
        if failed:
            names = [m.name for m in committed]
            raise FleetSyncError(
                f"the sync to {version!r} committed on {len(committed)} of {len(members)} servers; dropped: "
                + "; ".join(f"{m.name}: {outcomes[m.name]}" for m in failed),
                outcomes,
                names,
                [m.name for m in failed],
            )
        for m in members:
            m.fresh = False
        stuck = {n: r for n, r in resumed.items() if r != OK}
        if stuck:
            logger.warning("fleet: committed %r but resume failed on %s", version, stuck)
        return FleetSyncStats(
            weight_version=version,
            servers=tuple(m.name for m in members),
            num_tensors=len(mine),
            num_bytes=num_bytes,
            num_chunks=len(chunks),
            init_s=init_s,
            transfer_s=transfer_s,
            prepare_s=prepare_s,
            commit_s=commit_s,
            pause_to_resume_s=pause_to_resume_s,
            checksum=combined_checksum(mine),
        )

    def _check_partial(self, members: list[Member], names: set[str]) -> None:
        """A sync that leaves tensors out keeps those as each server serves them: only right
        when the servers serve the same weights, and never for a server that just joined."""
        for m in members:
            missing = m.manifest - names
            if m.fresh and missing:
                raise ValueError(
                    f"{m.name} joined the fleet since the last sync: send every tensor "
                    f"({len(missing)} missing, e.g. {sorted(missing)[:3]})"
                )
        if all(m.manifest <= names for m in members):
            return
        sums = self._checksums(members)
        unreadable = _rpc_errors(sums)
        if unreadable:
            raise FleetError(
                "servers whose weights cannot be digested: " + "; ".join(f"{n}: {e}" for n, e in unreadable.items())
            )
        _require_same({n: r.overall for n, r in sums.items()}, "serves other weights (send every tensor), digest")

    def _send_chunk(self, members: list[Member], chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every server's UpdateWeights and one vote and broadcast for all of them."""
        sender = self._sender
        assert sender is not None
        request = cpb.UpdateWeightsRequest(update_info_json=json.dumps(chunk.to_json()).encode())
        rpcs = {
            m.name: m.client.control.UpdateWeights.future(request, timeout=self._step_timeout_s(chunk.num_bytes))
            for m in members
        }
        vote = self._pool.submit(sender.vote, True)
        pending: set[Future] = {vote, *(_future(f) for f in rpcs.values())}
        while vote not in (done := wait(pending, return_when=FIRST_COMPLETED)[0]):
            pending -= done
            refused = _rpc_errors({n: f for n, f in rpcs.items() if f.done()})
            if refused:
                # Refused before its workers voted: the vote cannot complete. Ending that
                # server's membership makes the others' collective fail now, not at its deadline.
                sender.forget()
                for name in refused:
                    self._fence(self._members[name])
                wait([_future(f) for f in rpcs.values()])
                raise _Failed("chunk", _rpc_errors(rpcs) or refused)
        try:
            go = vote.result()
            if go:
                sender.broadcast(chunk, tensors)
        except RuntimeError:
            sender.forget()
            wait([_future(f) for f in rpcs.values()])
            raise _Failed("chunk", _rpc_errors(rpcs) or {"trainer": "the collective with the servers broke"}) from None
        # Every server took part in the vote (and the broadcast): the group is in step.
        wait([_future(f) for f in rpcs.values()])
        errors = _rpc_errors(rpcs)
        if errors or not go:
            raise _Failed("chunk", errors or {"trainer": "a server refused the chunk"})

    def _fence(self, member: Member) -> None:
        """Give `member` a transport of its own (a one-server rendezvous): its workers leave
        the fleet's group, and the other members' collective with them fails at once
        instead of at its deadline. Best effort: without it they fail at the deadline."""
        with contextlib.suppress(Exception):
            # A session left open (a refusal that never reached the server) blocks the init.
            member.lifecycle.AbortWeightUpdate(lifecycle_pb2.AbortWeightUpdateRequest(), timeout=self._rpc_timeout_s)
            alone = TensorSender(member.num_workers, master_address=self._address, timeout_s=min(self._timeout_s, 30.0))
            request = cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(alone.init_info()).encode())
            rpc = member.client.control.InitWeightTransferEngine.future(request, timeout=alone.timeout_s + RPC_MARGIN_S)
            self._pool.submit(alone.join)
            rpc.result()

    def _abandon(self, members: list[Member], paused: list[Member], failure: _Failed) -> FleetSyncError:
        """Before the vote: every server aborts and keeps its old weights; each one that
        still answers resumes; those that do not are dropped."""
        aborted = self._outcomes(
            members,
            lambda m: m.lifecycle.AbortWeightUpdate.future(
                lifecycle_pb2.AbortWeightUpdateRequest(), timeout=self._rpc_timeout_s
            ),
        )
        gone = [m for m in members if _is_gone(aborted[m.name])]
        resumed = self._outcomes(
            [m for m in paused if m not in gone],
            lambda m: m.client.control.ResumeGeneration.future(
                cpb.ResumeGenerationRequest(), timeout=self._rpc_timeout_s
            ),
        )
        outcomes = {
            m.name: failure.errors.get(m.name, f"aborted at {failure.step}: another server failed") for m in members
        }
        for m in gone:
            self._drop(m.name, f"unreachable after a failed sync: {aborted[m.name]}")
        not_resumed = {n: r for n, r in resumed.items() if r != OK}
        detail = f"; not resumed: {not_resumed}" if not_resumed else ""
        return FleetSyncError(
            f"the sync failed at {failure.step}, every server kept its old weights: {failure}{detail}",
            outcomes,
            [],
            [m.name for m in gone],
        )

    def _wrong_digests(self, members: list[Member], mine: Mapping[str, str]) -> dict[str, str]:
        sums = self._checksums(members)
        wrong: dict[str, str] = {}
        for name, served in sums.items():
            if isinstance(served, BaseException):
                wrong[name] = f"its digests cannot be read: {_describe(served)}"
                continue
            bad = sorted(
                {n for n, d in mine.items() if served.per_tensor.get(n) != d} | set(served.inconsistent_tensors)
            )
            if bad:
                wrong[name] = f"tensors {bad[:5]}"
        return wrong

    def _current_states(self) -> dict[str, Any]:
        """Every member's state; a member that does not answer is dropped with a report.
        Raises FleetError when another error comes back, or no member is left."""
        members = list(self._members.values())
        states = self._states(members)
        for name, state in list(states.items()):
            if isinstance(state, grpc.RpcError) and state.code() in GONE:
                self._drop(name, f"unreachable when a sync began: {_describe(state)}")
                del states[name]
        errors = _rpc_errors(states)
        if errors:
            raise FleetError("servers that refuse the fleet: " + "; ".join(f"{n}: {e}" for n, e in errors.items()))
        if not states:
            raise FleetError("no server is left in the fleet")
        return states

    # Fan-out helpers ----------------------------------------------------------------------

    def _each(self, members: list[Member], call: Callable[[Member], grpc.Future]) -> dict[str, Any]:
        """`call` on every member at once: each one's response, or its RpcError."""
        futures = {m.name: call(m) for m in members}
        out: dict[str, Any] = {}
        for name, f in futures.items():
            try:
                out[name] = f.result()
            except grpc.RpcError as e:
                out[name] = e
        return out

    def _states(self, members: list[Member]) -> dict[str, Any]:
        return self._each(
            members, lambda m: m.lifecycle.GetState.future(lifecycle_pb2.GetStateRequest(), timeout=self._rpc_timeout_s)
        )

    def _checksums(self, members: list[Member]) -> dict[str, Any]:
        request = lifecycle_pb2.GetWeightChecksumRequest()
        return self._each(members, lambda m: m.lifecycle.GetWeightChecksum.future(request, timeout=self._rpc_timeout_s))

    def _step(
        self, members: list[Member], step: str, call: Callable[[Member], grpc.Future], *, results: bool = False
    ) -> Any:
        """`call` on every member; raises _Failed naming those that failed. Returns the
        members it succeeded on (or, with `results`, their responses by name)."""
        replies = self._each(members, call)
        errors = _rpc_errors(replies)
        if errors:
            raise _Failed(step, errors)
        return replies if results else members

    def _outcomes(self, members: list[Member], call: Callable[[Member], grpc.Future]) -> dict[str, str]:
        """`call` on every member: OK (done) or what went wrong, by name."""
        return {n: _describe(r) if isinstance(r, BaseException) else OK for n, r in self._each(members, call).items()}

    def _step_timeout_s(self, num_bytes: int) -> float:
        return step_timeout_s(self._timeout_s, num_bytes)

    # Rollouts ----------------------------------------------------------------------------

    def generate(self, prompt: Any, **kw: Any) -> Any:
        return self.router.generate(prompt, **kw)

    def stream(self, prompt: Any, **kw: Any) -> Any:
        return self.router.stream(prompt, **kw)

    def generate_many(self, prompts: Sequence[Any], **kw: Any) -> Any:
        return self.router.generate_many(prompts, **kw)

    def close(self) -> None:
        self.router.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for m in self._members.values():
            if m.owned:
                m.client.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _future(f: grpc.Future) -> Future:
    """A concurrent.futures view of a gRPC future (to wait on it with others)."""
    out: Future = Future()
    f.add_done_callback(lambda done: out.set_result(None))
    return out


def _rpc_errors(replies: Mapping[str, Any]) -> dict[str, str]:
    """The failures among `replies` (responses, RpcErrors or gRPC futures), described."""
    errors: dict[str, str] = {}
    for name, reply in replies.items():
        if isinstance(reply, grpc.Future):
            reply = reply.exception() if reply.done() and not reply.cancelled() else None
        if isinstance(reply, BaseException):
            errors[name] = _describe(reply)
    return errors


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"


def _is_gone(outcome: str) -> bool:
    return any(outcome.startswith(code.name) for code in GONE)


def _require_same(values: Mapping[str, str], what: str) -> None:
    """FleetError naming the servers that differ from the most common value."""
    counts: dict[str, int] = {}
    for v in values.values():
        counts[v] = counts.get(v, 0) + 1
    if len(counts) <= 1:
        return
    common = max(counts, key=lambda v: counts[v])
    odd = {n: v for n, v in values.items() if v != common}
    raise FleetError("; ".join(f"{n} {what} {v[:32]!r}, the others {common[:32]!r}" for n, v in odd.items()))


def _names_digest(names: frozenset[str]) -> str:
    return combined_checksum(dict.fromkeys(names, ""))


def _check_votes(prepared: Mapping[str, Any], num_chunks: int, num_tensors: int) -> None:
    """Every server staged what was sent: the vote's content, not only its success."""
    wrong = {
        name: f"staged {r.session.num_chunks} chunks / {r.session.num_tensors} tensors, {num_chunks} / {num_tensors} were sent"
        for name, r in prepared.items()
        if (r.session.num_chunks, r.session.num_tensors) != (num_chunks, num_tensors) or not r.session.prepared
    }
    if wrong:
        raise _Failed("prepare", wrong)


class AsyncFleet:
    """The asyncio twin of `Fleet`, over the same machinery: its blocking calls run in worker
    threads of its own, so the trainer's event loop goes on (rollouts included) while a sync
    runs. `servers` and the arguments as `Fleet`'s, or a `Fleet` to drive (not closed here)."""

    def __init__(self, servers: Fleet | Iterable[str | Client], *, max_concurrency: int = 256, **kw: Any) -> None:
        """`max_concurrency`: requests in flight at once (each holds a thread)."""
        self._owned = not isinstance(servers, Fleet)
        self.fleet = Fleet(servers, **kw) if not isinstance(servers, Fleet) else servers
        self._threads = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rlserve-async-fleet")

    async def _in_thread(self, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._threads, lambda: call(*args, **kw))

    @property
    def servers(self) -> tuple[str, ...]:
        return self.fleet.servers

    @property
    def dropped(self) -> list[Dropped]:
        return self.fleet.dropped

    def add(self, server: str | Client) -> str:
        return self.fleet.add(server)

    def remove(self, server: str) -> None:
        self.fleet.remove(server)

    async def init(self, *, require_same_weights: bool = True) -> None:
        await self._in_thread(self.fleet.init, require_same_weights=require_same_weights)

    async def sync(self, weights: NamedTensors, version: str, **kw: Any) -> FleetSyncStats:
        return await self._in_thread(self.fleet.sync, weights, version, **kw)

    async def generate(self, prompt: Any, **kw: Any) -> Routed:
        return await self._in_thread(self.fleet.router.generate, prompt, **kw)

    async def generate_many(self, prompts: Sequence[Any], **kw: Any) -> list[Routed | BaseException]:
        return await self._in_thread(self.fleet.router.generate_many, prompts, **kw)

    async def stream(self, prompt: Any, **kw: Any) -> AsyncIterator[Routed]:
        """Each response as it arrives; leaving the loop early cancels the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stop = threading.Event()

        def pump() -> None:
            responses = self.fleet.router.stream(prompt, **kw)
            try:
                for routed in responses:
                    loop.call_soon_threadsafe(queue.put_nowait, routed)
                    if stop.is_set():
                        break
            except BaseException as e:  # handed to the consumer
                loop.call_soon_threadsafe(queue.put_nowait, e)
            finally:
                responses.close()  # cancels the call when it was left early
                loop.call_soon_threadsafe(queue.put_nowait, _END)

        pumping = asyncio.ensure_future(self._in_thread(pump))
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            await pumping

    async def close(self) -> None:
        if self._owned:
            await self._in_thread(self.fleet.close)
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AsyncFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


_END = object()
