"""The trainer's halves of rlserve's transports, with no control RPC in them, behind one
interface (`Sender`): `TensorSender` (rlserve_gloo: a gloo group, any host) and `ShmSender`
(rlserve_shm: shared memory, servers on the trainer's host). `open_sender` picks one from the
backend the servers advertise; `WeightSync` and the fleet drive it without knowing which.
A new rlserve transport is a sender here, a link in the worker and a row in `SENDERS`."""

from __future__ import annotations

import mmap
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from rlserve.config import DEFAULT_TRANSFER_TIMEOUT_S
from rlserve.wire import shm
from rlserve.wire.gloo_group import GlooGroup
from rlserve.wire.protocol import BACKEND_NAME, SHM_BACKEND_NAME, SHM_DIR, ChunkInfo, plan_buckets


class Sender(ABC):
    """The trainer's half of one transport to the workers of one or more servers (its
    members, in order). Driven the same way whatever the backend: send member i's
    `init_info(i)` to its InitWeightTransferEngine while `join()` runs, then `initialized()`;
    for each chunk `write()` it, send `chunk.to_json()` to every member's UpdateWeights, and
    run `send()` while they run. `joined` turns False when the transport is out of step (a
    refused or broken chunk): a new one is needed."""

    backend: ClassVar[str]
    # Whether `send` waits for every member's workers (a collective): a member that refused
    # the chunk must then be fenced off, or the others wait for it until their deadline.
    waits_for_every_member: ClassVar[bool] = False

    @property
    @abstractmethod
    def joined(self) -> bool: ...

    @property
    def master(self) -> tuple[str, int] | None:
        """Where the trainer's end listens (address, port), for a transport with one."""
        return None

    @abstractmethod
    def init_info(self, member: int = 0) -> dict[str, Any]:
        """What member `member`'s InitWeightTransferEngine takes as init_info."""

    def join(self) -> None:
        """The trainer's side of the rendezvous, while the members' inits run."""

    def initialized(self) -> None:
        """Every member's init has answered (or failed)."""

    def fits(self, chunks: Sequence[ChunkInfo]) -> bool:
        """Whether these chunks can travel over this transport as it was set up."""
        return True

    def write(self, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor], bar: Any = None) -> None:
        """Before the members' UpdateWeights: what must be in place when they start."""

    @abstractmethod
    def send(self, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor], bar: Any = None) -> bool:
        """While the members' UpdateWeights run; False (nothing sent) when they refused."""

    @abstractmethod
    def forget(self) -> None:
        """Out of step: `joined` turns False."""

    def close(self) -> None:
        """Free what the transport holds."""


