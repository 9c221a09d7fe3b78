"""The trainer SDK: push a `torch.nn.Module`'s weights into one rlserve server.

`WeightSync.init()` performs the rendezvous (the server RPC and the trainer's side at once);
`sync()` runs pause -> start -> chunks (RPC and broadcast concurrently) -> finish -> resume,
then checks the server's checksums against its own. On failure it aborts the session,
resumes on the old weights where that is safe, and raises `WeightSyncError`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from rlserve.api.rlserve.v1 import lifecycle_pb2, lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.client import Client
from rlserve.transfer.gloo_group import GlooGroup
from rlserve.transfer.protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    ChunkInfo,
    TensorMeta,
    combined_checksum,
    plan_buckets,
    tensor_checksum,
)

DEFAULT_CHUNK_BYTES = 1024 * 1024 * 1024
PAUSE_MODES = {"abort": cpb.PAUSE_MODE_ABORT, "wait": cpb.PAUSE_MODE_WAIT, "keep": cpb.PAUSE_MODE_KEEP}

NamedTensors = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A sync failed; `resumed_on_old_weights` says whether generation continues as before."""

    def __init__(self, message: str, *, resumed_on_old_weights: bool) -> None:
        super().__init__(message)
        self.resumed_on_old_weights = resumed_on_old_weights


@dataclass(frozen=True)
class SyncStats:
    weight_version: str
    num_tensors: int
    num_bytes: int
    num_chunks: int
    transfer_s: float
    pause_to_resume_s: float
    checksum: str

    @property
    def transfer_gb_per_s(self) -> float:
        return self.num_bytes / self.transfer_s / 1e9 if self.transfer_s else 0.0


class WeightSync:
    def __init__(
        self,
        client: Client,
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if bucket_bytes <= 0 or chunk_bytes < bucket_bytes:
            raise ValueError("need 0 < bucket_bytes <= chunk_bytes")
        self._client = client
        self._lifecycle = lifecycle_pb2_grpc.LifecycleStub(client.channel)
        self._address, self._port, self._timeout_s = master_address, master_port, timeout_s
        self._bucket_bytes, self._chunk_bytes = bucket_bytes, chunk_bytes
        self._group: GlooGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlserve-sync-rpc")

    def init(self) -> None:
        """Rendezvous with every inference worker (the server's RPC runs concurrently)."""
        info = self._client.server_info()
        world_size = 1 + info.parallelism.world_size * max(1, info.parallelism.data_parallel_size)
        store = GlooGroup.host_store(self._address, self._port, world_size, self._timeout_s)
        init_info = {
            "master_address": self._address,
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": world_size,
            "timeout_s": self._timeout_s,
        }
        rpc = self._pool.submit(
            self._client.control.InitWeightTransferEngine,
            cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(init_info).encode()),
        )
        try:
            self._group = GlooGroup(store, 0, world_size, self._timeout_s)
        finally:
            rpc.result()

    def sync(
        self, weights: NamedTensors, version: str, *, pause_mode: str = "keep", progress: bool = False
    ) -> SyncStats:
        """Push `weights` (names as in the served HF checkpoint) and publish `version`."""
        if self._group is None:
            raise RuntimeError("call init() before sync()")
        tensors = dict(_named_tensors(weights))
        control = self._client.control
        t_pause = time.perf_counter()
        control.PauseGeneration(cpb.PauseGenerationRequest(mode=PAUSE_MODES[pause_mode]))
        try:
            control.StartWeightUpdate(cpb.StartWeightUpdateRequest())
            t0 = time.perf_counter()
            chunks = _plan_chunks(tensors, self._chunk_bytes, self._bucket_bytes)
            bar = _progress_bar(sum(t.num_bytes for c in chunks for t in c.tensors), progress)
            for chunk in chunks:
                self._send_chunk(chunk, tensors, bar)
            bar.close()
            transfer_s = time.perf_counter() - t0
            control.FinishWeightUpdate(cpb.FinishWeightUpdateRequest(weight_version=version))
        except Exception as e:
            raise self._recover(e) from e
        control.ResumeGeneration(cpb.ResumeGenerationRequest())
        pause_to_resume_s = time.perf_counter() - t_pause
        checksum = self._verify(tensors)
        return SyncStats(
            weight_version=version,
            num_tensors=len(tensors),
            num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            num_chunks=len(chunks),
            transfer_s=transfer_s,
            pause_to_resume_s=pause_to_resume_s,
            checksum=checksum,
        )

    def close(self) -> None:
        self._group = None
        self._pool.shutdown(wait=False)

    def _send_chunk(self, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor], bar: Any) -> None:
        request = cpb.UpdateWeightsRequest(update_info_json=json.dumps(chunk.to_json()).encode())
        rpc: Future = self._pool.submit(self._client.control.UpdateWeights, request)
        group = self._group
        if group is None or not group.vote(True):
            rpc.result()  # raises the server's reason
            raise RuntimeError("the server refused the chunk")
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
        rpc.result()

    def _recover(self, error: Exception) -> WeightSyncError:
        """Abort the session; resume when the served weights are still the old ones."""
        reason = error.details() if isinstance(error, grpc.RpcError) else str(error)
        try:
            self._lifecycle.AbortWeightUpdate(lifecycle_pb2.AbortWeightUpdateRequest())
            state = self._lifecycle.GetState(lifecycle_pb2.GetStateRequest())
            if state.weights_consistent and not state.asleep:
                self._client.control.ResumeGeneration(cpb.ResumeGenerationRequest())
                return WeightSyncError(f"weight sync failed, old weights kept: {reason}", resumed_on_old_weights=True)
        except grpc.RpcError as e:
            reason += f" (recovery failed too: {e.details()})"
        return WeightSyncError(f"weight sync failed: {reason}", resumed_on_old_weights=False)

    def _verify(self, tensors: Mapping[str, torch.Tensor]) -> str:
        served = self._lifecycle.GetWeightChecksum(lifecycle_pb2.GetWeightChecksumRequest())
        mine = {name: tensor_checksum(t) for name, t in tensors.items()}
        wrong = [n for n, d in mine.items() if served.per_tensor.get(n) != d]
        if wrong:
            raise WeightSyncError(
                f"the server serves different bytes for {wrong[:5]} after the sync", resumed_on_old_weights=False
            )
        return combined_checksum(dict(served.per_tensor))


def _named_tensors(weights: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(weights, torch.nn.Module):
        items: Iterable[tuple[str, torch.Tensor]] = weights.named_parameters()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    for name, tensor in items:
        yield name, tensor.detach().to("cpu").contiguous()


def _plan_chunks(tensors: Mapping[str, torch.Tensor], chunk_bytes: int, bucket_bytes: int) -> list[ChunkInfo]:
    chunks: list[ChunkInfo] = []
    current: list[TensorMeta] = []
    size = 0
    for name, t in tensors.items():
        meta = TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), tensor_checksum(t))
        if current and size + meta.num_bytes > chunk_bytes:
            chunks.append(ChunkInfo(tuple(current), bucket_bytes))
            current, size = [], 0
        current.append(meta)
        size += meta.num_bytes
    if current:
        chunks.append(ChunkInfo(tuple(current), bucket_bytes))
    return chunks


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
