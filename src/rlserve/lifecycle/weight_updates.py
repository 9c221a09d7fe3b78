"""Weight-update transitions: transport init, session start, chunks, prepare, commit, abort;
each re-arms the pause's idle lease (the controller's, `lifecycle.lease`). Changes the state only through the
`StateOwner` it shares with the lifecycle controller; talks to the backend only through the
engine's typed `WeightTransport`, so it knows no backend's wire format. No grpc.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING

from rlserve.caller import CURRENT
from rlserve.config import chunk_deadline_s
from rlserve.errors import CapabilityMissing, CommitFailed, PrepareFailed, StaleBase, TransferTimeout, WrongState
from rlserve.lifecycle.lease import SessionLease
from rlserve.lifecycle.mutation import survives_caller_cancellation
from rlserve.lifecycle.owner import StateOwner
from rlserve.lifecycle.rendezvous import check_trainer_host
from rlserve.lifecycle.state import (
    UpdateSession,
    check_can_commit,
    check_can_init_transport,
    check_can_start_update,
    check_weight_version,
    require_session,
)
from rlserve.payloads import parse_json

if TYPE_CHECKING:
    from rlserve.engine.transport import WeightTransport
    from rlserve.lifecycle.interfaces import ControlledEngine
    from rlserve.types import ServedChecksums


class WeightUpdates:
    def __init__(
        self,
        owner: StateOwner,
        engine: ControlledEngine,
        *,
        timeout_s: float,
        max_info_bytes: int,
        allowed_hosts: tuple[str, ...] = (),
        lease: SessionLease,
    ) -> None:
        """`lease`: the pause's idle lease, the controller's; every update call re-arms it."""
        self._owner = owner
        self._engine = engine
        self._timeout_s = timeout_s
        self._info_limit = ("max_transfer_info_bytes", max_info_bytes)
        self._allowed_hosts = allowed_hosts
        self._lease = lease

    async def init(self, init_info_json: bytes) -> None:
        """Set up (or replace) the transport with the trainer. Capped by the server's
        transfer timeout, and ended when the caller goes away; it holds no lock while the
        trainer connects, so generation and every other call go on meanwhile. On failure the
        previous transport (if any) stays as it was. Raises CapabilityMissing, InvalidRequest,
        UpdateInProgress, TransferTimeout."""
        transport = self.transport()
        try:
            raw = parse_json(init_info_json, "init_info_json", self._info_limit)
            init = transport.parse_init(raw, self._timeout_s)
            if init.trainer_host is not None:
                await check_trainer_host(init.trainer_host, CURRENT.get().peer_host, self._allowed_hosts)
        except Exception as e:
            self._owner.record("init_weight_transfer", "refused init_info", type(e).__name__)
            raise
        with self._owner.audited("init_weight_transfer", f"{init.detail} timeout_s={init.timeout_s:g}"):
            async with self._owner.lock:
                check_can_init_transport(self._owner.state)
                self._lease.disarm()  # the trainer came back
                self._owner.publish(lambda s: s.transport(initializing=True))
            ready = False
            try:
                await transport.init(init)
                ready = True
            finally:
                self._owner.publish(lambda s: s.transport(ready=True if ready else None, initializing=False))

    @survives_caller_cancellation
    async def start(self, is_draft: bool = False, staged: bool = False) -> UpdateSession:
        """Open a session: under a pause, or `staged` while generation goes on (its commit
        then needs the pause). Raises CapabilityMissing (also `staged` for a backend that
        writes in place), UpdateInProgress (ABORTED), TransportNotReady / NotPaused /
        MemoryAsleep (FAILED_PRECONDITION)."""
        async with self._owner.lock:
            with self._owner.audited("stage_weight_update" if staged else "start_weight_update", f"draft={is_draft}"):
                transport = self.transport()
                if is_draft and not self._engine.capabilities().draft_weight_updates_enabled:
                    raise CapabilityMissing("this engine has no draft model whose weights could be updated")
                if staged and not transport.stages_updates:
                    raise CapabilityMissing(
                        f"{transport.backend} writes updates into the served weights (in place): it cannot stage "
                        "one while generating; pause generation and StartWeightUpdate"
                    )
                check_can_start_update(self._owner.state, staged)
                await transport.start(is_draft, self._timeout_s)
                session = UpdateSession(uuid.uuid4().hex, is_draft, time.time(), staged=staged)
                if transport.stages_updates:
                    self._owner.publish(lambda s: s.in_session(session))
                else:
                    self._owner.publish(
                        lambda s: s.in_session(session).mark_inconsistent("an in-place weight update is open")
                    )
                self._lease.arm(session.session_id)
                return session

    @survives_caller_cancellation
    async def update(self, update_info_json: bytes) -> None:
        """Receive one chunk (the backend's update_info as JSON). Any refusal drops the
        session, malformed JSON included; with a staging backend the served weights are
        unchanged, and a transfer that broke half way leaves the transport unusable until the
        next init. Raises NoUpdateSession, InvalidRequest, TransferTimeout."""
        async with self._owner.lock:
            with self._owner.audited("update_weights", f"{len(update_info_json)} bytes of update_info"):
                session = require_session(self._owner.state, "UpdateWeights")
                if session.prepared:
                    raise WrongState(
                        f"weight update {session.session_id} is prepared for its commit: "
                        "FinishWeightUpdate or AbortWeightUpdate"
                    )
                transport = self.transport()
                self._lease.disarm()
                try:
                    raw = parse_json(update_info_json, "update_info_json", self._info_limit)
                    chunk = transport.parse_chunk(raw)
                    served = self._owner.state.weight_version
                    if chunk.base_weight_version is not None and chunk.base_weight_version != served:
                        raise StaleBase(
                            f"the patch builds on weight version {chunk.base_weight_version[:64]!r}, this server "
                            f"serves {served[:64]!r}: send the whole tensors, or a patch on {served[:64]!r}"
                        )
                    timeout_s = chunk_deadline_s(self._timeout_s, chunk.num_bytes)
                    held = await transport.update(chunk, timeout_s)
                except BaseException as e:
                    await self.drop_session("an update chunk failed")
                    if isinstance(e, TransferTimeout):
                        self._owner.publish(lambda s: s.transport(ready=False))
                    # The trainer has a lease to come back (start again, or resume); if it
                    # does not, generation resumes on the old weights.
                    self._lease.arm(None)
                    raise
                received = replace(
                    session,
                    num_chunks=session.num_chunks + 1,
                    num_tensors=session.num_tensors + chunk.num_tensors,
                    num_bytes=session.num_bytes + chunk.num_bytes,
                    shadow_bytes=held,
                )
                self._owner.publish(lambda s: s.in_session(received))
                self._lease.arm(session.session_id)

    @survives_caller_cancellation
    async def prepare(self) -> UpdateSession:
        """Phase one of a two-phase commit: everything `finish` could fail at short of the
        swap, done beside the served weights (a no-op for an in-place backend). The session
        stays open. A failure drops it; with a staging backend nothing changed. Raises
        NoUpdateSession, PrepareFailed."""
        async with self._owner.lock:
            with self._owner.audited("prepare_weight_update", ""):
                session = require_session(self._owner.state, "PrepareWeightUpdate", lora=False)
                transport = self.transport()
                self._lease.disarm()
                try:
                    held = await transport.prepare(self._timeout_s)
                except BaseException as e:
                    await self.drop_session("an in-place update failed to prepare its commit")
                    self._lease.arm(None)
                    if isinstance(e, CommitFailed):
                        raise PrepareFailed(f"preparing the commit failed, the update was dropped: {e}") from e
                    raise
                session = replace(session, prepared=True, shadow_bytes=held)
                self._owner.publish(lambda s: s.in_session(session))
                self._lease.arm(session.session_id)
                return session

    @survives_caller_cancellation
    async def finish(self, version: str | None) -> None:
        """Commit: new weights go live, every cached KV block is dropped, the version (if
        given) is published. A commit that fails half way marks the weights inconsistent
        (resume refused until a complete update succeeds); the next update starts clean.
        Raises NoUpdateSession, InvalidRequest, CommitFailed."""
        async with self._owner.lock:
            with self._owner.audited("finish_weight_update", f"version={(version or '')[:64]!r}"):
                session = require_session(self._owner.state, "FinishWeightUpdate", lora=False)
                check_can_commit(self._owner.state, session)
                if version is not None:
                    check_weight_version(version)
                transport = self.transport()
                self._lease.disarm()
                try:
                    await transport.finish(self._timeout_s)
                except BaseException as e:
                    reason = f"the commit failed half way ({type(e).__name__})"
                    self._owner.publish(lambda s: s.in_session(None).mark_inconsistent(reason))
                    if isinstance(e, Exception) and not isinstance(e, CommitFailed):
                        raise CommitFailed(f"{reason}: {e}") from e
                    raise
                await self._engine.reset_prefix_cache()
                if version is not None and version != self._owner.state.weight_version:
                    await self._engine.set_weight_version(version)
                    self._owner.publish(lambda s: s.in_session(None).consistent().versioned(version))
                else:
                    self._owner.publish(lambda s: s.in_session(None).consistent())

    @survives_caller_cancellation
    async def abort(self) -> None:
        """Drop the open session (no-op without one). With a staging backend the model keeps
        the weights and version it had; an in-place backend leaves them inconsistent."""
        async with self._owner.lock:
            with self._owner.audited("abort_weight_update", "") as outcome:
                if self._owner.state.update_session is None:
                    outcome.append("noop")
                    return
                await self.drop_session("an in-place update was aborted half way")

    async def checksums(self) -> ServedChecksums:
        """Digests of the served weights (checkpoint names), read back from the model, the
        same on every data-parallel engine or the call fails: a mismatch is an engine bug
        worth a loud error."""
        per_worker = await self.transport().checksums()
        if any(dict(w.per_tensor) != dict(per_worker[0].per_tensor) for w in per_worker):
            raise RuntimeError("data-parallel engines serve different weights")
        return per_worker[0]

    # Helpers (under the lock) -----------------------------------------------------------

    async def drop_session(self, inplace_reason: str) -> None:
        """Under the lock: end the open session (the transport aborts it)."""
        transport = self.transport()
        self._lease.disarm()
        with contextlib.suppress(Exception):
            await transport.abort(self._timeout_s)
        if transport.stages_updates:
            self._owner.publish(lambda s: s.in_session(None))
        else:
            self._owner.publish(lambda s: s.in_session(None).mark_inconsistent(inplace_reason))

    def transport(self) -> WeightTransport:
        transport = self._engine.transport
        if transport is None:
            raise CapabilityMissing(
                "weight transfer is not configured; start the server with --weight-transfer-backend"
            )
        return transport
