"""The one weight-sync protocol, over any number of servers (its members; `WeightSync` runs
it over one, `Fleet` over many):

    pause -> start -> chunks (every server stages and checks each) ->
    prepare (the vote) -> finish with one version -> verify digests -> resume

or, staged (servers that stage updates while they generate, StageWeightUpdate), with the
pause moved after the vote, so that generation stops only for the swap:

    stage -> chunks -> prepare (the vote) -> pause -> finish -> resume -> verify digests

All or nothing holds up to the vote: a member that refuses a chunk, whose transport breaks,
that dies or whose prepare fails makes every member abort (`Abandoned`); each keeps the
weights and version it served, and those the sync paused resume where their weights are
whole. After the vote a staged commit is only a swap of tensors the server already holds; a
member that fails there, or serves other weights than were sent, is reported in the
`SyncReport` (its caller decides: `WeightSync` recovers it, a fleet drops it). A pause
someone else made (found when the sync began) is left in place.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from rlserve.api.rlserve.v1 import lifecycle_pb2
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.sdk.fanout import COMMITTED, Failed, Member, Outcome, each, each_outcome, step, step_timeout_s
from rlserve.sdk.group import TransferGroup
from rlserve.sdk.plan import Payload
from rlserve.types import PauseMode
from rlserve.wire.protocol import ChunkInfo

PAUSE_MODES = {
    PauseMode.ABORT: cpb.PAUSE_MODE_ABORT,
    PauseMode.WAIT: cpb.PAUSE_MODE_WAIT,
    PauseMode.KEEP: cpb.PAUSE_MODE_KEEP,
}


@dataclass(frozen=True)
class SyncRequest:
    """One sync: what to send to whom, and how."""

    members: Sequence[Member]
    payload: Payload
    version: str
    pause_mode: PauseMode = PauseMode.KEEP
    verify: bool = True
    # Verify before the resume (a member serving other weights stays paused), or after it
    # (the pause is shorter; the check still fails the sync).
    verify_while_paused: bool = True
    # Members someone else had paused when the sync began: their pause is theirs to end.
    found_paused: Collection[str] = ()
    bar: Any = None
    # Stage while generating, pause only for the commit (every member must offer it).
    staged: bool = False


@dataclass
class SyncReport:
    """How a sync that passed its vote ended, member by member."""

    outcomes: dict[str, Outcome]
    # Per member: how its FinishWeightUpdate went.
    finished: dict[str, Outcome]
    # Per member that was verified: its GetWeightChecksum answer.
    served: dict[str, Any]
    # Per member the sync resumed: how the resume went.
    resumed: dict[str, Outcome]
    # The digests of what was sent, by tensor name, and the chunks it went in.
    sent: dict[str, str]
    chunks: list[ChunkInfo]
    transfer_s: float
    prepare_s: float
    commit_s: float
    pause_to_resume_s: float
    # PauseGeneration, until every member had stopped: an engine ends the step in flight
    # first, so under load this is about one engine step (the floor of pause_to_resume_s).
    pause_s: float = 0.0
    # Staged: from opening the sessions to the vote, generation going on meanwhile.
    staged: bool = False
    stage_s: float = 0.0
    committed: list[Member] = field(default_factory=list)
    failed: list[Member] = field(default_factory=list)


class Abandoned(Exception):
    """The sync failed before the vote: every member aborted its update. `outcomes`: per
    member, why; `kept`: the members that still serve their old weights, whole (resumed if
    the sync had paused them); `gone`: those that do not answer; `not_resumed`: members the
    sync paused whose resume failed."""

    def __init__(
        self,
        failure: Failed,
        outcomes: Mapping[str, Outcome],
        kept: Sequence[str],
        gone: Sequence[str],
        not_resumed: Mapping[str, Outcome],
    ) -> None:
        super().__init__(str(failure))
        self.failure = failure
        self.outcomes, self.not_resumed = dict(outcomes), dict(not_resumed)
        self.kept, self.gone = tuple(kept), tuple(gone)

    @property
    def cause(self) -> Outcome:
        """The first failure (a member's or the trainer's), for a one-line report."""
        return next(iter(self.failure.errors.values()))


class SyncProtocol:
    """Runs syncs over a `TransferGroup` built for their members. Timeouts as `WeightSync`'s."""

    def __init__(self, group: TransferGroup, *, timeout_s: float, rpc_timeout_s: float, pause_timeout_s: float) -> None:
        self._group = group
        self._timeout_s, self._rpc_timeout_s, self._pause_timeout_s = timeout_s, rpc_timeout_s, pause_timeout_s

    def run(self, sync: SyncRequest) -> SyncReport:
        """Raises Abandoned before the vote; after it, returns the report (failures in it)."""
        members = list(sync.members)
        t_begin = time.perf_counter()
        if sync.staged:
            sent, transfer_s, prepare_s = self._staged_up_to_the_vote(sync, members)
            stage_s, t_pause = time.perf_counter() - t_begin, time.perf_counter()
            self._pause_after_the_vote(sync, members)
            pause_s = time.perf_counter() - t_pause
        else:
            stage_s, t_pause = 0.0, t_begin
            replies = self._pause(sync, members)
            pause_s = time.perf_counter() - t_pause
            sent, transfer_s, prepare_s = self._up_to_the_vote(sync, members, replies)
        report = self._commit(sync, members, sent, transfer_s, prepare_s)
        report.staged, report.stage_s, report.pause_s = sync.staged, stage_s, pause_s
        if sync.verify and sync.verify_while_paused:
            self._verify(members, report)
        to_resume = [m for m in members if report.outcomes[m.name] == COMMITTED and m.name not in sync.found_paused]
        report.resumed = each_outcome(to_resume, self._call("ResumeGeneration", cpb.ResumeGenerationRequest()))
        report.pause_to_resume_s = time.perf_counter() - t_pause
        if sync.verify and not sync.verify_while_paused:
            self._verify(members, report)
        report.committed = [m for m in members if report.outcomes[m.name] == COMMITTED]
        report.failed = [m for m in members if report.outcomes[m.name] != COMMITTED]
        return report

    def _up_to_the_vote(
        self, sync: SyncRequest, members: list[Member], replies: dict[str, Any]
    ) -> tuple[list[ChunkInfo], float, float]:
        """After the pause (`replies`, per member): start, chunks, prepare and the vote; any
        failure abandons the sync (Abandoned). Returns the chunks sent (with their digests),
        the seconds of the transfer and of the prepare."""
        paused = [m for m in members if not isinstance(replies[m.name], BaseException)]
        ours = [m for m in paused if m.name not in sync.found_paused]
        with self._abandoning(members, ours):
            if len(paused) < len(members):
                raise Failed("pause", {n: Outcome.of(r) for n, r in replies.items() if isinstance(r, BaseException)})
            step(members, "start", self._call("StartWeightUpdate", cpb.StartWeightUpdateRequest()))
            return self._send_and_vote(sync, members)

    def _staged_up_to_the_vote(self, sync: SyncRequest, members: list[Member]) -> tuple[list[ChunkInfo], float, float]:
        """Stage, chunks, prepare and the vote while every member generates; a failure
        abandons the sync (Abandoned) before any member was paused for it."""
        with self._abandoning(members, []):
            stage = lifecycle_pb2.StageWeightUpdateRequest()
            step(members, "stage", self._call("StageWeightUpdate", stage, lifecycle=True))
            return self._send_and_vote(sync, members)

    def _pause_after_the_vote(self, sync: SyncRequest, members: list[Member]) -> None:
        """Every member voted yes: pause them all for the commit; one that cannot be paused
        abandons the sync (the others resume on their old weights)."""
        replies = self._pause(sync, members)
        failed = {n: Outcome.of(r) for n, r in replies.items() if isinstance(r, BaseException)}
        if failed:
            ours = [m for m in members if m.name not in failed and m.name not in sync.found_paused]
            raise self.abandon(members, ours, Failed("pause", failed))

    def _pause(self, sync: SyncRequest, members: list[Member]) -> dict[str, Any]:
        """PauseGeneration on every member at once: per member its reply or its error."""
        pause = cpb.PauseGenerationRequest(mode=PAUSE_MODES[sync.pause_mode])
        return each(members, lambda m: m.client.control.PauseGeneration.future(pause, timeout=self._pause_timeout_s))

    def _send_and_vote(self, sync: SyncRequest, members: list[Member]) -> tuple[list[ChunkInfo], float, float]:
        layout = sync.payload.layout
        num_bytes = sum(c.num_bytes for c in layout)
        t0 = time.perf_counter()
        sent = []
        for chunk, tensors in sync.payload.chunks():
            self._group.send_chunk(members, chunk, tensors, sync.bar)
            sent.append(chunk)
        transfer_s = time.perf_counter() - t0
        prepared = step(
            members,
            "prepare",
            self._call(
                "PrepareWeightUpdate",
                lifecycle_pb2.PrepareWeightUpdateRequest(),
                lifecycle=True,
                timeout_s=step_timeout_s(self._timeout_s, num_bytes),
            ),
        )
        check_votes(prepared, len(sent), sum(len(c.tensors) for c in sent))
        return sent, transfer_s, time.perf_counter() - t0 - transfer_s

    @contextlib.contextmanager
    def _abandoning(self, members: list[Member], ours: list[Member]) -> Iterator[None]:
        """Any failure inside abandons the sync: Abandoned, `ours` resumed where whole."""
        try:
            yield
        except Failed as e:
            raise self.abandon(members, ours, e) from e
        except Exception as e:  # the trainer's side (a tensor that cannot be copied, say)
            raise self.abandon(members, ours, Failed("transfer", {"trainer": Outcome.of(e)})) from e

    def _commit(
        self, sync: SyncRequest, members: list[Member], sent: list[ChunkInfo], transfer_s: float, prepare_s: float
    ) -> SyncReport:
        """The vote is in: from here on a member that fails is reported, the others commit."""
        num_bytes = sum(c.num_bytes for c in sent)
        t_commit = time.perf_counter()
        finish = cpb.FinishWeightUpdateRequest(weight_version=sync.version)
        finished = each_outcome(
            members,
            self._call("FinishWeightUpdate", finish, timeout_s=step_timeout_s(self._timeout_s, num_bytes)),
        )
        commit_s = time.perf_counter() - t_commit
        report = SyncReport(
            outcomes={n: COMMITTED if r.ok else r.at("commit failed") for n, r in finished.items()},
            finished=finished,
            served={},
            resumed={},
            sent={t.name: t.checksum for c in sent for t in c.tensors},
            chunks=sent,
            transfer_s=transfer_s,
            prepare_s=prepare_s,
            commit_s=commit_s,
            pause_to_resume_s=0.0,
        )
        return report

    def abandon(self, members: Sequence[Member], ours: Sequence[Member], failure: Failed) -> Abandoned:
        """Before the vote: every member aborts; one whose weights are whole keeps them and,
        if the sync paused it, resumes."""
        aborted = each_outcome(
            members, self._call("AbortWeightUpdate", lifecycle_pb2.AbortWeightUpdateRequest(), lifecycle=True)
        )
        gone = [m.name for m in members if aborted[m.name].gone]
        alive = [m for m in members if m.name not in gone]
        states = each(alive, self._call("GetState", lifecycle_pb2.GetStateRequest(), lifecycle=True))
        kept = [
            m.name
            for m in alive
            if not isinstance(s := states[m.name], BaseException) and s.weights_consistent and not s.asleep
        ]
        resumed = each_outcome(
            [m for m in ours if m.name in kept], self._call("ResumeGeneration", cpb.ResumeGenerationRequest())
        )
        outcomes = {
            m.name: failure.errors.get(m.name, Outcome.failure(f"aborted at {failure.step}: another server failed"))
            for m in members
        }
        return Abandoned(failure, outcomes, kept, gone, {n: r for n, r in resumed.items() if not r.ok})

    def _verify(self, members: Sequence[Member], report: SyncReport) -> None:
        """The digests every committed member serves, read back from its model: a tensor that
        did not arrive, was loaded wrongly or is computed with a stale kernel shows up here."""
        committed = [m for m in members if report.outcomes[m.name] == COMMITTED]
        # The server reads back every tensor the commit changed, as its kernels compute it:
        # work of the model's size, like a chunk's (a minute for SmolLM2 in bf16 on a CPU
        # without native bf16), not a plain call's.
        deadline_s = step_timeout_s(self._timeout_s, sum(c.num_bytes for c in report.chunks))
        checksum = lifecycle_pb2.GetWeightChecksumRequest()
        sums = each(committed, self._call("GetWeightChecksum", checksum, lifecycle=True, timeout_s=deadline_s))
        for name, served in sums.items():
            if isinstance(served, BaseException):
                report.outcomes[name] = Outcome.of(served).at("committed, but its digests could not be read")
                continue
            report.served[name] = served
            wrong = sorted(
                {n for n, d in report.sent.items() if served.per_tensor.get(n) != d} | set(served.inconsistent_tensors)
            )
            if wrong:
                report.outcomes[name] = Outcome.failure(f"serves other weights after its commit: tensors {wrong[:5]}")

    def _call(self, method: str, request: Any, *, lifecycle: bool = False, timeout_s: float | None = None) -> Any:
        """`m -> m.<stub>.<method>.future(request)`, with the RPC deadline unless given."""
        timeout = self._rpc_timeout_s if timeout_s is None else timeout_s

        def call(m: Member) -> grpc.Future:
            stub = m.lifecycle if lifecycle else m.client.control
            return getattr(stub, method).future(request, timeout=timeout)

        return call


def staging(offered: bool, asked: bool | None, refuse: Callable[[], Exception]) -> bool:
    """Whether a sync stages: as `asked`, or where every member `offered` it (None); asked
    where it is not offered, `refuse()` is raised."""
    if asked and not offered:
        raise refuse()
    return offered if asked is None else asked


def check_votes(prepared: Mapping[str, Any], num_chunks: int, num_tensors: int) -> None:
    """Every member staged what was sent: the vote's content, not only its success."""
    wrong = {
        name: Outcome.failure(
            f"staged {r.session.num_chunks} chunks / {r.session.num_tensors} tensors, "
            f"{num_chunks} / {num_tensors} were sent"
        )
        for name, r in prepared.items()
        if (r.session.num_chunks, r.session.num_tensors) != (num_chunks, num_tensors) or not r.session.prepared
    }
    if wrong:
        raise Failed("prepare", wrong)
