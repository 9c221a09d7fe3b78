"""`Fleet`: several rlserve servers synced as one (the package docstring says how), their
membership, and rollouts routed across them."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import torch

from rlserve.api.rlserve.v1 import lifecycle_pb2
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.config import DEFAULT_TRANSFER_TIMEOUT_S
from rlserve.sdk.client import ChannelCredentials, Client
from rlserve.sdk.fanout import Member, Outcome, by_name, each, rpc_errors, step_timeout_s
from rlserve.sdk.fleet.members import (
    Dropped,
    FleetError,
    FleetSyncError,
    FleetSyncStats,
    names_digest,
    require_same,
)
from rlserve.sdk.fleet.routing import FleetRouter
from rlserve.sdk.group import RendezvousFailed, TransferGroup
from rlserve.sdk.plan import DEFAULT_CHUNK_BYTES, NamedTensors, check_sizes, plan
from rlserve.sdk.protocol import Abandoned, SyncProtocol, SyncReport, SyncRequest, staging
from rlserve.sdk.senders import SENDERS
from rlserve.types import PauseMode
from rlserve.wire.protocol import DEFAULT_BUCKET_BYTES, combined_checksum

logger = logging.getLogger(__name__)


class Fleet:
    """Several rlserve servers (one backend: rlserve_gloo, or rlserve_shm for servers on the
    trainer's host; staged updates) synced as one. Blocking; one sync at a time. `servers`:
    addresses ("host:port") or `Client`s."""

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
        check_sizes(bucket_bytes, chunk_bytes)
        self._credentials = credentials
        self._timeout_s = timeout_s
        self._bucket_bytes, self._chunk_bytes = bucket_bytes, chunk_bytes
        self._rpc_timeout_s, self._pause_timeout_s = rpc_timeout_s, pause_timeout_s
        self._members: dict[str, Member] = {}
        for server in servers:
            self._add(server, fresh=False)
        if not self._members:
            raise ValueError("a fleet needs at least one server")
        self.dropped: list[Dropped] = []
        self._group = TransferGroup(
            master_address=master_address, master_port=master_port, timeout_s=timeout_s, rpc_timeout_s=rpc_timeout_s
        )
        self._protocol = SyncProtocol(
            self._group, timeout_s=timeout_s, rpc_timeout_s=rpc_timeout_s, pause_timeout_s=pause_timeout_s
        )
        self.router = FleetRouter(lambda: self.clients)

    # Membership --------------------------------------------------------------------------

    @property
    def servers(self) -> tuple[str, ...]:
        return tuple(self._members)

    @property
    def master(self) -> tuple[str, int] | None:
        """Where the trainer's end of the fleet's group listens (rlserve_gloo); None until
        `init()`."""
        sender = self._group.sender
        return sender.master if sender is not None else None

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

    def init(self, *, require_same_weights: bool = True, span: int = DEFAULT_CHUNK_BYTES) -> None:
        """Check every server, then build one transport to all their workers (bounded by the
        transfer timeout; `span`: room for chunks that large, over shared memory). Raises
        FleetError naming the server that does not fit: not reachable or not authenticated,
        a backend the SDK has no sender for or another than the rest, in-place updates (the
        fleet's all-or-nothing needs staged ones), another checkpoint or dtype, or (with
        `require_same_weights`, servers that are not new) other weights than the rest."""
        self._group.forget()
        members = list(self._members.values())
        if not members:
            raise FleetError("no server is left in the fleet")
        infos = each(
            members,
            lambda m: m.client.control.GetServerInfo.future(cpb.GetServerInfoRequest(), timeout=self._rpc_timeout_s),
        )
        states = self._states(members)
        unfit = {**rpc_errors(infos), **rpc_errors(states)}
        if unfit:
            raise FleetError("servers that cannot be reached: " + by_name(unfit))
        for m in members:
            info, state = infos[m.name], states[m.name]
            backend = info.rl_capabilities.weight_transfer_backend
            if backend not in SENDERS:
                raise FleetError(
                    f"{m.name}: its weight-transfer backend is {backend or 'none'!r}; a fleet needs one of {sorted(SENDERS)}"
                )
            if not state.stages_updates:
                raise FleetError(
                    f"{m.name}: it installs updates in place (--weight-update-mode in-place); a fleet needs staged updates"
                )
            m.num_workers = info.parallelism.world_size * max(1, info.parallelism.data_parallel_size)
        require_same({m.name: infos[m.name].rl_capabilities.weight_transfer_backend for m in members}, "runs backend")
        dtypes = {m.name: states[m.name].weight_dtype for m in members}
        require_same(dtypes, "serves weights in")
        sums = self._readable_checksums(members, states)
        for m in members:
            m.manifest = frozenset(sums[m.name].per_tensor)
        require_same({m.name: names_digest(m.manifest) for m in members}, "serves another checkpoint (tensor names):")
        if require_same_weights:
            settled = {m.name: sums[m.name].overall for m in members if not m.fresh}
            require_same(settled, "serves other weights, digest")
        try:
            self._group.rendezvous(members, infos[members[0].name].rl_capabilities.weight_transfer_backend, span=span)
        except RendezvousFailed as e:
            raise FleetError(str(e)) from e

    # Sync --------------------------------------------------------------------------------

    def sync(
        self,
        weights: NamedTensors,
        version: str,
        *,
        pause_mode: PauseMode | str = PauseMode.KEEP,
        verify: bool = True,
        staged: bool | None = None,
    ) -> FleetSyncStats:
        """Push `weights` (checkpoint names; a subset updates only those, unless a server
        joined since the last sync) into every server and publish `version` on all of them,
        as described in the module's docstring. `staged` (default: where every server offers
        it): all stage and prepare while generating, then all pause for the commit, so that
        the fleet's pause lasts for the slowest commit, not the slowest transfer. Raises
        FleetSyncError."""
        mode = PauseMode(pause_mode)
        t_init = time.perf_counter()
        states = self._current_states()
        members = list(self._members.values())
        # A member someone else paused (an operator draining it) stays paused: theirs to end.
        found_paused = {n for n, s in states.items() if s.pause_phase != lifecycle_pb2.PAUSE_PHASE_RUNNING}
        dtype = getattr(torch, states[members[0].name].weight_dtype, None)
        payload = plan(weights, dtype, chunk_bytes=self._chunk_bytes, bucket_bytes=self._bucket_bytes)
        layout = payload.layout
        if not self._group.spans(list(self._members), layout) or not all(s.transport_ready for s in states.values()):
            self.init(require_same_weights=False, span=self._group.span_of(layout))
        init_s = time.perf_counter() - t_init
        self._check_partial(members, states, {t.name for c in layout for t in c.tensors})
        offered = all(s.staged_weight_updates for s in states.values())
        staged = staging(offered, staged, _cannot_stage)
        request = SyncRequest(members, payload, version, mode, verify, found_paused=found_paused, staged=staged)
        try:
            report = self._protocol.run(request)
        except Abandoned as e:
            raise self._abandoned(members, e) from e
        for m in report.failed:
            self._drop(m.name, f"sync to {version!r}: {report.outcomes[m.name]}")
        if report.failed:
            raise FleetSyncError(
                f"the sync to {version!r} committed on {len(report.committed)} of {len(members)} servers; dropped: "
                + "; ".join(f"{m.name}: {report.outcomes[m.name]}" for m in report.failed),
                report.outcomes,
                [m.name for m in report.committed],
                [m.name for m in report.failed],
            )
        for m in members:
            m.fresh = False
        stuck = {n: str(r) for n, r in report.resumed.items() if not r.ok}
        if stuck:
            logger.warning("fleet: committed %r but resume failed on %s", version, stuck)
        return _stats(report, version, members, init_s, found_paused)

    def _check_partial(self, members: list[Member], states: dict[str, Any], names: set[str]) -> None:
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
        sums = self._readable_checksums(members, states)
        require_same({n: r.overall for n, r in sums.items()}, "serves other weights (send every tensor), digest")

    def _abandoned(self, members: list[Member], abandoned: Abandoned) -> FleetSyncError:
        """Before the vote: every server aborted and keeps its old weights; those that do not
        answer are dropped."""
        for name in abandoned.gone:
            self._drop(name, f"unreachable after a failed sync: {abandoned.outcomes[name]}")
        not_resumed = {n: str(r) for n, r in abandoned.not_resumed.items()}
        detail = f"; not resumed: {not_resumed}" if not_resumed else ""
        return FleetSyncError(
            f"the sync failed at {abandoned.failure.step}, every server kept its old weights: "
            f"{abandoned.failure}{detail}",
            abandoned.outcomes,
            [],
            list(abandoned.gone),
        )

    def _current_states(self) -> dict[str, Any]:
        """Every member's state; a member that does not answer is dropped with a report.
        Raises FleetError when another error comes back, or no member is left."""
        members = list(self._members.values())
        states = self._states(members)
        for name, state in list(states.items()):
            if isinstance(state, grpc.RpcError) and Outcome.of(state).gone:
                self._drop(name, f"unreachable when a sync began: {Outcome.of(state)}")
                del states[name]
        errors = rpc_errors(states)
        if errors:
            raise FleetError("servers that refuse the fleet: " + by_name(errors))
        if not states:
            raise FleetError("no server is left in the fleet")
        return states

    # Fan-out helpers ----------------------------------------------------------------------

    def _states(self, members: list[Member]) -> dict[str, Any]:
        return each(
            members, lambda m: m.lifecycle.GetState.future(lifecycle_pb2.GetStateRequest(), timeout=self._rpc_timeout_s)
        )

    def _readable_checksums(self, members: list[Member], states: dict[str, Any]) -> dict[str, Any]:
        """Every member's digests; FleetError naming those whose digests cannot be read. Each
        server reads every tensor back through its kernels: waited for as work of the
        model's size (`weight_bytes` in its state), not as a plain call."""
        deadline_s = step_timeout_s(self._timeout_s, max(states[m.name].weight_bytes for m in members))
        request = lifecycle_pb2.GetWeightChecksumRequest()
        sums = each(members, lambda m: m.lifecycle.GetWeightChecksum.future(request, timeout=deadline_s))
        unreadable = rpc_errors(sums)
        if unreadable:
            raise FleetError("servers whose weights cannot be digested: " + by_name(unreadable))
        return sums

    # Rollouts ----------------------------------------------------------------------------

    def generate(self, prompt: Any, **kw: Any) -> Any:
        return self.router.generate(prompt, **kw)

    def stream(self, prompt: Any, **kw: Any) -> Any:
        return self.router.stream(prompt, **kw)

    def generate_many(self, prompts: Sequence[Any], **kw: Any) -> Any:
        return self.router.generate_many(prompts, **kw)

    def close(self) -> None:
        self.router.close()
        self._group.close()
        for m in self._members.values():
            if m.owned:
                m.client.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cannot_stage() -> ValueError:
    return ValueError("not every server can stage an update while it generates: sync with staged=False")


def _stats(
    report: SyncReport, version: str, members: list[Member], init_s: float, found_paused: set[str]
) -> FleetSyncStats:
    return FleetSyncStats(
        weight_version=version,
        servers=tuple(m.name for m in members),
        num_tensors=len(report.sent),
        num_bytes=sum(c.num_bytes for c in report.chunks),
        num_chunks=len(report.chunks),
        init_s=init_s,
        transfer_s=report.transfer_s,
        prepare_s=report.prepare_s,
        commit_s=report.commit_s,
        pause_to_resume_s=report.pause_to_resume_s,
        pause_s=report.pause_s,
        checksum=combined_checksum(report.sent),
        left_paused=tuple(sorted(found_paused)),
        staged=report.staged,
        stage_s=report.stage_s,
    )
