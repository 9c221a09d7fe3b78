"""A worker's side of `rlserve_shm` (the format: `rlserve.wire.shm`): the trainer's segment,
read with pread and never mapped, so a segment the trainer shrinks meanwhile is a short read
that refuses the chunk, not a SIGBUS that kills the worker."""

from __future__ import annotations

import os
from typing import Any

import torch
import xxhash

from rlserve.wire.protocol import ChunkInfo, Deliver, ErrorCode, ProtocolError, WorkerError, tensor_checksum, wire_view
from rlserve.wire.shm import ShmInit, layout, open_segment

# What a read copies before the digest takes it: small enough to stay in the cache.
READ_BLOCK_BYTES = 512 * 1024


class SegmentFile:
    """A worker's read-only handle on the trainer's segment: read with pread, never mapped."""

    def __init__(self, name: str, size: int) -> None:
        try:
            self._fd, _ = open_segment(name, size)
        except ProtocolError as e:
            raise WorkerError(ErrorCode.INVALID_INFO, str(e)) from e
        self.name, self.size = name, size

    def read_into(self, target: torch.Tensor, offset: int, digest: Any) -> None:
        """Fill `target` (contiguous uint8) with the segment's bytes from `offset`; `digest`
        (an xxh3 hasher) takes them a block at a time as they arrive, while they are still in
        the cache. Raises WorkerError when the segment ends first (the trainer shrank it)."""
        view = target.numpy().data.cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done : done + READ_BLOCK_BYTES]], offset + done)
            if n == 0:
                size = os.fstat(self._fd).st_size
                raise WorkerError(
                    ErrorCode.INVALID_INFO,
                    f"segment {self.name!r} shrank to {size} bytes while a chunk was read from it "
                    f"(it needs {offset + len(view)})",
                )
            digest.update(view[done : done + n])
            done += n

    def close(self) -> None:
        os.close(self._fd)


class ShmLink:
    """A worker's side of rlserve_shm: the trainer's segment, opened read-only, and a landing
    buffer of the same size this worker owns (allocated and touched once, so later syncs
    copy into memory that is already mapped). A chunk is copied from the segment into the
    same place in the landing buffer, digested and delivered about a bucket at a time: what
    is digested and loaded is the worker's copy, whatever the trainer writes meanwhile. Same
    calls as `GlooLink`."""

    def __init__(self, segment: SegmentFile) -> None:
        self._segment = segment
        self._landing = torch.zeros(segment.size, dtype=torch.uint8)

    @classmethod
    def open(cls, info: ShmInit) -> ShmLink:
        return cls(SegmentFile(info.segment, info.size))

    def misfit(self, info: ChunkInfo) -> str | None:
        try:
            layout(info, self._segment.size)
        except ProtocolError as e:
            return str(e)
        return None

    def exchange(
        self,
        info: ChunkInfo,
        accept: bool,
        timeout_s: float,
        deliver: Deliver,
    ) -> bool:
        """Copy the chunk out of the segment and deliver it. No vote is needed: the trainer is
        not blocked in a collective, it waits for the RPC's answer."""
        if not accept:
            return False
        _, placements = layout(info, self._segment.size)
        for group in _groups(info, placements):
            received: dict[str, torch.Tensor] = {}
            digests: dict[str, str] = {}
            for index, offset in group:
                meta = info.tensors[index]
                landed = self._landing[offset : offset + meta.num_bytes]
                raw = xxhash.xxh3_128()
                self._segment.read_into(landed, offset, raw)
                received[meta.name] = wire_view(landed, meta)
                digests[meta.name] = tensor_checksum(received[meta.name], expect=meta.checksum, raw=raw.hexdigest())
            deliver(received, digests)
        return True

    def close(self) -> None:
        self._segment.close()

    def rest(self) -> None:
        pass  # nothing put off


def _groups(info: ChunkInfo, placements: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Consecutive tensors of a chunk in groups of about `bucket_bytes`: delivered one by one."""
    groups: list[list[tuple[int, int]]] = []
    size = 0
    for index, offset in placements:
        if not groups or size >= info.bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((index, offset))
        size += info.tensors[index].num_bytes
    return groups
