"""What a trainer sends for one update: its tensors in the served dtype, the patches of those
that changed, and the chunks they travel in with their digests, as a `Payload`: all of it at
once (`Planned`), or chunk by chunk from tensors announced first and then yielded one at a
time (`Streamed`, from a `TensorStream`: no second copy of the model). Pure planning (torch
and the wire protocol); `rlserve.sdk.protocol` sends it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rlserve.wire import patch
from rlserve.wire.protocol import (
    DEFAULT_BUCKET_BYTES,
    DTYPE_BYTES,
    MAX_TENSOR_BYTES,
    ChunkInfo,
    TensorMeta,
    tensor_checksum,
)

DEFAULT_CHUNK_BYTES = 1024 * 1024 * 1024


@dataclass(frozen=True)
class TensorStream:
    """Tensors announced before any is sent, `(name, dtype, shape)` each (dtypes as vLLM and
    TRL spell them: "bfloat16"), then yielded by `items` in that order, one at a time (TRL's
    `update_named_params`, a gather under FSDP): a sync holds one chunk of them at a time."""

    metadata: Sequence[tuple[str, str, Sequence[int]]]
    items: Iterable[tuple[str, torch.Tensor]]


NamedTensors = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | TensorStream


class Payload(Protocol):
    """What one sync sends. `layout`: its chunks as known before anything is sent (every
    tensor's name, dtype and shape, so sizes and spans; a digest may still be blank);
    `chunks()`: each chunk with its digests and its tensors, made as it is sent (once)."""

    @property
    def layout(self) -> Sequence[ChunkInfo]: ...

    def chunks(self) -> Iterator[tuple[ChunkInfo, Mapping[str, torch.Tensor]]]: ...


@dataclass(frozen=True)
class Planned:
    """A payload made before the sync: every tensor already in the served dtype."""

    layout: Sequence[ChunkInfo]
    tensors: Mapping[str, torch.Tensor]

    def chunks(self) -> Iterator[tuple[ChunkInfo, Mapping[str, torch.Tensor]]]:
        for chunk in self.layout:
            yield chunk, self.tensors


class Streamed:
    """A payload made as it is sent, from a `TensorStream`: each chunk takes its tensors from
    the stream when its turn comes and lets them go after. A tensor that is not the one
    announced (name, shape, a dtype that cannot be sent), a stream that ends early or runs
    on raises ValueError before the chunk that would carry it is sent."""

    def __init__(self, stream: TensorStream, dtype: torch.dtype | None, *, chunk_bytes: int, bucket_bytes: int) -> None:
        metas = [_announced(entry, dtype) for entry in stream.metadata]
        if not metas:
            raise ValueError("no tensors to sync")
        self.layout: Sequence[ChunkInfo] = _plan_chunks(metas, chunk_bytes, bucket_bytes)
        self._items: Iterator[tuple[str, torch.Tensor]] | None = iter(stream.items)
        self._dtype = dtype

    def chunks(self) -> Iterator[tuple[ChunkInfo, Mapping[str, torch.Tensor]]]:
        items, self._items = self._items, None
        if items is None:
            raise RuntimeError("a streamed payload is sent once")
        for planned in self.layout:
            tensors: dict[str, torch.Tensor] = {}
            for meta in planned.tensors:
                tensors[meta.name] = _take(items, meta, self._dtype)
            metas = tuple(dataclasses.replace(m, checksum=tensor_checksum(tensors[m.name])) for m in planned.tensors)
            yield dataclasses.replace(planned, tensors=metas), tensors
        extra = next(items, None)
        if extra is not None:
            raise ValueError(
                f"the stream yielded {extra[0]!r} after the {sum(len(c.tensors) for c in self.layout)} tensors announced"
            )


def plan(
    weights: NamedTensors,
    dtype: torch.dtype | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Planned | Streamed:
    """The payload for `weights`: streamed from a `TensorStream`, planned whole otherwise."""
    if isinstance(weights, TensorStream):
        return Streamed(weights, dtype, chunk_bytes=chunk_bytes, bucket_bytes=bucket_bytes)
    tensors, chunks = plan_sync(weights, dtype, chunk_bytes=chunk_bytes, bucket_bytes=bucket_bytes)
    return Planned(chunks, tensors)


def check_sizes(bucket_bytes: int, chunk_bytes: int) -> None:
    """ValueError unless 0 < bucket_bytes <= chunk_bytes (a chunk holds whole buckets)."""
    if bucket_bytes <= 0 or chunk_bytes < bucket_bytes:
        raise ValueError("need 0 < bucket_bytes <= chunk_bytes")


def plan_sync(
    weights: NamedTensors,
    dtype: torch.dtype | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[dict[str, torch.Tensor], list[ChunkInfo]]:
    """The tensors to send (on the CPU, contiguous, floating ones cast to `dtype`: send in the
    dtype the server computes with) and the chunks they go in, each with its digests."""
    tensors = dict(_named_tensors(weights, dtype))
    if not tensors:
        raise ValueError("no tensors to sync")
    unsendable = {n: str(t.dtype) for n, t in tensors.items() if str(t.dtype).removeprefix("torch.") not in DTYPE_BYTES}
    if unsendable:
        raise ValueError(f"only {sorted(DTYPE_BYTES)} tensors can be sent: {dict(list(unsendable.items())[:3])}")
    metas = [
        TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), tensor_checksum(t))
        for n, t in tensors.items()
    ]
    return tensors, _plan_chunks(metas, chunk_bytes, bucket_bytes)


def plan_patch(
    tensors: Mapping[str, torch.Tensor],
    changed: Mapping[str, torch.Tensor],
    base_weight_version: str,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[dict[str, torch.Tensor], list[ChunkInfo]]:
    """What to send to turn the weights served as `base_weight_version` into `tensors`
    (from `plan_sync`): for a tensor in `changed` (its changed flat indices), a patch, or the
    whole tensor where that is no bigger; nothing for one whose indices are empty; the whole
    tensor for one not in `changed`. Each digest is of the whole new tensor."""
    payload: dict[str, torch.Tensor] = {}
    metas: list[TensorMeta] = []
    for name, tensor in tensors.items():
        indices = changed.get(name)
        if indices is not None and indices.numel() == 0:
            continue
        blob = patch.encode(tensor, indices) if indices is not None else None
        meta = TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor_checksum(tensor))
        if blob is not None:
            meta = dataclasses.replace(meta, num_changed=indices.numel())  # type: ignore[union-attr]  # a blob exists only with indices
        payload[name] = tensor if blob is None else blob
        metas.append(meta)
    return payload, _plan_chunks(metas, chunk_bytes, bucket_bytes, base_weight_version)


def _named_tensors(weights: NamedTensors, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(weights, TensorStream):
        raise ValueError("a TensorStream is sent as it streams (plan): it is not planned whole, nor patched")
    if isinstance(weights, torch.nn.Module):
        items: Iterable[tuple[str, torch.Tensor]] = weights.named_parameters()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    for name, tensor in items:
        yield name, _served(tensor, dtype)


def _served(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """On the CPU, contiguous, a floating tensor in `dtype` (the one the server computes in).
    Cast where the tensor lives, then moved: a GPU trainer's fp32 model crosses to the host in
    the served dtype (half the bytes) and the host does no casting."""
    t = tensor.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to("cpu").contiguous()


def masked_indices(masks: Mapping[str, torch.Tensor], sent: Iterable[str]) -> dict[str, torch.Tensor]:
    """The changed flat indices, on the CPU, of each tensor in `sent` from the trainer's masks
    (on any device; true where an element changed): none for a tensor without a mask.
    ValueError for a mask of a tensor that is not sent."""
    sent = list(sent)
    unknown = sorted(set(masks) - set(sent))
    if unknown:
        raise ValueError(f"masks for tensors that are not sent: {unknown[:5]}")
    masked = {n: torch.nonzero(m.detach().reshape(-1)).view(-1).to("cpu") for n, m in masks.items()}
    return {n: masked.get(n, torch.empty(0, dtype=torch.long)) for n in sent}


def _announced(entry: tuple[str, str, Sequence[int]], dtype: torch.dtype | None) -> TensorMeta:
    """The TensorMeta of an announced tensor as it will be sent (its digest still blank)."""
    name, dtype_name, shape = entry
    if not isinstance(name, str) or not name:
        raise ValueError(f"an announced tensor needs a name, got {name!r}")
    announced = getattr(torch, str(dtype_name).removeprefix("torch."), None)
    if not isinstance(announced, torch.dtype):
        raise ValueError(f"{name}: unknown dtype {dtype_name!r}")
    sent = dtype if dtype is not None and announced.is_floating_point else announced
    sent_name = str(sent).removeprefix("torch.")
    if sent_name not in DTYPE_BYTES:
        raise ValueError(f"{name}: only {sorted(DTYPE_BYTES)} tensors can be sent, got {dtype_name!r}")
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise ValueError(f"{name}: a shape is non-negative integers, got {list(shape)}")
    meta = TensorMeta(name, sent_name, tuple(shape), "")
    if meta.num_bytes > MAX_TENSOR_BYTES:
        # What the server takes, and what sizes the trainer's segment before a byte arrives.
        raise ValueError(f"{name}: {meta.num_bytes} bytes announced; a tensor is at most {MAX_TENSOR_BYTES}")
    return meta


def _take(items: Iterator[tuple[str, torch.Tensor]], meta: TensorMeta, dtype: torch.dtype | None) -> torch.Tensor:
    """The next tensor of a stream, as sent; ValueError unless it is the one announced."""
    entry = next(items, None)
    if entry is None:
        raise ValueError(f"the stream ended before {meta.name!r}, which was announced")
    name, tensor = entry
    if name != meta.name:
        raise ValueError(f"the stream yielded {name!r} where {meta.name!r} was announced")
    t = _served(tensor, dtype)
    if tuple(t.shape) != meta.shape or str(t.dtype).removeprefix("torch.") != meta.dtype_name:
        raise ValueError(
            f"{name}: announced as {meta.dtype_name} {list(meta.shape)}, yielded as "
            f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
        )
    return t


def _plan_chunks(
    metas: list[TensorMeta], chunk_bytes: int, bucket_bytes: int, base_weight_version: str | None = None
) -> list[ChunkInfo]:
    groups: list[list[TensorMeta]] = []
    size = 0
    for meta in metas:
        if not groups or size + meta.num_bytes > chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(meta)
        size += meta.num_bytes
    patches = any(meta.num_changed is not None for meta in metas)
    # rlserve_gloo sends each tensor from its own memory (shared memory ignores the field):
    # packing buckets first cost the trainer a copy of every byte. Raw, 272 messages are
    # slower on loopback than five (SmolLM2: 0.15 s against 0.095 s), yet the sync is faster
    # without the copy (docs/performance.md).
    return [
        ChunkInfo(
            tuple(g), bucket_bytes, base_weight_version=base_weight_version if patches else None, messages="tensor"
        )
        for g in groups
    ]