class TensorSender(Sender):
    """The trainer's half of the rlserve_gloo transport, with no control RPC in it: the
    rendezvous store, the collective group, the vote on each chunk and its bucketed broadcast.
    `WeightSync` drives it over rlserve's gRPC control plane; any other control path (Dynamo's
    RL routes, say) drives it the same way: send `init_info()` to InitWeightTransferEngine
    while `join()` runs, then for each chunk send `chunk.to_json()` to UpdateWeights while
    `send(chunk, tensors)` runs."""

    backend = BACKEND_NAME
    waits_for_every_member = True

    def __init__(
        self,
        num_workers: int | Sequence[int],
        *,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> None:
        """`num_workers`: the server's world size times its data-parallel size; for several
        servers in one group, each one's (they take ranks in this order)."""
        counts = [num_workers] if isinstance(num_workers, int) else list(num_workers)
        self._offsets = [1 + sum(counts[:i]) for i in range(len(counts))]
        self.world_size = 1 + sum(counts)
        self.timeout_s = timeout_s
        self._address = master_address
        self._store = GlooGroup.host_store(master_address, master_port, self.world_size, timeout_s)
        self._group: GlooGroup | None = None

    @property
    def master(self) -> tuple[str, int]:
        """Where the trainer's end of the group listens (address, port)."""
        return self._address, self._store.port

    def init_info(self, member: int = 0) -> dict[str, Any]:
        """What member `member`'s InitWeightTransferEngine takes as init_info: its workers
        join as ranks from its offset on (several servers in one group each get their own
        range)."""
        return {
            "master_address": self._address,
            "master_port": self._store.port,
            "rank_offset": self._offsets[member],
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
        refused it. A failure leaves the group out of step: `joined` turns False. A tensor
        that is not as the chunk describes it (absent, another size, not contiguous) is
        ValueError after a vote of no: nothing is sent and the group stays in step."""
        misfit = _misfit(chunk, tensors)
        try:
            if not self.vote(misfit is None):
                if misfit is not None:
                    raise ValueError(misfit)
                return False
            self.broadcast(chunk, tensors, bar)
            return True
        except RuntimeError:
            self.forget()
            raise

    def broadcast(self, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor], bar: Any = None) -> None:
        """The chunk's messages (`ChunkInfo.messages`): each tensor from its own memory, or
        each bucket packed into a buffer first."""
        group = self._group_or_raise()
        bar = bar or NoBar()
        buckets = plan_buckets(chunk.tensors, chunk.bucket_bytes)
        if chunk.messages == "tensor":
            # Every message at once: nothing is copied, so nothing waits for a buffer.
            posted = []
            for bucket in buckets:
                names = [chunk.tensors[i].name for i, _, _ in chunk.messages_of(bucket) if i is not None]
                posted.append([group.broadcast_async(_bytes(tensors[name])) for name in names])
            for works, bucket in zip(posted, buckets):
                for work in works:
                    work.wait()
                bar.update(bucket.num_bytes)
            return
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


class ShmSender(Sender):
    """The trainer's half of rlserve_shm: a shared-memory segment per member (each server
    removes the name of the one it opened), created for a session and reused for every chunk
    of every step. Send `init_info(i)` to member i's InitWeightTransferEngine and `unlink()`
    whatever the answers (the workers keep their files open); for each chunk
    `write(chunk, tensors)`, then send `chunk.to_json()` to UpdateWeights."""

    backend = SHM_BACKEND_NAME

    def __init__(self, capacity: int, *, timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S, num_members: int = 1) -> None:
        """`capacity`: bytes, at least the largest chunk's `shm.span`: every chunk is written
        from offset 0 (the workers have copied a chunk out when UpdateWeights answers)."""
        self.segments: list[Segment] = []
        self._closed = False
        try:
            for _ in range(num_members):
                # Unique per trainer process and session; the server opens only names of this shape.
                self.segments.append(Segment.create(f"rlserve-shm-{os.getpid()}-{uuid.uuid4().hex}", capacity))
        except BaseException:
            self.close()
            raise
        self.timeout_s = timeout_s
        self._joined = True

    @property
    def segment(self) -> Segment:
        """The first member's segment (a single server's)."""
        return self.segments[0]

    @property
    def capacity(self) -> int:
        return self.segment.size

    @property
    def joined(self) -> bool:
        return self._joined

    def init_info(self, member: int = 0) -> dict[str, Any]:
        segment = self.segments[member]
        return {"segment": segment.name, "size": segment.size, "timeout_s": self.timeout_s}

    def initialized(self) -> None:
        self.unlink()  # the workers have it open (or never will)

    def fits(self, chunks: Sequence[ChunkInfo]) -> bool:
        return max((shm.span(c) for c in chunks), default=0) <= self.capacity

    def unlink(self) -> None:
        for segment in self.segments:
            shm.unlink(segment.name)

    def write(self, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor], bar: Any = None) -> None:
        # The segments are ours until the servers answer: their workers copy a chunk out first.
        for index, offset in shm.layout(chunk, self.capacity)[1]:
            meta = chunk.tensors[index]
            source = _bytes(tensors[meta.name])
            for segment in self.segments:
                segment.bytes[offset : offset + meta.num_bytes].copy_(source)
            if bar is not None:
                bar.update(meta.num_bytes)

    def send(self, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor], bar: Any = None) -> bool:
        return True  # written before the RPCs; each worker reads the chunk on its own

    def forget(self) -> None:
        self._joined = False

    def close(self) -> None:
        """Idempotent: the group closes a sender it forgets, its owner may too."""
        if self._closed:
            return
        self._closed = True
        self.unlink()
        for segment in self.segments:
            segment.close()


class Segment:
    """The trainer's named shared-memory segment, mapped read-write, as one uint8 tensor."""

    def __init__(self, name: str, size: int, mapping: mmap.mmap) -> None:
        self.name, self.size = name, size
        self._mapping = mapping
        self.bytes = torch.frombuffer(mapping, dtype=torch.uint8, count=size)

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        """A new segment only this user can open; raises FileExistsError for a taken name."""
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserved now, so a full /dev/shm is an OSError here, not a SIGBUS on first write.
            os.posix_fallocate(fd, 0, size)
            return cls(name, size, mmap.mmap(fd, size))
        except BaseException:
            shm.unlink(name)
            raise
        finally:
            os.close(fd)

    def close(self) -> None:
        del self.bytes  # the tensor holds the buffer: drop it before unmapping
        self._mapping.close()


