"""The `rlserve_gloo` wire protocol, shared by the trainer SDK, the inference worker and the
server's transport seam.

Owns the JSON shapes of init_info / update_info, the bucket plan both sides derive from an
update_info, the tensor digest, and the typed reply a worker sends back across vLLM's process
boundary. Pure Python plus xxhash; torch only inside the digest.
"""

from __future__ import annotations

import enum
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

BACKEND_NAME = "rlserve_gloo"
# Same protocol after the rendezvous, through a shared-memory segment (see `shm`).
SHM_BACKEND_NAME = "rlserve_shm"
# Where both backends keep their shared-memory files.
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
CHECKSUM_ALGORITHM = "xxh3-128"
# Tensors start on this boundary inside a bucket so the receiver can view them in place.
ALIGN_BYTES = 64
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# How a chunk's buckets travel over rlserve_gloo (`ChunkInfo.messages`).
MESSAGE_LAYOUTS = ("bucket", "tensor")
# A patch's flat indices are int32: a patched tensor has at most this many elements.
PATCH_INDEX_BYTES = 4
MAX_PATCHED_ELEMENTS = 2**31 - 1
# Bounds that keep every number well inside 64 bits (what crosses vLLM's process boundary).
MAX_WORLD_SIZE = 1 << 16
MAX_TENSOR_BYTES = 1 << 40
MAX_BUCKET_BYTES = 1 << 40


# How a link hands over one bucket as it lands: its tensors (views the link reuses once the
# call returns) and their digests as received.
Deliver = Callable[[dict[str, Any], dict[str, str]], None]


class ProtocolError(ValueError):
    """init_info / update_info that does not follow the protocol (bad JSON shape)."""


class ErrorCode(enum.Enum):
    """Why a worker refused or failed an operation; the server maps each to a domain error."""

    INVALID_INFO = "invalid_info"  # the trainer's init_info / update_info is wrong
    CHECKSUM_MISMATCH = "checksum_mismatch"  # bytes arrived, but not the ones announced
    TIMEOUT = "timeout"  # the trainer did not show up or stopped sending in time
    WRONG_STATE = "wrong_state"  # no transport, no session, or a broken transport
    COMMIT_FAILED = "commit_failed"  # loading into the model failed half way
    UNSUPPORTED = "unsupported"  # the served model cannot do what was asked


@dataclass(frozen=True)
class Reply:
    """A worker's answer to one operation. Crosses vLLM's process boundary as a plain dict."""

    ok: bool
    code: ErrorCode | None = None
    message: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def failure(cls, code: ErrorCode, message: str) -> Reply:
        return cls(False, code, message)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "code": self.code.value if self.code else "",
            "message": self.message,
            "data": dict(self.data),
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Reply:
        code = raw.get("code") or None
        return cls(bool(raw["ok"]), ErrorCode(code) if code else None, str(raw.get("message", "")), raw.get("data", {}))


class WorkerError(Exception):
    """Raised inside a worker with a code, turned into a failed `Reply` at the boundary."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _require(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in raw:
        raise ProtocolError(f"needs {key!r}")
    value = raw[key]
    # bool is an int in Python; a port or a rank given as true is a mistake.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ProtocolError(f"{key} must be {what}, got {value!r}")
    if not isinstance(value, kind):
        raise ProtocolError(f"{key} must be {what}, got {type(value).__name__}")
    return value


def require_known_keys(raw: Mapping[str, Any], known: set[str]) -> None:
    unknown = set(raw) - known
    if unknown:
        raise ProtocolError(f"unknown init_info keys {sorted(unknown)}; expected {sorted(known)}")


def parse_timeout(raw: Mapping[str, Any], default_timeout_s: float) -> float:
    """init_info's optional `timeout_s`: defaults to, and is capped by, `default_timeout_s`."""
    timeout_s = raw.get("timeout_s", default_timeout_s)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ProtocolError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not 0 < timeout_s < float("inf"):
        raise ProtocolError("timeout_s must be a positive number of seconds")
    return min(float(timeout_s), default_timeout_s)


@dataclass(frozen=True)
class InitInfo:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float

    @classmethod
    def parse(cls, raw: Mapping[str, Any], default_timeout_s: float) -> InitInfo:
        """Strictly typed; `timeout_s` defaults to (and is capped by) `default_timeout_s`."""
        require_known_keys(raw, set(cls.__dataclass_fields__))
        address = _require(raw, "master_address", str, "a host name or address")
        port = _require(raw, "master_port", int, "an integer")
        rank_offset = _require(raw, "rank_offset", int, "an integer")
        world_size = _require(raw, "world_size", int, "an integer")
        timeout_s = parse_timeout(raw, default_timeout_s)
        if not address or not 0 < port < 65536 or not 2 <= world_size <= MAX_WORLD_SIZE:
            raise ProtocolError(
                f"need a master_address, 0 < master_port < 65536 and 2 <= world_size <= {MAX_WORLD_SIZE}"
            )
        if not 1 <= rank_offset < world_size:
            raise ProtocolError(f"need 1 <= rank_offset < world_size ({world_size}); the trainer is rank 0")
        return cls(address, port, rank_offset, world_size, timeout_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "timeout_s": self.timeout_s,
        }


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype_name: str
    shape: tuple[int, ...]
    # xxh3-128 of the whole tensor as it will be served (for a patch: once applied).
    checksum: str
    # A sparse patch of this many elements (see `patch`) instead of the whole tensor.
    num_changed: int | None = None

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def num_bytes(self) -> int:
        """Bytes on the wire."""
        if self.num_changed is not None:
            return self.num_changed * (PATCH_INDEX_BYTES + DTYPE_BYTES[self.dtype_name])
        return self.num_elements * DTYPE_BYTES[self.dtype_name]


