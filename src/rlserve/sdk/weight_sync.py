"""The trainer SDK: push a `torch.nn.Module`'s weights into one rlserve server, over the
transport the server was started with: `rlserve_gloo` (a gloo group, any host) or
`rlserve_shm` (shared memory, the server's host).

`WeightSync.sync()` runs pause -> start -> chunks (RPC and broadcast concurrently) ->
finish -> resume, then checks the digests of what the server serves against its own. It
(re)does the rendezvous when the server has no usable transport (first use, a server
restart, a transfer that broke half way). Every RPC carries a deadline, and a refusal by the
server surfaces at once with the server's reason, also while the trainer waits in a
collective. On failure it aborts the session, resumes on the old weights where that is
safe, and raises `WeightSyncError`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from rlserve.api.rlserve.v1 import lifecycle_pb2, lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.client import Client
from rlserve.config import DEFAULT_TRANSFER_TIMEOUT_S
from rlserve.transfer import patch as _patch
from rlserve.transfer import shm
from rlserve.transfer.gloo_group import GlooGroup
from rlserve.transfer.plan import DEFAULT_CHUNK_BYTES, NamedTensors, check_sizes, plan_patch, plan_sync
from rlserve.transfer.protocol import (
    BACKEND_NAME,
    DEFAULT_BUCKET_BYTES,
    SHM_BACKEND_NAME,
    ChunkInfo,
    combined_checksum,
    plan_buckets,
)
from rlserve.types import PauseMode

TRANSPORTS = {"gloo": BACKEND_NAME, "shm": SHM_BACKEND_NAME}
# A chunk's deadline grows with its size, as the server's does: one timeout per 256 MiB.
BYTES_PER_TIMEOUT = 256 * 2**20
# On top of the server's own deadline, so the server's reason arrives before ours expires.
RPC_MARGIN_S = 10.0
PAUSE_MODES = {
    PauseMode.ABORT: cpb.PAUSE_MODE_ABORT,
    PauseMode.WAIT: cpb.PAUSE_MODE_WAIT,
    PauseMode.KEEP: cpb.PAUSE_MODE_KEEP,
}


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
    # FinishWeightUpdate: the server's commit into the model (and its prefix-cache reset).
    commit_s: float = 0.0
    # False when the server was paused by someone else when the sync began: it is left
    # paused, as it was found (pause_to_resume_s then ends at the commit).
    resumed: bool = True

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


class TensorSender:
    """The trainer's half of the rlserve_gloo transport, with no control RPC in it: the
    rendezvous store, the collective group, the vote on each chunk and its bucketed broadcast.
    `WeightSync` drives it over rlserve's gRPC control plane; any other control path (Dynamo's
    RL routes, say) drives it the same way: send `init_info()` to InitWeightTransferEngine
    while `join()` runs, then for each chunk send `chunk.to_json()` to UpdateWeights while
    `send(chunk, tensors)` runs."""

    def __init__(
        self,
        num_workers: int,
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> None:
        """`num_workers`: the server's world size times its data-parallel size (for a
        fleet: the sum over its servers)."""
        self.world_size = 1 + num_workers
        self.timeout_s = timeout_s
        self._address = master_address
        self._store = GlooGroup.host_store(master_address, master_port, self.world_size, timeout_s)
        self._group: GlooGroup | None = None

    def init_info(self, rank_offset: int = 1) -> dict[str, Any]:
        """What InitWeightTransferEngine takes as init_info: the server's workers join as
        ranks `rank_offset`.. (several servers in one group each get their own range)."""
        return {
            "master_address": self._address,
            "master_port": self._store.port,
            "rank_offset": rank_offset,
            "world_size": self.world_size,
            "timeout_s": self.timeout_s,
        }

    def join(self) -> None:
        """Blocks until every worker has joined (or raises at the timeout)."""
        # Peers connect to the trainer where they reach its store.
        self._group = GlooGroup(self._store, 0, self.world_size, self.timeout_s, self._address)

    @property
    def joined(self) -> bool:
        return self._group is not None

    def vote(self, accept: bool = True) -> bool:
        """True when every worker accepts the chunk the server was just given."""
        return self._group_or_raise().vote(accept)

    def send(self, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor], bar: Any = None) -> bool:
        """Vote, then broadcast the chunk's buckets; False (nothing sent) when the server
        refused it. A failure leaves the group out of step: `joined` turns False."""
        try:
            if not self.vote(True):
                return False
            self.broadcast(chunk, tensors, bar)
            return True
        except RuntimeError:
            self.forget()
            raise

    def broadcast(self, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor], bar: Any = None) -> None:
        group = self._group_or_raise()
        bar = bar or _NoBar()
        buckets = plan_buckets(chunk.tensors, chunk.bucket_bytes)
        # Two buffers: fill the next bucket while the previous one is on the wire.
        spare = [torch.empty(chunk.bucket_bytes, dtype=torch.uint8) for _ in range(2)]
        in_flight: list[tuple[Any, int]] = []
        for i, bucket in enumerate(buckets):
            if len(in_flight) == 2:
                work, nbytes = in_flight.pop(0)
                work.wait()
                bar.update(nbytes)
            buffer = _fill(spare[i % 2], bucket, chunk, tensors)
            in_flight.append((group.broadcast_async(buffer), bucket.num_bytes))
        for work, nbytes in in_flight:
            work.wait()
            bar.update(nbytes)

    def forget(self) -> None:
        """The group is out of step (a refused or broken chunk): a new rendezvous is needed."""
        self._group = None

    def _group_or_raise(self) -> GlooGroup:
        if self._group is None:
            raise RuntimeError("not joined: call join() while the server runs InitWeightTransferEngine")
        return self._group


class ShmSender:
    """The trainer's half of rlserve_shm: one shared-memory segment, created for a session
    and reused for every chunk of every step. Send `init_info()` to InitWeightTransferEngine
    and `unlink()` whatever the answer (the workers keep their mappings); for each chunk
    `write(chunk, tensors)`, then send `chunk.to_json()` to UpdateWeights."""

    def __init__(self, capacity: int, *, timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S) -> None:
        """`capacity`: bytes, at least the largest chunk's `shm.span`: every chunk is written
        from offset 0 (the workers have copied a chunk out when UpdateWeights answers)."""
        # Unique per trainer process and session; the server maps only names of this shape.
        name = f"rlserve-shm-{os.getpid()}-{uuid.uuid4().hex}"
        self.segment = shm.Segment.create(name, capacity)
        self.timeout_s = timeout_s
        self.joined = True

    @property
    def capacity(self) -> int:
        return self.segment.size

    def init_info(self) -> dict[str, Any]:
        return {"segment": self.segment.name, "size": self.capacity, "timeout_s": self.timeout_s}

    def unlink(self) -> None:
        shm.unlink(self.segment.name)

    def write(self, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor], bar: Any = None) -> None:
        for index, offset in shm.layout(chunk, self.capacity)[1]:
            meta = chunk.tensors[index]
            self.segment.bytes[offset : offset + meta.num_bytes].copy_(tensors[meta.name].view(-1).view(torch.uint8))
            if bar is not None:
                bar.update(meta.num_bytes)

    def close(self) -> None:
        self.unlink()
        self.segment.close()


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
        self._lifecycle = lifecycle_pb2_grpc.LifecycleStub(client.channel)
        self._address, self._port, self._timeout_s = master_address, master_port, timeout_s
        self._bucket_bytes, self._chunk_bytes = bucket_bytes, chunk_bytes
        self._rpc_timeout_s, self._pause_timeout_s = rpc_timeout_s, pause_timeout_s
        self._sender: TensorSender | ShmSender | None = None
        # What the last sync with patch=True sent, and the version the last sync published.
        self._last_sent: dict[str, torch.Tensor] | None = None
        self._published: str | None = None
        # An RPC and a collective at a time, plus room for a collective abandoned after a
        # refusal, which ends only at its own deadline.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlserve-sync")

    def init(self, shm_capacity: int = DEFAULT_CHUNK_BYTES) -> None:
        """Connect to every inference worker (the server's RPC runs concurrently with our
        side of the rendezvous). `sync()` calls it when needed; call it first to pay for it
        outside the first sync. `shm_capacity`: the segment size for rlserve_shm."""
        self._close_sender()
        info = self._client.control.GetServerInfo(cpb.GetServerInfoRequest(), timeout=self._rpc_timeout_s)
        backend = info.rl_capabilities.weight_transfer_backend
        if self._transport != "auto" and backend != TRANSPORTS[self._transport]:
            raise ValueError(f"transport {self._transport!r} asked for, but the server's backend is {backend!r}")
        if backend == SHM_BACKEND_NAME:
            self._sender = self._init_shm(shm_capacity)
            return
        sender = TensorSender(
            info.parallelism.world_size * max(1, info.parallelism.data_parallel_size),
            master_address=self._address,
            master_port=self._port,
            timeout_s=self._timeout_s,
        )
        request = cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(sender.init_info()).encode())
        rpc = self._pool.submit(
            self._client.control.InitWeightTransferEngine, request, timeout=self._timeout_s + RPC_MARGIN_S
        )
        join = self._pool.submit(sender.join)
        _first_failure_wins(rpc, join)
        self._sender = sender

    def _init_shm(self, capacity: int) -> ShmSender:
        sender = ShmSender(capacity, timeout_s=self._timeout_s)
        request = cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(sender.init_info()).encode())
        try:
            self._client.control.InitWeightTransferEngine(request, timeout=self._timeout_s + RPC_MARGIN_S)
        except BaseException:
            sender.close()
            raise
        finally:
            sender.unlink()  # the workers have it mapped (or never will)
        return sender

    def sync(
        self,
        weights: NamedTensors,
        version: str,
        *,
        pause_mode: PauseMode | str = PauseMode.KEEP,
        verify: bool = True,
        progress: bool = False,
        patch: bool | Mapping[str, torch.Tensor] = False,
    ) -> SyncStats:
        """Push `weights` (names as in the served HF checkpoint; a subset updates only those)
        and publish `version`. `patch=True` sends only the elements that changed since this
        object's last sync with `patch=True` (it keeps a copy of what it sent: the model's
        size again); `patch={name: bool mask}` sends the masked elements of those tensors
        only, as changes to the weights the server serves now. Where a patch would be no
        smaller, or the server no longer serves what was last sent, the whole tensors go."""
        mode = PauseMode(pause_mode)
        tensors, chunks, dense, state = self._begin(weights, patch)
        # Someone else's pause (an operator draining the server) is theirs to end.
        resume = state.pause_phase == lifecycle_pb2.PAUSE_PHASE_RUNNING
        num_bytes = sum(c.num_bytes for c in chunks)
        control, rpc_s = self._client.control, self._rpc_timeout_s
        t_pause = time.perf_counter()
        control.PauseGeneration(cpb.PauseGenerationRequest(mode=PAUSE_MODES[mode]), timeout=self._pause_timeout_s)
        try:
            control.StartWeightUpdate(cpb.StartWeightUpdateRequest(), timeout=rpc_s)
            t0 = time.perf_counter()
            bar = _progress_bar(num_bytes, progress)
            try:
                for chunk in chunks:
                    self._send_chunk(chunk, tensors, bar)
            finally:
                bar.close()
            transfer_s = time.perf_counter() - t0
            finish = cpb.FinishWeightUpdateRequest(weight_version=version)
            t_commit = time.perf_counter()
            control.FinishWeightUpdate(finish, timeout=self._step_timeout_s(num_bytes))
            commit_s = time.perf_counter() - t_commit
        except Exception as e:
            raise self._recover(e, resume) from e
        if resume:
            control.ResumeGeneration(cpb.ResumeGenerationRequest(), timeout=rpc_s)
        pause_to_resume_s = time.perf_counter() - t_pause
        self._published = version
        if patch is True:
            # A copy: the caller's tensors (the model's own, on the CPU) change in place.
            kept = self._last_sent or {}
            self._last_sent = {**kept, **{n: t.clone() for n, t in dense.items()}}
        mine = {t.name: t.checksum for c in chunks for t in c.tensors}
        checksum = self._verify(mine) if verify else combined_checksum(mine)
        return SyncStats(
            weight_version=version,
            num_tensors=len(mine),
            num_bytes=num_bytes,
            num_chunks=len(chunks),
            transfer_s=transfer_s,
            pause_to_resume_s=pause_to_resume_s,
            commit_s=commit_s,
            checksum=checksum,
            resumed=resume,
        )

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
        tensors, chunks, _, _ = self._begin(adapter, False)
        start = lifecycle_pb2.StartLoraUpdateRequest(
            lora_name=name,
            version=version,
            adapter_config_json=json.dumps(dict(config)).encode(),
            new_version=new_version,
        )
        t0 = time.perf_counter()
        try:
            self._lifecycle.StartLoraUpdate(start, timeout=self._rpc_timeout_s)
            for chunk in chunks:
                self._send_chunk(chunk, tensors, _NoBar())
            finish = self._lifecycle.FinishLoraUpdate(
                lifecycle_pb2.FinishLoraUpdateRequest(), timeout=self._step_timeout_s(sum(c.num_bytes for c in chunks))
            )
        except Exception as e:
            reason = e.details() if isinstance(e, grpc.RpcError) else str(e)
            with contextlib.suppress(grpc.RpcError):
                self._lifecycle.AbortWeightUpdate(lifecycle_pb2.AbortWeightUpdateRequest(), timeout=self._rpc_timeout_s)
            raise WeightSyncError(
                f"adapter push failed, nothing changed: {reason}", resumed_on_old_weights=True, code=status_of(e)
            ) from e
        return LoraSyncStats(
            lora_name=name,
            version=finish.version,
            lora_id=finish.adapter.lora_id,
            num_tensors=len(tensors),
            num_bytes=sum(c.num_bytes for c in chunks),
            transfer_s=time.perf_counter() - t0,
        )

    def close(self) -> None:
        self._close_sender()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _close_sender(self) -> None:
        sender, self._sender = self._sender, None
        if isinstance(sender, ShmSender):
            sender.close()

    def _begin(
        self, weights: NamedTensors, patch: bool | Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], list[ChunkInfo], dict[str, torch.Tensor], Any]:
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
    ) -> tuple[dict[str, torch.Tensor], list[ChunkInfo], dict[str, torch.Tensor], Any]:
        """What to send, its chunks, the whole tensors it makes, and the server's state; a
        usable transport (a rendezvous if needed)."""
        state = self._lifecycle.GetState(lifecycle_pb2.GetStateRequest(), timeout=self._rpc_timeout_s)
        # Sent in the dtype the server computes with: what it serves is then what was sent.
        dense, chunks = plan_sync(
            weights,
            getattr(torch, state.weight_dtype, None),
            chunk_bytes=self._chunk_bytes,
            bucket_bytes=self._bucket_bytes,
        )
        tensors = dense
        changed = self._changed(dense, patch, state.weight_version)
        if changed is not None:
            sizes = {"chunk_bytes": self._chunk_bytes, "bucket_bytes": self._bucket_bytes}
            tensors, chunks = plan_patch(dense, changed, state.weight_version, **sizes)
        needed = 0
        if state.capabilities.weight_transfer_backend == SHM_BACKEND_NAME:
            needed = max((shm.span(chunk) for chunk in chunks), default=0)
        small = isinstance(self._sender, ShmSender) and self._sender.capacity < needed
        if self._sender is None or not self._sender.joined or not state.transport_ready or small:
            self.init(shm_capacity=needed or DEFAULT_CHUNK_BYTES)
        return tensors, chunks, dense, state

    def _changed(
        self, dense: Mapping[str, torch.Tensor], patch: bool | Mapping[str, torch.Tensor], served_version: str
    ) -> dict[str, torch.Tensor] | None:
        """The changed flat indices per tensor a patch is made of; None: send everything."""
        if patch is False:
            return None
        if patch is not True:
            unknown = sorted(set(patch) - set(dense))
            if unknown:
                raise ValueError(f"masks for tensors that are not sent: {unknown[:5]}")
            masked = {n: torch.nonzero(m.reshape(-1)).view(-1) for n, m in patch.items()}
            return {n: masked.get(n, torch.empty(0, dtype=torch.long)) for n in dense}
        last = self._last_sent
        if last is None or self._published != served_version:
            return None  # nothing sent yet, or someone changed the weights since
        return {n: _patch.changed(t, last[n]) for n, t in dense.items() if n in last and last[n].shape == t.shape}

    def _step_timeout_s(self, num_bytes: int) -> float:
        return step_timeout_s(self._timeout_s, num_bytes)

    def _send_chunk(self, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor], bar: Any) -> None:
        sender = self._sender
        assert sender is not None
        request = cpb.UpdateWeightsRequest(update_info_json=json.dumps(chunk.to_json()).encode())
        if isinstance(sender, ShmSender):
            # The segment is ours until the server answers: the workers copy it out first.
            sender.write(chunk, tensors, bar)
            self._client.control.UpdateWeights(request, timeout=self._step_timeout_s(chunk.num_bytes))
            return
        rpc: Future = self._pool.submit(
            self._client.control.UpdateWeights, request, timeout=self._step_timeout_s(chunk.num_bytes)
        )
        vote = self._pool.submit(sender.vote, True)
        done, _ = wait((rpc, vote), return_when=FIRST_COMPLETED)
        if vote not in done:
            # The server answered before its workers voted: it refused the chunk outright.
            # Our vote can no longer complete, so the group is out of step from here on.
            sender.forget()
            rpc.result()
            raise RuntimeError("the server ended UpdateWeights before receiving the chunk")
        try:
            go = vote.result()
        except RuntimeError:
            sender.forget()
            rpc.result()  # the server's reason, if it has one
            raise
        if not go:
            rpc.result()  # raises the server's reason
            raise RuntimeError("the server refused the chunk")
        try:
            sender.broadcast(chunk, tensors, bar)
        except RuntimeError:
            sender.forget()
            rpc.result()
            raise
        rpc.result()

    def _recover(self, error: Exception, resume: bool) -> WeightSyncError:
        """Abort the session; resume (when `resume`: the sync paused it) when the served
        weights are still the old ones."""
        reason = error.details() if isinstance(error, grpc.RpcError) else str(error)
        try:
            self._lifecycle.AbortWeightUpdate(lifecycle_pb2.AbortWeightUpdateRequest(), timeout=self._rpc_timeout_s)
            state = self._lifecycle.GetState(lifecycle_pb2.GetStateRequest(), timeout=self._rpc_timeout_s)
            if state.weights_consistent and not state.asleep:
                if resume:
                    self._client.control.ResumeGeneration(cpb.ResumeGenerationRequest(), timeout=self._rpc_timeout_s)
                return WeightSyncError(
                    f"weight sync failed, old weights kept: {reason}",
                    resumed_on_old_weights=True,
                    code=status_of(error),
                )
        except grpc.RpcError as e:
            reason += f" (recovery failed too: {e.details()})"
        return WeightSyncError(f"weight sync failed: {reason}", resumed_on_old_weights=False, code=status_of(error))

    def _verify(self, mine: Mapping[str, str]) -> str:
        """The server's digests are read back from the model it serves: a tensor that did not
        arrive, was loaded wrongly or is computed with a stale kernel shows up here."""
        served = self._lifecycle.GetWeightChecksum(
            lifecycle_pb2.GetWeightChecksumRequest(), timeout=self._rpc_timeout_s
        )
        wrong = sorted({n for n, d in mine.items() if served.per_tensor.get(n) != d} | set(served.inconsistent_tensors))
        if wrong:
            raise WeightSyncError(
                f"the server serves different weights for {wrong[:5]} after the sync", resumed_on_old_weights=False
            )
        return served.overall


def status_of(error: BaseException) -> grpc.StatusCode | None:
    """The gRPC status of a failed call; None for any other error."""
    return error.code() if isinstance(error, grpc.RpcError) else None


def step_timeout_s(timeout_s: float, num_bytes: int) -> float:
    """The deadline of an RPC that moves `num_bytes`: the server's own, and our margin."""
    return timeout_s * (1 + num_bytes // BYTES_PER_TIMEOUT) + RPC_MARGIN_S


def _first_failure_wins(rpc: Future, join: Future) -> None:
    """The server's refusal (e.g. a bad init_info) or our side's failure, whichever comes
    first; a refusal does not wait for our rendezvous to time out."""
    done, _ = wait((rpc, join), return_when=FIRST_COMPLETED)
    if rpc in done:
        rpc.result()  # raises the server's reason
    join.result()
    rpc.result()


def _fill(spare: torch.Tensor, bucket: Any, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    # A tensor larger than bucket_bytes gets a bucket of its own size.
    buffer = (
        spare[: bucket.num_bytes]
        if bucket.num_bytes <= spare.numel()
        else torch.empty(bucket.num_bytes, dtype=torch.uint8)
    )
    for index, offset in bucket.placements:
        meta = chunk.tensors[index]
        buffer[offset : offset + meta.num_bytes].copy_(tensors[meta.name].view(-1).view(torch.uint8))
    return buffer


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total_bytes: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="weight sync")
