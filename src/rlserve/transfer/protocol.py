"""The `rlserve_gloo` wire protocol, shared by the trainer SDK and the inference worker.

Owns the JSON shapes of init_info / update_info, the bucket plan both sides derive from an
update_info, and the tensor checksum. Pure Python plus xxhash; torch only for checksums.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

BACKEND_NAME = "rlserve_gloo"
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 60.0
CHECKSUM_ALGORITHM = "xxh3-128"
# Tensors start on this boundary inside a bucket so the receiver can view them in place.
ALIGN_BYTES = 64
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Error markers: the worker's exceptions cross vLLM's process boundary as text; the engine
# adapter maps each marker back to a domain error.
INVALID_UPDATE = "rlserve.invalid_update_info"
TRANSFER_TIMEOUT = "rlserve.transfer_timeout"
CHECKSUM_MISMATCH = "rlserve.checksum_mismatch"


class ProtocolError(ValueError):
    """init_info / update_info that does not follow the protocol (bad JSON shape)."""


@dataclass(frozen=True)
class InitInfo:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> InitInfo:
        known = set(cls.__dataclass_fields__)
        unknown = set(raw) - known
        if unknown:
            raise ProtocolError(f"unknown init_info keys {sorted(unknown)}; expected {sorted(known)}")
        try:
            info = cls(
                master_address=str(raw["master_address"]),
                master_port=int(raw["master_port"]),
                rank_offset=int(raw["rank_offset"]),
                world_size=int(raw["world_size"]),
                timeout_s=float(raw.get("timeout_s", DEFAULT_TIMEOUT_S)),
            )
        except KeyError as e:
            raise ProtocolError(f"init_info needs {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"init_info: {e}") from None
        if not 0 < info.master_port < 65536 or info.world_size < 2 or info.rank_offset < 1:
            raise ProtocolError("init_info: need 0 < master_port < 65536, world_size >= 2, rank_offset >= 1")
        if info.timeout_s <= 0:
            raise ProtocolError("init_info: timeout_s must be positive")
        return info


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype_name: str
    shape: tuple[int, ...]
    checksum: str

    @property
    def num_bytes(self) -> int:
        n = DTYPE_BYTES[self.dtype_name]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ChunkInfo:
    """One UpdateWeights call: the tensors it carries, in send order, and the bucket size."""

    tensors: tuple[TensorMeta, ...]
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> ChunkInfo:
        names, dtypes, shapes = raw.get("names"), raw.get("dtype_names"), raw.get("shapes")
        checksums = raw.get("checksums")
        lists = {"names": names, "dtype_names": dtypes, "shapes": shapes, "checksums": checksums}
        for key, value in lists.items():
            if not isinstance(value, list):
                raise ProtocolError(f"update_info.{key} must be a list")
        if len({len(v) for v in lists.values()}) != 1:
            raise ProtocolError(
                "update_info lists differ in length: " + ", ".join(f"{k}={len(v)}" for k, v in lists.items())
            )
        if not names:
            raise ProtocolError("update_info.names is empty")
        bucket_bytes = raw.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ProtocolError("update_info.bucket_bytes must be a positive integer")
        tensors = []
        for name, dtype, shape, checksum in zip(names, dtypes, shapes, checksums):
            if dtype not in DTYPE_BYTES:
                raise ProtocolError(f"{name}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ProtocolError(f"{name}: shape must be a list of non-negative integers")
            tensors.append(TensorMeta(str(name), dtype, tuple(shape), str(checksum)))
        return cls(tuple(tensors), bucket_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "names": [t.name for t in self.tensors],
            "dtype_names": [t.dtype_name for t in self.tensors],
            "shapes": [list(t.shape) for t in self.tensors],
            "checksums": [t.checksum for t in self.tensors],
            "bucket_bytes": self.bucket_bytes,
        }


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


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def tensor_checksum(tensor: Any) -> str:
    """xxh3-128 of a CPU tensor's bytes in row-major order; the same on both sides."""
    import torch

    t = tensor.detach().contiguous()
    return xxhash.xxh3_128_hexdigest(memoryview(t.view(-1).view(torch.uint8).numpy()))


def combined_checksum(per_tensor: Mapping[str, str]) -> str:
    """One digest over (name, digest) pairs in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(per_tensor):
        h.update(name.encode())
        h.update(b"\0")
        h.update(per_tensor[name].encode())
    return h.hexdigest()
