"""The digests a worker checks each received tensor against, without an engine: the
receiver's quick path (the bytes as they are, then the full rule only when they differ)
answers what the full rule answers, for bytes with -0.0 in them and for bytes that changed;
the shm link digests what it copied while copying it."""

from __future__ import annotations

import pytest
import torch
import xxhash

from rlserve.sdk.plan import plan_sync
from rlserve.sdk.senders import ShmSender
from rlserve.wire import shm
from rlserve.wire.protocol import tensor_checksum
from rlserve.wire.shm import ShmInit
from rlserve.worker import shm_link
from rlserve.worker.shm_link import ShmLink

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _with_negative_zeros(dtype: torch.dtype) -> torch.Tensor:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    t[::7] = -0.0
    return t


@pytest.mark.parametrize("dtype", FLOATS)
def test_negative_zeros_count_as_positive_ones(dtype):
    t = _with_negative_zeros(dtype)
    assert tensor_checksum(t) == tensor_checksum(t + 0.0)
    assert tensor_checksum(t) != tensor_checksum(torch.zeros_like(t))


@pytest.mark.parametrize("dtype", FLOATS)
def test_a_tensor_without_negative_zeros_is_hashed_as_it_is_and_one_is_found_anywhere(dtype):
    """The most negative values there are beside -0.0 (the sign bit and the lowest bit: the
    smallest negative subnormal; all bits: a NaN) are not taken for one."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.finfo(dtype).bits // 8]
    t = torch.randn(1000, generator=torch.Generator().manual_seed(2)).to(dtype)
    t.view(bits)[10] = torch.iinfo(bits).min + 1
    t.view(bits)[11] = -1
    assert tensor_checksum(t) == _raw(t)
    t[-1] = -0.0
    assert tensor_checksum(t) == _raw(t + 0.0) != _raw(t)


def _raw(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(t.view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("dtype", FLOATS)
def test_a_receiver_gets_the_senders_digest_for_the_senders_bytes_and_no_other(dtype):
    sent = _with_negative_zeros(dtype)
    expect = tensor_checksum(sent)
    # The bytes as sent, -0.0s and all: their raw hash is not the digest, the full rule's is.
    assert tensor_checksum(sent.clone(), expect=expect) == expect
    # Bytes without -0.0 hash to the digest as they are.
    plain = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert tensor_checksum(plain, expect=tensor_checksum(plain)) == tensor_checksum(plain)
    # One bit changed on the way, in a value and in a zero's sign bit turned into a value.
    for index in (3, 7):
        changed = sent.clone()
        changed.view(torch.uint8)[index * sent.element_size()] ^= 1
        assert tensor_checksum(changed, expect=expect) != expect
    # A raw digest the caller computed is taken as the bytes' hash: a wrong one is no match.
    assert tensor_checksum(plain, expect=tensor_checksum(plain), raw="0" * 32) == tensor_checksum(plain)
    assert tensor_checksum(plain, expect="0" * 32) != "0" * 32


def test_integers_digest_as_they_are():
    t = torch.arange(-50, 50, dtype=torch.int32)
    assert tensor_checksum(t) == tensor_checksum(t, expect="0" * 32) == tensor_checksum(t, expect=tensor_checksum(t))


def test_the_shm_link_digests_what_it_copied_block_by_block(monkeypatch):
    """Tensors larger than a read block, -0.0s in them, and bytes that differ from what the
    trainer digested: each digest is the full rule's over the worker's copy."""
    monkeypatch.setattr(shm_link, "READ_BLOCK_BYTES", 4096)
    weights = {
        "a": _with_negative_zeros(torch.bfloat16).repeat(20),  # 40 KB: ten blocks
        "b": torch.randn(3000, generator=torch.Generator().manual_seed(2)),
        "c": torch.arange(10, dtype=torch.float16),
    }
    tensors, chunks = plan_sync(weights, chunk_bytes=1 << 20, bucket_bytes=8192)
    (chunk,) = chunks
    sender = ShmSender(shm.span(chunk))
    try:
        sender.write(chunk, tensors)
        # The trainer's segment changes after it digested it: the worker digests its copy.
        offset = dict((chunk.tensors[i].name, at) for i, at in shm.layout(chunk, sender.capacity)[1])["b"]
        sender.segment.bytes[offset + 5] ^= 0x40
        link = ShmLink.open(ShmInit.parse(sender.init_info(), 10.0))
        # The hash taken while reading is the copy's bytes' hash (else every tensor would
        # silently fall back to the full rule): checked on every call the link makes.
        streamed: list[bool] = []

        def checked(tensor, expect=None, raw=None):
            streamed.append(raw == xxhash.xxh3_128_hexdigest(tensor.contiguous().view(torch.uint8).numpy()))
            return tensor_checksum(tensor, expect=expect, raw=raw)

        monkeypatch.setattr(shm_link, "tensor_checksum", checked)
        sender.initialized()
        got: dict[str, str] = {}
        copies: dict[str, torch.Tensor] = {}

        def deliver(received, digests):
            copies.update({n: t.clone() for n, t in received.items()})
            got.update(digests)

        assert link.exchange(chunk, True, 10.0, deliver)
        link.close()
    finally:
        sender.close()
    assert streamed == [True] * 3
    sent = {m.name: m.checksum for m in chunk.tensors}
    assert got["a"] == sent["a"] and got["c"] == sent["c"]
    assert got["b"] != sent["b"] and got["b"] == tensor_checksum(copies["b"])
    assert torch.equal(copies["a"], tensors["a"]) and not torch.equal(copies["b"], tensors["b"])
