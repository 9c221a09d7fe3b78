"""Sparse patches of a tensor: which elements changed, and their new values.

On the wire a patched tensor is one blob, `num_changed` int32 flat indices (row-major, into
the checkpoint tensor) followed by as many values in the tensor's dtype. Its digest in
update_info is the digest of the whole tensor once patched, so the worker checks what it
will serve, not what was sent: a patch applied to another base than the trainer's fails
that check. Shared by the trainer SDK (encode) and the worker (apply).
"""

from __future__ import annotations

import torch

from rlserve.wire.protocol import MAX_PATCHED_ELEMENTS
from rlserve.wire.protocol import PATCH_INDEX_BYTES as INDEX_BYTES


def changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The flat indices where `new` differs from `old` (a NaN counts as changed)."""
    return torch.nonzero((new != old).view(-1)).view(-1)


def encode(new: torch.Tensor, indices: torch.Tensor) -> torch.Tensor | None:
    """`new`'s values at flat `indices` as a patch blob, or None when sending the whole tensor
    is no bigger (or the tensor is too large to index)."""
    flat = new.contiguous().view(-1)
    if flat.numel() > MAX_PATCHED_ELEMENTS or indices.numel() * (INDEX_BYTES + new.element_size()) >= new.nbytes:
        return None
    index_bytes = indices.to(torch.int32).view(torch.uint8)
    value_bytes = flat[indices.to(torch.long)].contiguous().view(torch.uint8)
    return torch.cat([index_bytes, value_bytes])


def apply(base: torch.Tensor, blob: torch.Tensor, num_changed: int) -> torch.Tensor:
    """A copy of `base` with the patch in `blob` applied; ValueError for an index outside it."""
    if blob.storage_offset() % INDEX_BYTES:
        blob = blob.clone()  # the views below need its start aligned to an index
    split = num_changed * INDEX_BYTES
    indices = blob[:split].view(torch.int32).to(torch.long)
    values = blob[split:].view(base.dtype)
    if num_changed and (int(indices.min()) < 0 or int(indices.max()) >= base.numel()):
        raise ValueError(f"patch indices must lie in 0..{base.numel() - 1}")
    patched = base.detach().clone().contiguous()
    patched.view(-1)[indices] = values
    return patched