@dataclass(frozen=True)
class ChunkInfo:
    """One UpdateWeights call: the tensors it carries, in send order, and the bucket size."""

    tensors: tuple[TensorMeta, ...]
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    # rlserve_shm only: where the chunk starts in the trainer's segment (64-byte aligned).
    segment_offset: int = 0
    # A chunk with patches names the weight version they apply to.
    base_weight_version: str | None = None
    # rlserve_gloo only: one message per bucket ("bucket", the sender packs each bucket into a
    # buffer first) or per tensor ("tensor": sent from the tensor's own memory, no packing).
    messages: str = "bucket"

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors)

    @classmethod
    def parse(cls, raw: Any) -> ChunkInfo:
        if not isinstance(raw, Mapping):
            raise ProtocolError("update_info must be a JSON object")
        known = {
            "names",
            "dtype_names",
            "shapes",
            "checksums",
            "bucket_bytes",
            "segment_offset",
            "num_changed",
            "base_weight_version",
            "messages",
        }
        unknown = set(raw) - known
        if unknown:
            raise ProtocolError(f"unknown update_info keys {sorted(unknown)}; expected {sorted(known)}")
        lists = {key: _require(raw, key, list, "a list") for key in ("names", "dtype_names", "shapes", "checksums")}
        if len({len(v) for v in lists.values()}) != 1:
            raise ProtocolError(
                "update_info lists differ in length: " + ", ".join(f"{k}={len(v)}" for k, v in lists.items())
            )
        if not lists["names"]:
            raise ProtocolError("update_info.names is empty")
        bucket_bytes = raw.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
        if (
            isinstance(bucket_bytes, bool)
            or not isinstance(bucket_bytes, int)
            or not 0 < bucket_bytes <= MAX_BUCKET_BYTES
        ):
            raise ProtocolError(f"update_info.bucket_bytes must be an integer in 1..{MAX_BUCKET_BYTES}")
        offset = raw.get("segment_offset", 0)
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= MAX_BUCKET_BYTES:
            raise ProtocolError(f"update_info.segment_offset must be an integer in 0..{MAX_BUCKET_BYTES}")
        if offset % ALIGN_BYTES:
            raise ProtocolError(f"update_info.segment_offset must be a multiple of {ALIGN_BYTES}")
        num_changed = raw.get("num_changed", [None] * len(lists["names"]))
        if not isinstance(num_changed, list) or len(num_changed) != len(lists["names"]):
            raise ProtocolError("update_info.num_changed must be a list as long as names (null: the whole tensor)")
        base = raw.get("base_weight_version")
        if base is not None and (not isinstance(base, str) or not base):
            raise ProtocolError("update_info.base_weight_version must be a non-empty string")
        if base is None and any(k is not None for k in num_changed):
            raise ProtocolError("a chunk with patches (num_changed) must name its base_weight_version")
        messages = raw.get("messages", "bucket")
        if messages not in MESSAGE_LAYOUTS:
            raise ProtocolError(f"update_info.messages must be one of {list(MESSAGE_LAYOUTS)}")
        tensors = tuple(
            _tensor_meta(name, dtype, shape, checksum, changed)
            for (name, dtype, shape, checksum), changed in zip(zip(*lists.values()), num_changed)
        )
        return cls(tensors, bucket_bytes, offset, base, messages)

    def to_json(self) -> dict[str, Any]:
        patches = any(t.num_changed is not None for t in self.tensors)
        return {
            "names": [t.name for t in self.tensors],
            "dtype_names": [t.dtype_name for t in self.tensors],
            "shapes": [list(t.shape) for t in self.tensors],
            "checksums": [t.checksum for t in self.tensors],
            "bucket_bytes": self.bucket_bytes,
            **({"segment_offset": self.segment_offset} if self.segment_offset else {}),
            **({"num_changed": [t.num_changed for t in self.tensors]} if patches else {}),
            **({"base_weight_version": self.base_weight_version} if self.base_weight_version else {}),
            **({"messages": self.messages} if self.messages != "bucket" else {}),
        }

    def messages_of(self, bucket: Bucket) -> list[tuple[int | None, int, int]]:
        """(the tensor's index, None for the whole bucket; byte offset in the bucket; bytes)
        of each rlserve_gloo message that carries `bucket`, in order: the whole bucket, or
        each of its tensors that has bytes."""
        if self.messages == "bucket":
            return [(None, 0, bucket.num_bytes)]
        return [(i, offset, self.tensors[i].num_bytes) for i, offset in bucket.placements if self.tensors[i].num_bytes]