def _fill(spare: torch.Tensor, bucket: Any, chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    # A tensor larger than bucket_bytes gets a bucket of its own size.
    buffer = (
        spare[: bucket.num_bytes]
        if bucket.num_bytes <= spare.numel()
        else torch.empty(bucket.num_bytes, dtype=torch.uint8)
    )
    for index, offset in bucket.placements:
        meta = chunk.tensors[index]
        buffer[offset : offset + meta.num_bytes].copy_(_bytes(tensors[meta.name]))
    return buffer


def _misfit(chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Why `tensors` cannot be sent as `chunk` (a message of another size than the receivers
    post would end their helpers), if they cannot."""
    for meta in chunk.tensors:
        tensor = tensors.get(meta.name)
        if tensor is None:
            return f"{meta.name}: not among the tensors given"
        if tensor.device.type != "cpu":
            return f"{meta.name}: a sender sends CPU tensors, given one on {tensor.device}"
        if not tensor.is_contiguous():
            return f"{meta.name}: a sender sends contiguous tensors"
        if tensor.nbytes != meta.num_bytes:
            return f"{meta.name}: {tensor.nbytes} bytes given, the chunk says {meta.num_bytes}"
    return None


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view (no copy)."""
    return tensor.view(-1).view(torch.uint8)


class NoBar:
    """A progress bar that shows nothing."""

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


# backend name -> (worker counts per member, master address, master port, timeout, the
# largest chunk's span) -> its sender
SENDERS: dict[str, Callable[[Sequence[int], str, int, float, int], Sender]] = {
    BACKEND_NAME: lambda workers, address, port, timeout_s, _: TensorSender(
        workers, master_address=address, master_port=port, timeout_s=timeout_s
    ),
    SHM_BACKEND_NAME: lambda workers, _address, _port, timeout_s, span: ShmSender(
        span, timeout_s=timeout_s, num_members=len(workers)
    ),
}


def open_sender(
    backend: str,
    workers: Sequence[int],
    *,
    master_address: str = "127.0.0.1",
    master_port: int = 0,
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    span: int = 0,
) -> Sender:
    """The sender for servers that run `backend`, whose members have `workers` workers each;
    `span`: the bytes the largest chunk takes (shared memory is sized for it). Raises
    ValueError for a backend rlserve has no trainer side for."""
    make = SENDERS.get(backend)
    if make is None:
        raise ValueError(
            f"the server's weight-transfer backend is {backend or 'none'!r}; the SDK sends over {sorted(SENDERS)}"
        )
    return make(workers, master_address, master_port, timeout_s, span)
