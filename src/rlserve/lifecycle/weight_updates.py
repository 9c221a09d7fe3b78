"""Weight-update transitions: transport init, session start, chunks, commit, abort, and the
idle lease that ends a session whose trainer went away. Changes the state only through the
`StateOwner` it shares with the lifecycle controller; talks to the backend only through the
engine's typed `WeightTransport`, so it knows no backend's wire format. No grpc.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlserve.caller import CURRENT
from rlserve.config import chunk_deadline_s
from rlserve.errors import CapabilityMissing, CommitFailed, PrepareFailed, StaleBase, TransferTimeout, WrongState
from rlserve.lifecycle.loras import LoraRegistry, adapter_digest
from rlserve.lifecycle.mutation import survives_caller_cancellation
from rlserve.lifecycle.owner import StateOwner
from rlserve.lifecycle.rendezvous import check_trainer_host
from rlserve.lifecycle.state import (
    UpdateSession,
    check_can_init_transport,
    check_can_open_session,
    check_can_start_update,
    check_weight_version,
    require_session,
)
from rlserve.payloads import parse_json
from rlserve.types import LoraAdapter, PausePhase

if TYPE_CHECKING:
    from rlserve.engine.adapter import EngineAdapter
    from rlserve.engine.transport import WeightTransport
    from rlserve.types import ServedChecksums


class WeightUpdates:
    def __init__(
        self,
        owner: StateOwner,
        engine: EngineAdapter,
        *,
        timeout_s: float,
        lease_s: float,
        max_info_bytes: int,
        allowed_hosts: tuple[str, ...] = (),
        resume: Callable[[], Awaitable[None]],
        loras: LoraRegistry,
    ) -> None:
        self._owner = owner
        self._engine = engine
        self._timeout_s = timeout_s
        self._info_limit = ("max_transfer_info_bytes", max_info_bytes)
        self._allowed_hosts = allowed_hosts
        self._lease_s = lease_s
        # Resumes generation; called with the lock held, when a lease ends a session.
        self._resume = resume
        self._loras = loras
        # The open LoRA session's version label, adapter config and whether it is a new version.
        self._lora_session: tuple[str, dict[str, Any], bool] = ("", {}, False)
        self._lease: asyncio.TimerHandle | None = None
        self._lease_token = 0
        self._expiry: asyncio.Task[None] | None = None

    async def init(self, init_info_json: bytes) -> None:
        """Set up (or replace) the transport with the trainer. Capped by the server's
        transfer timeout, and ended when the caller goes away; it holds no lock while the
        trainer connects, so generation and every other call go on meanwhile. On failure the
        previous transport (if any) stays as it was. Raises CapabilityMissing, InvalidRequest,
        UpdateInProgress, TransferTimeout."""
        transport = self._transport()
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
                self._disarm_lease()  # the trainer came back
                self._owner.publish(transport_initializing=True)
            ready = False
            try:
                await transport.init(init)
                ready = True
            finally:
                changes: dict[str, Any] = {"transport_initializing": False}
                if ready:
                    changes["transport_ready"] = True
                self._owner.publish(**changes)

    @survives_caller_cancellation
    async def start(self, is_draft: bool = False) -> UpdateSession:
        """Open a session. Raises CapabilityMissing, UpdateInProgress (ABORTED),
        TransportNotReady / NotPaused / MemoryAsleep (FAILED_PRECONDITION)."""
        async with self._owner.lock:
            with self._owner.audited("start_weight_update", f"draft={is_draft}"):
                transport = self._transport()
                if is_draft and not self._engine.capabilities().draft_weight_updates_enabled:
                    raise CapabilityMissing("this engine has no draft model whose weights could be updated")
                check_can_start_update(self._owner.state)
                await transport.start(is_draft, self._timeout_s)
                session = UpdateSession(uuid.uuid4().hex, is_draft, time.time())
                changes: dict[str, Any] = {"update_session": session}
                if not transport.stages_updates:
                    changes.update(weights_consistent=False, inconsistency_reason="an in-place weight update is open")
                self._owner.publish(**changes)
                self._arm_lease(session.session_id)
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
                transport = self._transport()
                self._disarm_lease()
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
                    await transport.update(chunk, timeout_s)
                except BaseException as e:
                    await self._drop_session("an update chunk failed")
                    if isinstance(e, TransferTimeout):
                        self._owner.publish(transport_ready=False)
                    # The trainer has a lease to come back (start again, or resume); if it
                    # does not, generation resumes on the old weights.
                    self._arm_lease(None)
                    raise
                self._owner.publish(
                    update_session=replace(
                        session,
                        num_chunks=session.num_chunks + 1,
                        num_tensors=session.num_tensors + chunk.num_tensors,
                        num_bytes=session.num_bytes + chunk.num_bytes,
                    )
                )
                self._arm_lease(session.session_id)

    @survives_caller_cancellation
    async def prepare(self) -> UpdateSession:
        """Phase one of a two-phase commit: everything `finish` could fail at short of the
        swap, done beside the served weights (a no-op for an in-place backend). The session
        stays open. A failure drops it; with a staging backend nothing changed. Raises
        NoUpdateSession, PrepareFailed."""
        async with self._owner.lock:
            with self._owner.audited("prepare_weight_update", ""):
                session = require_session(self._owner.state, "PrepareWeightUpdate", lora=False)
                transport = self._transport()
                self._disarm_lease()
                try:
                    await transport.prepare(self._timeout_s)
                except BaseException as e:
                    await self._drop_session("an in-place update failed to prepare its commit")
                    self._arm_lease(None)
                    if isinstance(e, CommitFailed):
                        raise PrepareFailed(f"preparing the commit failed, the update was dropped: {e}") from e
                    raise
                session = replace(session, prepared=True)
                self._owner.publish(update_session=session)
                self._arm_lease(session.session_id)
                return session

    @survives_caller_cancellation
    async def finish(self, version: str | None) -> None:
        """Commit: new weights go live, every cached KV block is dropped, the version (if
        given) is published. A commit that fails half way marks the weights inconsistent
        (resume refused until a complete update succeeds); the next update starts clean.
        Raises NoUpdateSession, InvalidRequest, CommitFailed."""
        async with self._owner.lock:
            with self._owner.audited("finish_weight_update", f"version={(version or '')[:64]!r}"):
                require_session(self._owner.state, "FinishWeightUpdate", lora=False)
                if version is not None:
                    check_weight_version(version)
                transport = self._transport()
                self._disarm_lease()
                try:
                    await transport.finish(self._timeout_s)
                except BaseException as e:
                    reason = f"the commit failed half way ({type(e).__name__})"
                    self._owner.publish(update_session=None, weights_consistent=False, inconsistency_reason=reason)
                    if isinstance(e, Exception) and not isinstance(e, CommitFailed):
                        raise CommitFailed(f"{reason}: {e}") from e
                    raise
                await self._engine.reset_prefix_cache()
                changes: dict[str, Any] = {
                    "update_session": None,
                    "weights_consistent": True,
                    "inconsistency_reason": "",
                }
                if version is not None and version != self._owner.state.weight_version:
                    await self._engine.set_weight_version(version)
                    changes["weight_version"] = version
                self._owner.publish(**changes)

    # LoRA adapters pushed by the trainer ---------------------------------------------------

    @survives_caller_cancellation
    async def start_lora(self, name: str, version: str, adapter_config: Mapping[str, Any], new_version: bool) -> None:
        """Open a session whose chunks make adapter `name` (generation goes on meanwhile: the
        adapter is swapped in at finish). A loaded name needs `new_version`. Raises CapabilityMissing, NameTaken (ABORTED), UpdateInProgress, TransportNotReady."""
        async with self._owner.lock:
            with self._owner.audited("start_lora_update", f"{name[:64]!r} version={version[:64]!r}"):
                self._engine.require_lora()
                transport = self._transport()
                check_can_open_session(self._owner.state)
                self._loras.check_new_version(name, new_version)
                await transport.start_lora(self._timeout_s)
                session = UpdateSession(uuid.uuid4().hex, False, time.time(), lora_name=name)
                self._lora_session = (version, dict(adapter_config), new_version)
                self._owner.publish(update_session=session)
                self._arm_lease(session.session_id)

    @survives_caller_cancellation
    async def finish_lora(self) -> LoraAdapter:
        """The pushed adapter, checked whole and written out by the workers, is loaded and
        serves every request admitted from now on; requests already running keep the
        version they started with, and the old version is unloaded after the last of them.
        A failure leaves the old version serving. Raises NoUpdateSession, InvalidRequest."""
        async with self._owner.lock:
            with self._owner.audited("finish_lora_update", ""):
                session = require_session(self._owner.state, "FinishLoraUpdate", lora=True)
                version, adapter_config, new_version = self._lora_session
                transport = self._transport()
                self._disarm_lease()
                directory = tempfile.mkdtemp(prefix=f"rlserve-lora-{session.session_id[:8]}-")
                try:
                    self._loras.check_new_version(session.lora_name, new_version)
                    path = await transport.write_lora(directory, adapter_config, self._timeout_s)
                    digest = await asyncio.to_thread(adapter_digest, Path(path))
                    adapter = self._loras.new(session.lora_name, path, digest, version, directory)
                    await self._engine.add_lora(adapter)
                except BaseException:
                    shutil.rmtree(directory, ignore_errors=True)
                    self._owner.publish(update_session=None)
                    raise
                old = self._loras.add(adapter)
                self._owner.publish(update_session=None)
                if old is not None:
                    await self.unload_adapter(old)
                return adapter

    async def unload_adapter(self, adapter: LoraAdapter) -> None:
        """Under the lock: out of the engine, and its directory if rlserve wrote it."""
        await self._engine.remove_lora(adapter)
        if adapter.owned_dir:
            shutil.rmtree(adapter.owned_dir, ignore_errors=True)

    @survives_caller_cancellation
    async def abort(self) -> None:
        """Drop the open session (no-op without one). With a staging backend the model keeps
        the weights and version it had; an in-place backend leaves them inconsistent."""
        async with self._owner.lock:
            with self._owner.audited("abort_weight_update", "") as outcome:
                if self._owner.state.update_session is None:
                    outcome.append("noop")
                    return
                await self._drop_session("an in-place update was aborted half way")

    async def checksums(self) -> ServedChecksums:
        """Digests of the served weights (checkpoint names), read back from the model, the
        same on every data-parallel engine or the call fails: a mismatch is an engine bug
        worth a loud error."""
        per_worker = await self._transport().checksums()
        if any(dict(w.per_tensor) != dict(per_worker[0].per_tensor) for w in per_worker):
            raise RuntimeError("data-parallel engines serve different weights")
        return per_worker[0]

    # Helpers (under the lock) -----------------------------------------------------------

    async def _drop_session(self, inplace_reason: str) -> None:
        transport = self._transport()
        self._disarm_lease()
        with contextlib.suppress(Exception):
            await transport.abort(self._timeout_s)
        changes: dict[str, Any] = {"update_session": None}
        if not transport.stages_updates:
            changes.update(weights_consistent=False, inconsistency_reason=inplace_reason)
        self._owner.publish(**changes)

    def _transport(self) -> WeightTransport:
        transport = self._engine.transport
        if transport is None:
            raise CapabilityMissing(
                "weight transfer is not configured; start the server with --weight-transfer-backend"
            )
        return transport

    # The session lease ------------------------------------------------------------------

    def cancel_lease(self) -> None:
        """Someone decided about the pause (paused, resumed, started an update): no lease
        resumes generation behind their back."""
        self._disarm_lease()

    def _arm_lease(self, session_id: str | None) -> None:
        """With a session: the session's lease. Without: the lease of the pause a failed
        update left behind."""
        self._disarm_lease()
        loop = asyncio.get_running_loop()
        self._lease = loop.call_later(self._lease_s, self._lease_ended, session_id, self._lease_token)

    def _disarm_lease(self) -> None:
        # A lease that already fired and waits for the lock is stale from now on.
        self._lease_token += 1
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None

    def _lease_ended(self, session_id: str | None, token: int) -> None:
        self._expiry = asyncio.ensure_future(self._expire(session_id, token))

    async def _expire(self, session_id: str | None, token: int) -> None:
        """No call within the lease: the trainer is gone. Abort its session and, when the old
        weights are intact, let generation go on."""
        async with self._owner.lock:
            session = self._owner.state.update_session
            current = session.session_id if session is not None else None
            if token != self._lease_token or current != session_id:
                return
            what = f"session={session_id}" if session_id else "after a failed update"
            with self._owner.audited("session_lease_expired", f"{what} lease_s={self._lease_s:g}"):
                if session is not None:
                    await self._drop_session("an in-place update's session lease expired")
                st = self._owner.state
                if st.weights_consistent and not st.asleep and st.pause_phase is PausePhase.PAUSED:
                    await self._resume()
                    self._owner.record("resume", "the update's lease expired", "ok")
