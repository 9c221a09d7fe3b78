"""`rlserve_shm`: weights through shared memory, for a trainer on the server's host.

The trainer creates one segment (a file in /dev/shm, mode 0600, its name made unique per
trainer process and session) sized for its largest chunk, and reuses it for every step.
InitWeightTransferEngine names it; the server and every worker open it (a regular file of the
server's own user, opened without following links and without blocking, so a symlink, a
directory, a FIFO or another user's file is refused at once and left alone), then the server
removes the name if it still names the file they opened. From then on only open files hold
the memory: nothing is left in /dev/shm whoever crashes, and the memory is freed once the
trainer and the workers have closed it (a worker closes its own at the next init or at
shutdown). A worker never maps the trainer's file: it reads it with pread, so a segment the
trainer shrinks meanwhile is a short read that refuses the chunk, not a SIGBUS that kills the
worker.

Per chunk the trainer writes the tensors from the chunk's `segment_offset` on (the SDK: 0),
packed as the shared bucket plan packs one bucket (64-byte aligned, in order: `plan_buckets`,
as rlserve_gloo derives its buckets), and calls UpdateWeights; each worker copies the chunk
into its landing buffer a bucket's worth at a time, checks the digests and loads the tensors
into the update's shadows exactly as rlserve_gloo does. Once UpdateWeights has answered,
nothing refers to the segment's bytes any more: the next chunk may reuse them.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlserve.wire.protocol import (
    SHM_DIR,
    ChunkInfo,
    ProtocolError,
    parse_timeout,
    plan_buckets,
    require_known_keys,
)

# A name, never a path: the server opens segments of this shape and nothing else.
SEGMENT_NAME = re.compile(r"rlserve-shm-[A-Za-z0-9_.-]{1,200}")
MAX_SEGMENT_BYTES = 1 << 40


@dataclass(frozen=True)
class ShmInit:
    segment: str
    size: int
    timeout_s: float

    @classmethod
    def parse(cls, raw: Mapping[str, Any], default_timeout_s: float) -> ShmInit:
        require_known_keys(raw, set(cls.__dataclass_fields__))
        segment, size = raw.get("segment"), raw.get("size")
        if not isinstance(segment, str) or SEGMENT_NAME.fullmatch(segment) is None:
            raise ProtocolError(f"segment must be a name matching {SEGMENT_NAME.pattern}, got {str(segment)[:80]!r}")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_SEGMENT_BYTES:
            raise ProtocolError(f"size must be an integer number of bytes in 1..{MAX_SEGMENT_BYTES}")
        return cls(segment, size, parse_timeout(raw, default_timeout_s))

    def to_json(self) -> dict[str, Any]:
        return {"segment": self.segment, "size": self.size, "timeout_s": self.timeout_s}


def open_segment(name: str, size: int) -> tuple[int, os.stat_result]:
    """Open the segment `name` for reading: (its fd, its stat). Raises ProtocolError (nothing
    opened) when it is missing, a symlink, not a regular file of this user, or smaller than
    `size`; never blocks (a FIFO opens at once, and is refused)."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ProtocolError(f"cannot open shared memory {name!r}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ProtocolError(f"{name!r} is not a segment of this user (a regular file it owns)")
        if st.st_size < size:
            raise ProtocolError(f"{name!r} has {st.st_size} bytes, init_info says {size}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def unlink_if_same(name: str, opened: os.stat_result) -> None:
    """Remove the name `name` if it still names the file `opened` (not whatever took its place)."""
    path = SHM_DIR / name
    try:
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino):
            os.unlink(path)
    except FileNotFoundError:
        pass


def unlink(name: str) -> None:
    """Remove a segment's name (the memory stays while mapped); a missing name is fine."""
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass


def _packed(chunk: ChunkInfo):
    """The chunk's tensors packed as one bucket (64-byte aligned, in order)."""
    (bucket,) = plan_buckets(chunk.tensors, 1 << 62)
    return bucket


def span(chunk: ChunkInfo) -> int:
    """The bytes a chunk takes in a segment."""
    return _packed(chunk).num_bytes


def layout(chunk: ChunkInfo, segment_size: int) -> tuple[int, list[tuple[int, int]]]:
    """(bytes the chunk spans, [(tensor index, byte offset in the segment)]) for a chunk laid
    out from its `segment_offset`; raises ProtocolError when it does not fit the segment."""
    bucket = _packed(chunk)
    end = chunk.segment_offset + bucket.num_bytes
    if end > segment_size:
        raise ProtocolError(
            f"a chunk of {bucket.num_bytes} bytes at offset {chunk.segment_offset} does not fit "
            f"the {segment_size}-byte segment"
        )
    return bucket.num_bytes, [(i, chunk.segment_offset + offset) for i, offset in bucket.placements]