def _tensor_meta(name: Any, dtype: Any, shape: Any, checksum: Any, changed: Any) -> TensorMeta:
    """One tensor of a chunk's update_info, strictly typed."""
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"tensor names must be non-empty strings, got {name!r}")
    if dtype not in DTYPE_BYTES:
        raise ProtocolError(f"{name}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape
    ):
        raise ProtocolError(f"{name}: shape must be a list of non-negative integers")
    if not isinstance(checksum, str):
        raise ProtocolError(f"{name}: checksum must be a string")
    meta = TensorMeta(name, dtype, tuple(shape), checksum, _num_changed(name, changed, shape))
    if meta.num_bytes > MAX_TENSOR_BYTES:
        raise ProtocolError(f"{name}: more bytes than any tensor may have ({MAX_TENSOR_BYTES})")
    return meta


def _num_changed(name: str, raw: Any, shape: list[int]) -> int | None:
    if raw is None:
        return None
    numel = 1
    for d in shape:
        numel *= d
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 < raw <= numel:
        raise ProtocolError(f"{name}: num_changed must be an integer in 1..{numel} (its elements), or null")
    if numel > MAX_PATCHED_ELEMENTS:
        raise ProtocolError(f"{name}: a patch addresses tensors of at most {MAX_PATCHED_ELEMENTS} elements")
    return raw


def wire_view(raw: Any, meta: TensorMeta) -> Any:
    """One tensor's bytes (a uint8 tensor) as received: the tensor itself, or for a patch
    the blob of indices and values."""
    import torch

    if meta.num_changed is not None:
        return raw
    return raw.view(getattr(torch, meta.dtype_name)).view(meta.shape)


@dataclass(frozen=True)
class Bucket:
    num_bytes: int
    # (index into ChunkInfo.tensors, byte offset inside the bucket)
    placements: tuple[tuple[int, int], ...]


def plan_buckets(tensors: Sequence[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Pack tensors in order into buckets of at most `bucket_bytes` (a larger tensor gets a
    bucket of its own). Both sides call this with the same input, so they agree."""
    buckets: list[Bucket] = []
    placements: list[tuple[int, int]] = []
    offset = 0
    for i, t in enumerate(tensors):
        start = _align(offset)
        if placements and start + t.num_bytes > bucket_bytes:
            buckets.append(Bucket(offset, tuple(placements)))
            placements, start = [], 0
        placements.append((i, start))
        offset = start + t.num_bytes
    if placements:
        buckets.append(Bucket(offset, tuple(placements)))
    return buckets


def landing_offsets(buckets: Sequence[Bucket]) -> tuple[list[int], int]:
    """Where each bucket of a chunk lands in a receiver's memory, each at a 64-byte boundary
    (so every tensor in it stays aligned as in its bucket, whatever the previous bucket's
    size), and the bytes they span."""
    offsets, at = [], 0
    for bucket in buckets:
        at = _align(at)
        offsets.append(at)
        at += bucket.num_bytes
    return offsets, at


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def tensor_checksum(tensor: Any, expect: str | None = None, raw: str | None = None) -> str:
    """xxh3-128 of a CPU tensor's row-major bytes, with -0.0 counted as +0.0 (adding +0.0
    does exactly that and leaves every other value alone). The server digests what its
    kernels compute, and a kernel cannot tell the two zeros apart. A tensor without a -0.0
    is hashed as it is: adding +0.0 allocates and, without native bf16, converts (five
    times the digest's own cost), while finding a -0.0 is one pass of integer minimum.

    A receiver passes the digest the sender announced (`expect`): the bytes are hashed as
    they are first (`raw`, where the caller hashed them while copying), and when that is
    `expect` they are the bytes the sender digested, with no -0.0 in them: `expect` is the
    answer. Otherwise the full digest is computed: bytes with a -0.0 match still, other
    bytes do not. (A sender that hashed its bytes without the rule gets them taken as the
    bytes it sent; only the served digest after the commit shows the difference.)"""
    t = tensor.detach().contiguous()
    if not t.is_floating_point():
        return raw or _bytes_digest(t)
    if expect is not None and (raw or _bytes_digest(t)) == expect:
        return expect
    return _bytes_digest(t + 0.0 if _has_negative_zero(t) else t)


def _has_negative_zero(t: Any) -> bool:
    """Whether a contiguous floating CPU tensor holds a -0.0: its bit pattern (the sign bit
    alone) is, read as a signed integer of the same width, the smallest there is."""
    import torch

    if t.numel() == 0:
        return False
    signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return int(t.view(signed).min()) == torch.iinfo(signed).min


def _bytes_digest(t: Any) -> str:
    """xxh3-128 of a contiguous CPU tensor's bytes, as they are."""
    import torch

    return xxhash.xxh3_128_hexdigest(memoryview(t.view(-1).view(torch.uint8).numpy()))


def combined_checksum(per_tensor: Mapping[str, str]) -> str:
    """One digest over (name, digest) pairs in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(per_tensor):
        h.update(name.encode())
        h.update(b"\0")
        h.update(per_tensor[name].encode())
    return h.hexdigest()
