"""Weight-update transitions of the lifecycle controller: transport init, session start,
chunks, commit and abort. A mixin of `LifecycleController`, which owns the state, the lock
and the audit log these methods use; split out only to keep each file readable."""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from rlserve.errors import CapabilityMissing, InvalidRequest, UpdateInProgress
from rlserve.lifecycle.mutation import survives_caller_cancellation as _survives_caller_cancellation
from rlserve.lifecycle.state import (
    UpdateSession,
    check_can_start_update,
    check_weight_version,
    require_session,
)
from rlserve.payloads import parse_json_object
from rlserve.transfer.protocol import BACKEND_NAME as STAGING_BACKEND
from rlserve.transfer.protocol import ChunkInfo, ProtocolError
from rlserve.types import RlCapabilities

if TYPE_CHECKING:
    import asyncio

    from rlserve.engine.adapter import EngineAdapter
    from rlserve.lifecycle.state import LifecycleState

DEFAULT_TRANSFER_TIMEOUT_S = 60.0


class WeightUpdates:
    _engine: EngineAdapter
    _lock: asyncio.Lock
    _state: LifecycleState
    _transfer_timeout_s: float

    @_survives_caller_cancellation
    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Set up (or replace) the transport with the trainer, bounded by a deadline.
        Raises CapabilityMissing, UpdateInProgress, InvalidRequest, TransferTimeout; on any
        failure the previous transport (if any) stays as it was."""
        async with self._lock:
            with self._audited("init_weight_transfer", _init_detail(init_info)):
                self._require_weight_transfer()
                if self._state.update_session is not None:
                    raise UpdateInProgress("finish or abort the open weight update before re-initializing")
                timeout_s = float(init_info.get("timeout_s", self._transfer_timeout_s))
                await self._engine.weights.init(init_info, timeout_s)
                self._publish(transport_ready=True)

    @_survives_caller_cancellation
    async def start_weight_update(self, is_draft: bool = False) -> UpdateSession:
        """Open a session. Raises CapabilityMissing, UpdateInProgress (ABORTED),
        TransportNotReady / NotPaused / MemoryAsleep (FAILED_PRECONDITION)."""
        async with self._lock:
            with self._audited("start_weight_update", f"draft={is_draft}"):
                caps = self._require_weight_transfer()
                if is_draft and not caps.draft_weight_updates_enabled:
                    raise CapabilityMissing("this engine has no draft model whose weights could be updated")
                check_can_start_update(self._state)
                await self._engine.weights.start(is_draft, self._transfer_timeout_s)
                session = UpdateSession(uuid.uuid4().hex, is_draft, time.time())
                changes: dict[str, Any] = {"update_session": session}
                if not self._stages_updates(caps):
                    changes.update(weights_consistent=False, inconsistency_reason="an in-place weight update is open")
                self._publish(**changes)
                return session

    @_survives_caller_cancellation
    async def update_weights(self, update_info_json: bytes) -> None:
        """Receive one chunk (the backend's update_info as JSON). Any failure, bad JSON
        included, drops the session; with a staging backend the served weights are
        unchanged. Raises NoUpdateSession, InvalidRequest, TransferTimeout."""
        async with self._lock:
            with self._audited("update_weights", f"{len(update_info_json)} bytes of update_info"):
                session = require_session(self._state, "UpdateWeights")
                try:
                    update_info = parse_json_object(update_info_json, "update_info_json")
                    num_tensors, num_bytes = self._chunk_size(update_info)
                    # The worker bounds each collective; this bounds the whole chunk.
                    timeout_s = self._transfer_timeout_s * (1 + num_bytes // (256 * 2**20))
                    await self._engine.weights.update(update_info, timeout_s)
                except BaseException:
                    await self._drop_session("an update chunk failed")
                    raise
                self._publish(
                    update_session=replace(
                        session,
                        num_chunks=session.num_chunks + 1,
                        num_tensors=session.num_tensors + num_tensors,
                        num_bytes=session.num_bytes + num_bytes,
                    )
                )

    @_survives_caller_cancellation
    async def finish_weight_update(self, version: str | None) -> None:
        """Commit: new weights go live, every cached KV block is dropped, the version (if
        given) is published. A commit that fails half way marks the weights inconsistent
        (resume refused until a complete update succeeds)."""
        async with self._lock:
            with self._audited("finish_weight_update", f"version={version!r}"):
                require_session(self._state, "FinishWeightUpdate")
                if version is not None:
                    check_weight_version(version)
                try:
                    await self._engine.weights.finish(self._transfer_timeout_s)
                except BaseException as e:
                    self._publish(
                        update_session=None,
                        weights_consistent=False,
                        inconsistency_reason=f"the commit failed half way ({type(e).__name__})",
                    )
                    raise
                await self._engine.reset_prefix_cache()
                changes: dict[str, Any] = {
                    "update_session": None,
                    "weights_consistent": True,
                    "inconsistency_reason": "",
                }
                if version is not None and version != self._state.weight_version:
                    await self._engine.set_weight_version(version)
                    changes["weight_version"] = version
                self._publish(**changes)

    @_survives_caller_cancellation
    async def abort_weight_update(self) -> None:
        """Drop the open session (no-op without one). With a staging backend the model keeps
        the weights and version it had; an in-place backend leaves them inconsistent."""
        async with self._lock:
            with self._audited("abort_weight_update", "") as outcome:
                if self._state.update_session is None:
                    outcome.append("noop")
                    return
                await self._drop_session("an in-place update was aborted half way")

    async def weight_checksums(self) -> dict[str, Any]:
        """Digests of the served weights (HF names), identical across data-parallel engines
        or the call fails: a mismatch is an engine bug worth a loud error."""
        self._require_weight_transfer()
        per_worker = await self._engine.weights.checksums(self._transfer_timeout_s)
        overall = {w["overall"] for w in per_worker}
        if len(overall) != 1:
            raise RuntimeError(f"data-parallel engines serve different weights: {sorted(overall)}")
        return per_worker[0]

    def _chunk_size(self, update_info: dict[str, Any]) -> tuple[int, int]:
        """(tensors, bytes) of a chunk; rlserve_gloo's update_info is checked for shape here,
        other backends' is passed through as vLLM defines it."""
        if not self._stages_updates(self._engine.capabilities()):
            names = update_info.get("names")
            return (len(names) if isinstance(names, list) else 0), 0
        try:
            chunk = ChunkInfo.parse(update_info)
        except ProtocolError as e:
            raise InvalidRequest("update_info_json", str(e)) from e
        return len(chunk.tensors), sum(t.num_bytes for t in chunk.tensors)

    async def _drop_session(self, inplace_reason: str) -> None:
        caps = self._engine.capabilities()
        with contextlib.suppress(Exception):
            await self._engine.weights.abort(self._transfer_timeout_s)
        changes: dict[str, Any] = {"update_session": None}
        if not self._stages_updates(caps):
            changes.update(weights_consistent=False, inconsistency_reason=inplace_reason)
        self._publish(**changes)

    def _require_weight_transfer(self) -> RlCapabilities:
        caps = self._engine.capabilities()
        if not caps.weight_transfer_enabled:
            raise CapabilityMissing(
                "weight transfer is not configured; start the server with --weight-transfer-backend"
            )
        return caps

    @staticmethod
    def _stages_updates(caps: RlCapabilities) -> bool:
        """Only rlserve's own backend stages updates; vLLM's write into the live weights."""
        return caps.weight_transfer_backend == STAGING_BACKEND


def _init_detail(init_info: dict[str, Any]) -> str:
    keys = ("master_address", "master_port", "rank_offset", "world_size", "timeout_s")
    return " ".join(f"{k}={init_info[k]}" for k in keys if k in init_info)
