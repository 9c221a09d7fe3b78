"""The trainer SDK: push a `torch.nn.Module`'s weights into one rlserve server, over the
transport the server was started with: `rlserve_gloo` (a gloo group, any host) or
`rlserve_shm` (shared memory, the server's host).

`WeightSync.sync()` runs the one sync protocol (`rlserve.sdk.protocol`) over this one server:
pause -> start -> chunks (RPC and transfer concurrently) -> prepare -> finish -> resume, then
checks the digests of what the server serves against its own. It (re)does the rendezvous when
the server has no usable transport (first use, a server restart, a transfer that broke half
way). Every RPC carries a deadline, and a refusal by the server surfaces at once with the
server's reason, also while the trainer waits in a collective. On failure it aborts the
session, resumes on the old weights where that is safe, and raises `WeightSyncError`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from rlserve.api.rlserve.v1 import lifecycle_pb2
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.config import DEFAULT_TRANSFER_TIMEOUT_S
from rlserve.sdk.client import Client
from rlserve.sdk.fanout import Failed, Member, Outcome, step_timeout_s
from rlserve.sdk.group import RendezvousFailed, TransferGroup
from rlserve.sdk.plan import (
    DEFAULT_CHUNK_BYTES,
    NamedTensors,
    Payload,
    Planned,
    check_sizes,
    masked_indices,
    plan,
    plan_patch,
    plan_sync,
)
from rlserve.sdk.protocol import Abandoned, SyncProtocol, SyncReport, SyncRequest, staging
from rlserve.sdk.senders import SENDERS, NoBar
from rlserve.types import PauseMode
from rlserve.wire import patch as _patch
from rlserve.wire.protocol import BACKEND_NAME, DEFAULT_BUCKET_BYTES, SHM_BACKEND_NAME, combined_checksum

TRANSPORTS = {"gloo": BACKEND_NAME, "shm": SHM_BACKEND_NAME}


class WeightSyncError(RuntimeError):
    """A sync failed; `resumed_on_old_weights` says whether generation continues as before
    (a pause someone else made stays in place); `code` is the gRPC status behind it, if a
    call's (DEADLINE_EXCEEDED for a server that does not answer, say)."""

    def __init__(self, message: str, *, resumed_on_old_weights: bool, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.resumed_on_old_weights = resumed_on_old_weights
        self.code = code


@dataclass(frozen=True)
class SyncStats:
    weight_version: str
    num_tensors: int
    num_bytes: int
    num_chunks: int
    transfer_s: float
    pause_to_resume_s: float
    checksum: str
    # PauseGeneration: the server ends the engine step in flight before it stops, so under
    # load this is about one step, the floor of `pause_to_resume_s`.
    pause_s: float = 0.0
    # FinishWeightUpdate: the server's commit into the model (and its prefix-cache reset).
    commit_s: float = 0.0
    # PrepareWeightUpdate: the server checks it holds every staged tensor (the vote).
    prepare_s: float = 0.0
    # False when the server was paused by someone else when the sync began: it is left
    # paused, as it was found (pause_to_resume_s then ends at the commit).
    resumed: bool = True
    # Staged (StageWeightUpdate): chunks and prepare while the server generated, for
    # `stage_s`; generation paused for `pause_to_resume_s` only (the commit).
    staged: bool = False
    stage_s: float = 0.0

    @property
    def transfer_gb_per_s(self) -> float:
        return self.num_bytes / self.transfer_s / 1e9 if self.transfer_s else 0.0


@dataclass(frozen=True)
class LoraSyncStats:
    lora_name: str
    version: str
    lora_id: int
    num_tensors: int
    num_bytes: int
    transfer_s: float


class WeightSync:
    def __init__(
        self,
        client: Client,
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        rpc_timeout_s: float = 30.0,
        pause_timeout_s: float = 600.0,
        transport: str = "auto",
    ) -> None:
        """`timeout_s` bounds the rendezvous and each transfer step (the server may lower
        it); `rpc_timeout_s` every other RPC but the pause, which may wait for requests to
        drain (WAIT) for up to `pause_timeout_s`. `transport`: "gloo", "shm" (the server
        must run that backend, else `init` raises ValueError), or "auto" (the server's)."""
        check_sizes(bucket_bytes, chunk_bytes)
        if transport != "auto" and transport not in TRANSPORTS:
            raise ValueError(f"transport must be 'auto' or one of {sorted(TRANSPORTS)}")
        self._transport = transport
        self._client = client
        self._member = Member(client.target, client, owned=False)
        self._lifecycle = self._member.lifecycle
        self._timeout_s = timeout_s
        self._bucket_bytes, self._chunk_bytes = bucket_bytes, chunk_bytes
        self._rpc_timeout_s = rpc_timeout_s
        self._group = TransferGroup(
            master_address=master_address, master_port=master_port, timeout_s=timeout_s, rpc_timeout_s=rpc_timeout_s
        )
        self._protocol = SyncProtocol(
            self._group, timeout_s=timeout_s, rpc_timeout_s=rpc_timeout_s, pause_timeout_s=pause_timeout_s
        )
        # What the last sync with patch=True sent, and the version the last sync published.
        self._last_sent: dict[str, torch.Tensor] | None = None
        self._published: str | None = None

    def init(self, shm_capacity: int = DEFAULT_CHUNK_BYTES) -> None:
        """Connect to every inference worker (the server's RPC runs concurrently with our
        side of the rendezvous). `sync()` calls it when needed; call it first to pay for it
        outside the first sync. `shm_capacity`: the segment size for rlserve_shm. Raises
        the server's RpcError when it refuses."""
        self._init(shm_capacity)

    def _init(self, span: int) -> None:
        info = self._client.control.GetServerInfo(cpb.GetServerInfoRequest(), timeout=self._rpc_timeout_s)
        backend = info.rl_capabilities.weight_transfer_backend
        if self._transport != "auto" and backend != TRANSPORTS[self._transport]:
            raise ValueError(f"transport {self._transport!r} asked for, but the server's backend is {backend!r}")
        if backend not in SENDERS:
            raise WeightSyncError(
                f"the server's weight-transfer backend is {backend or 'none'!r}; the SDK sends over {sorted(SENDERS)}",
                resumed_on_old_weights=True,
                code=grpc.StatusCode.FAILED_PRECONDITION,
            )
        self._member.num_workers = info.parallelism.world_size * max(1, info.parallelism.data_parallel_size)
        try:
            self._group.rendezvous([self._member], backend, span=span)
        except RendezvousFailed as e:
            if e.rpc_error is not None:
                raise e.rpc_error from None  # the server's reason, as the server gave it
            raise RuntimeError(str(e)) from None

    def sync(
        self,
        weights: NamedTensors,
        version: str,
        *,
        pause_mode: PauseMode | str = PauseMode.KEEP,
        verify: bool = True,
        progress: bool = False,
        patch: bool | Mapping[str, torch.Tensor] = False,
        staged: bool | None = None,
    ) -> SyncStats:
        """Push `weights` (names as in the served HF checkpoint; a subset updates only those)
        and publish `version`; a `TensorStream` is sent as it streams (one chunk of it held
        at a time). `staged` (default: where the server offers it) receives and
        prepares the update while the server generates with its old weights, and pauses
        generation only for the commit; False pauses it for the whole sync. `patch=True` sends only the elements that changed since this
        object's last sync with `patch=True` (it keeps a copy of what it sent: the model's
        size again); `patch={name: bool mask}` sends the masked elements of those tensors
        only, as changes to the weights the server serves now. Where a patch would be no
        smaller, or the server no longer serves what was last sent, the whole tensors go."""
        mode = PauseMode(pause_mode)
        payload, dense, state = self._begin(weights, patch)
        staged = staging(state.staged_weight_updates, staged, _cannot_stage)
        # Someone else's pause (an operator draining the server) is theirs to end.
        resume = state.pause_phase == lifecycle_pb2.PAUSE_PHASE_RUNNING
        name = self._member.name
        bar = _progress_bar(sum(c.num_bytes for c in payload.layout), progress)
        request = SyncRequest(
            [self._member],
            payload,
            version,
            pause_mode=mode,
            verify=verify,
            verify_while_paused=False,  # the pause ends at the commit; a wrong digest still fails
            found_paused=() if resume else (name,),
            bar=bar,
            staged=staged,
        )
        try:
            report = self._protocol.run(request)
        except Abandoned as e:
            raise self._error(e) from e
        finally:
            bar.close()
        if not report.finished[name].ok:
            failure = Failed("commit", {name: report.outcomes[name]})
            raise self._error(self._protocol.abandon([self._member], [self._member] if resume else [], failure))
        if report.failed:
            wrong = report.outcomes[name]
            raise WeightSyncError(
                f"after the sync, the server {wrong.message}", resumed_on_old_weights=False, code=wrong.code
            )
        self._published = version
        if patch is True:
            # A copy: the caller's tensors (the model's own, on the CPU) change in place.
            kept = self._last_sent or {}
            self._last_sent = {**kept, **{n: t.clone() for n, t in dense.items()}}
        return _stats(report, version, report.served[name].overall if verify else None, resume)

    def sync_lora(
        self,
        adapter: NamedTensors,
        name: str,
        *,
        config: Mapping[str, Any],
        version: str,
        new_version: bool = False,
    ) -> LoraSyncStats:
        """Push a LoRA adapter (PEFT tensor names: base_model.model.<layer>.lora_A/B.weight;
        `config` is its adapter_config) into the server under `name`, without pausing
        generation: requests admitted after the call use it, running ones keep the version
        they started with. `new_version` replaces an adapter already loaded under `name`;
        without it a loaded name is refused. Raises WeightSyncError (the old version, if
        any, keeps serving)."""
        payload, _, _ = self._begin(adapter, False)
        num_bytes = sum(c.num_bytes for c in payload.layout)
        start = lifecycle_pb2.StartLoraUpdateRequest(
            lora_name=name,
            version=version,
            adapter_config_json=json.dumps(dict(config)).encode(),
            new_version=new_version,
        )
        t0 = time.perf_counter()
        try:
            self._lifecycle.StartLoraUpdate(start, timeout=self._rpc_timeout_s)
            for chunk, tensors in payload.chunks():
                self._group.send_chunk([self._member], chunk, tensors, NoBar())
            finish = self._lifecycle.FinishLoraUpdate(
                lifecycle_pb2.FinishLoraUpdateRequest(), timeout=step_timeout_s(self._timeout_s, num_bytes)
            )
        except Exception as e:
            cause = _cause(e)
            with contextlib.suppress(grpc.RpcError):
                self._lifecycle.AbortWeightUpdate(lifecycle_pb2.AbortWeightUpdateRequest(), timeout=self._rpc_timeout_s)
            raise WeightSyncError(
                f"adapter push failed, nothing changed: {cause.message}", resumed_on_old_weights=True, code=cause.code
            ) from e
        return LoraSyncStats(
            lora_name=name,
            version=finish.version,
            lora_id=finish.adapter.lora_id,
            num_tensors=sum(len(c.tensors) for c in payload.layout),
            num_bytes=num_bytes,
            transfer_s=time.perf_counter() - t0,
        )

    def close(self) -> None:
        self._group.close()

    def _begin(
        self, weights: NamedTensors, patch: bool | Mapping[str, torch.Tensor]
    ) -> tuple[Payload, dict[str, torch.Tensor], Any]:
        """`_prepare`, with a refusal before anything changed (another trainer's init or
        session in the way, say) as WeightSyncError like every later one."""
        try:
            return self._prepare(weights, patch)
        except grpc.RpcError as e:
            raise WeightSyncError(
                f"the sync could not begin, nothing changed: {e.code().name}: {e.details()}",
                resumed_on_old_weights=True,
                code=e.code(),
            ) from e

    def _prepare(
        self, weights: NamedTensors, patch: bool | Mapping[str, torch.Tensor]
    ) -> tuple[Payload, dict[str, torch.Tensor], Any]:
        """What to send, the whole tensors it makes (none for a stream), and the server's
        state; a usable transport (a rendezvous if needed)."""
        state = self._lifecycle.GetState(lifecycle_pb2.GetStateRequest(), timeout=self._rpc_timeout_s)
        # Sent in the dtype the server computes with: what it serves is then what was sent.
        dtype = getattr(torch, state.weight_dtype, None)
        sizes = {"chunk_bytes": self._chunk_bytes, "bucket_bytes": self._bucket_bytes}
        payload: Payload
        dense: dict[str, torch.Tensor] = {}
        if patch is False:
            payload = plan(weights, dtype, **sizes)
            if isinstance(payload, Planned):
                dense = dict(payload.tensors)
        else:
            dense, chunks = plan_sync(weights, dtype, **sizes)
            tensors, changed = dense, self._changed(dense, patch, state.weight_version)
            if changed is not None:
                tensors, chunks = plan_patch(dense, changed, state.weight_version, **sizes)
            payload = Planned(chunks, tensors)
        if not self._group.spans([self._member.name], payload.layout) or not state.transport_ready:
            self._init(self._group.span_of(payload.layout))
        return payload, dense, state

    def _changed(
        self, dense: Mapping[str, torch.Tensor], patch: bool | Mapping[str, torch.Tensor], served_version: str
    ) -> dict[str, torch.Tensor] | None:
        """The changed flat indices per tensor a patch is made of; None: send everything."""
        if patch is False:
            return None
        if patch is not True:
            return masked_indices(patch, dense)
        last = self._last_sent
        if last is None or self._published != served_version:
            return None  # nothing sent yet, or someone changed the weights since
        return {n: _patch.changed(t, last[n]) for n, t in dense.items() if n in last and last[n].shape == t.shape}

    def _error(self, abandoned: Abandoned) -> WeightSyncError:
        """The server aborted the update: it serves its old weights, whole (resumed if this
        sync paused it), or not."""
        cause = abandoned.cause
        reason = cause.message
        if abandoned.not_resumed:
            reason += f" (resuming failed too: {next(iter(abandoned.not_resumed.values()))})"
        if self._member.name in abandoned.kept:
            return WeightSyncError(
                f"weight sync failed, old weights kept: {reason}", resumed_on_old_weights=True, code=cause.code
            )
        return WeightSyncError(f"weight sync failed: {reason}", resumed_on_old_weights=False, code=cause.code)


def _cannot_stage() -> WeightSyncError:
    return WeightSyncError(
        "the server cannot stage an update while it generates (an in-place backend); sync with staged=False",
        resumed_on_old_weights=True,
        code=grpc.StatusCode.FAILED_PRECONDITION,
    )


def _cause(error: BaseException) -> Outcome:
    """The first failure behind `error` (a step's, a call's or the trainer's)."""
    if isinstance(error, Failed):
        return next(iter(error.errors.values()))
    return Outcome.of(error)


def _progress_bar(total_bytes: int, enabled: bool) -> Any:
    if not enabled:
        return NoBar()
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="weight sync")


def _stats(report: SyncReport, version: str, served: str | None, resumed: bool) -> SyncStats:
    """`served`: the server's digest when verified (None: the digest of what was sent)."""
    return SyncStats(
        weight_version=version,
        num_tensors=len(report.sent),
        num_bytes=sum(c.num_bytes for c in report.chunks),
        num_chunks=len(report.chunks),
        transfer_s=report.transfer_s,
        pause_to_resume_s=report.pause_to_resume_s,
        pause_s=report.pause_s,
        commit_s=report.commit_s,
        prepare_s=report.prepare_s,
        checksum=served if served is not None else combined_checksum(report.sent),
        resumed=resumed,
        staged=report.staged,
        stage_s=report.stage_s,
    )
