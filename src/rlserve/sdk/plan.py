"""What a trainer sends for one update: its tensors in the served dtype, the patches of those
that changed, and the chunks they travel in with their digests. Pure planning (torch and
the wire protocol); `rlserve.sdk.weight_sync` sends it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping

import torch

from rlserve.wire import patch
from rlserve.wire.protocol import DEFAULT_BUCKET_BYTES, DTYPE_BYTES, ChunkInfo, TensorMeta, tensor_checksum

DEFAULT_CHUNK_BYTES = 1024 * 1024 * 1024

NamedTensors = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


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
    if isinstance(weights, torch.nn.Module):
        items: Iterable[tuple[str, torch.Tensor]] = weights.named_parameters()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    for name, tensor in items:
        t = tensor.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        yield name, t.contiguous()


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
    return [
        ChunkInfo(tuple(g), bucket_bytes, base_weight_version=base_weight_version if patches else None) for g in groups
    ]
