"""Sparse patches without an engine: the wire format both sides share (`transfer.patch`,
`ChunkInfo`'s num_changed and base_weight_version) and where patches land in a receiver's
memory. The engine's side (applied to what is served, refused on another base) is tested in
test_served_weights and test_shm_transfer."""

from __future__ import annotations

import pytest
import torch

from rlserve.wire import patch
from rlserve.wire.protocol import ChunkInfo, ProtocolError, TensorMeta, landing_offsets, plan_buckets


def test_a_patch_applies_from_any_place_a_bucket_lands():
    """A bfloat16 patch blob is 6 bytes an element: the bucket after it used to start 2 bytes
    off a 4-byte boundary, and viewing its indices failed in the worker (found by the
    benchmark on SmolLM2-135M)."""
    old = torch.randn(64, 32).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[torch.tensor([0, 5, 2047])] += 1
    indices = patch.changed(new, old)
    blob = patch.encode(new, indices)
    assert blob is not None and blob.numel() == 3 * 6
    landing = torch.zeros(blob.numel() + 2, dtype=torch.uint8)
    landing[2:].copy_(blob)
    assert torch.equal(patch.apply(old, landing[2:], indices.numel()), new)


def test_every_bucket_lands_on_a_64_byte_boundary():
    metas = [TensorMeta(f"t{i}", "bfloat16", (1000,), "", num_changed=3) for i in range(5)]
    buckets = plan_buckets(metas, 20)  # one 18-byte blob per bucket
    starts, span = landing_offsets(buckets)
    assert len(buckets) == 5 and all(start % 64 == 0 for start in starts)
    assert span == starts[-1] + 18


def test_a_patch_is_only_sent_when_smaller_and_nans_count_as_changed():
    t = torch.ones(8)
    assert patch.encode(t, torch.arange(8)) is None  # 8 x 8 bytes is more than 32
    nan = torch.tensor([float("nan"), 1.0])
    assert patch.changed(nan, nan.clone()).tolist() == [0]


def test_an_index_outside_the_tensor_is_refused():
    base = torch.zeros(4)
    blob = torch.cat([torch.tensor([4], dtype=torch.int32).view(torch.uint8), torch.ones(1).view(torch.uint8)])
    with pytest.raises(ValueError, match="indices"):
        patch.apply(base, blob, 1)


def chunk_json(**override) -> dict:
    raw = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[4, 4]], "checksums": ["x"]}
    return {**raw, **override}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"num_changed": [3]}, "base_weight_version"),
        ({"num_changed": [17], "base_weight_version": "v1"}, "1..16"),
        ({"num_changed": [0], "base_weight_version": "v1"}, "1..16"),
        ({"num_changed": [True], "base_weight_version": "v1"}, "1..16"),
        ({"num_changed": [1, 2], "base_weight_version": "v1"}, "as long as names"),
        ({"base_weight_version": ""}, "non-empty"),
    ],
)
def test_malformed_patch_fields_are_refused(override, message):
    with pytest.raises(ProtocolError, match=message):
        ChunkInfo.parse(chunk_json(**override))


def test_a_patch_chunk_round_trips():
    info = ChunkInfo.parse(chunk_json(num_changed=[3], base_weight_version="v1"))
    assert info.tensors[0].num_bytes == 3 * 8 and info.base_weight_version == "v1"
    assert ChunkInfo.parse(info.to_json()) == info
