"""rlserve_shm against a real engine started with it: a sync over shared memory serves what
a fresh engine loaded from the same weights serves, and no segment is ever left in /dev/shm
(not while syncing, not after a trainer is killed mid-sync); what a careless or hostile
trainer sends (a path for a name, a symlink, a chunk larger than the segment, bytes that do
not match their digests) is INVALID_ARGUMENT and changes nothing."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.config import ServeConfig
from rlserve.sdk.client import Client
from rlserve.sdk.plan import plan_sync
from rlserve.sdk.senders import ShmSender
from rlserve.sdk.weight_sync import WeightSync
from rlserve.wire.protocol import tensor_checksum
from rlserve.wire.shm import SHM_DIR

from helpers import (
    changed_a_little,
    checkpoint,
    checksum,
    expect,
    greedy,
    pause,
    perturbed,
    run_trainer,
    save_weights,
    serving,
    wait_for_state,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
KEEP = cpb.PAUSE_MODE_KEEP


@pytest_asyncio.fixture(scope="module")
async def shm_engine(engines):
    """The session's shm engine (test_trl's too)."""
    return await engines.get(weight_transfer_backend="rlserve_shm")


@pytest_asyncio.fixture(scope="module")
async def shm(shm_engine, engine_config):
    config = ServeConfig(
        engine=replace(engine_config, weight_transfer_backend="rlserve_shm"),
        transfer_timeout_s=10.0,
        update_lease_s=2.0,
    )
    async with serving(shm_engine, config) as stubs:
        yield stubs


@pytest_asyncio.fixture(autouse=True)
async def running_afterwards(shm):
    yield
    await shm.lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
    await shm.control.ResumeGeneration(cpb.ResumeGenerationRequest())


def segments() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob("rlserve-shm-*"))


def sync_in_thread(target: str, weights, version: str, **kw):
    with Client(target) as client:
        sync = WeightSync(client, transport="shm", **kw)
        try:
            stats = sync.sync(weights, version)
            return stats, segments()
        finally:
            sync.close()


async def test_a_sync_over_shared_memory_equals_a_fresh_engine(shm, tiny_model_dir, tmp_path, engine_config, reference):
    weights = perturbed(tiny_model_dir, seed=31)
    before = segments()
    stats, during = await asyncio.to_thread(sync_in_thread, shm.target, weights, "shm-1")
    assert stats.num_bytes > 0 and during == before  # the name is gone once the workers mapped it
    assert segments() == before
    state = await shm.lifecycle.GetState(lpb.GetStateRequest())
    assert state.weight_version == "shm-1" and state.weights_consistent
    assert await greedy(shm.inference) == await reference.outputs(weights, tmp_path)


async def test_the_gloo_transport_is_refused_by_name_against_a_shm_server(shm, tiny_model_dir):
    def gloo() -> None:
        with Client(shm.target) as client:
            WeightSync(client, transport="gloo").init()

    with pytest.raises(ValueError, match="rlserve_shm"):
        await asyncio.to_thread(gloo)


async def test_a_trainer_killed_mid_sync_leaves_no_segment_and_the_old_weights(shm, tiny_model_dir, tmp_path):
    tokens, digest = await greedy(shm.inference), await checksum(shm.lifecycle)
    weights = save_weights(perturbed(tiny_model_dir, seed=32), tmp_path / "w.safetensors")
    # Two chunks: the trainer dies once it has written the second, before the server reads it.
    rc, _, err = await run_trainer(
        shm.target, weights, "never", "--die-after-shm-writes", "2", "--chunk-bytes", str(2**20),
        "--bucket-bytes", str(2**20),
    )  # fmt: skip
    assert rc == 17, err
    assert segments() == []
    state = await wait_for_state(
        shm.lifecycle, lambda st: not st.HasField("update_session") and st.pause_phase == lpb.PAUSE_PHASE_RUNNING
    )
    assert state.weights_consistent and state.weight_version != "never"
    assert await checksum(shm.lifecycle) == digest and await greedy(shm.inference) == tokens


@pytest.mark.parametrize(
    "init, named",
    [
        ({"segment": "../../etc/passwd", "size": 10}, "segment"),
        ({"segment": "rlserve-shm-x/y", "size": 10}, "segment"),
        ({"segment": "rlserve-shm-absent", "size": 10}, "rlserve-shm-absent"),
        ({"segment": "rlserve-shm-x", "size": -1}, "size"),
        ({"segment": "rlserve-shm-x", "size": 10, "master_port": 1}, "master_port"),
    ],
)
async def test_init_info_that_names_no_segment_of_ours_is_refused(shm, init, named):
    request = cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(init).encode())
    assert named in await expect(INVALID, shm.control.InitWeightTransferEngine(request, timeout=30))


async def test_a_symlink_posing_as_a_segment_is_not_followed(shm, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 4096)
    link = SHM_DIR / f"rlserve-shm-link-{os.getpid()}"
    link.symlink_to(secret)
    try:
        request = cpb.InitWeightTransferEngineRequest(
            init_info_json=json.dumps({"segment": link.name, "size": 4096}).encode()
        )
        await expect(INVALID, shm.control.InitWeightTransferEngine(request, timeout=30))
    finally:
        link.unlink(missing_ok=True)
    assert secret.read_bytes() == b"x" * 4096


def _other_users_file(path: Path) -> None:
    path.write_bytes(b"y" * 4096)
    os.chown(path, 65534, 65534)  # nobody's (the suite runs as root, as CI does)


def _fifo(path: Path) -> None:
    os.mkfifo(path, 0o600)


NOT_SEGMENTS = {"another user's file": _other_users_file, "a directory": Path.mkdir, "a FIFO": _fifo}


@pytest.mark.parametrize("kind", list(NOT_SEGMENTS))
async def test_a_name_of_what_is_no_segment_of_ours_is_refused_at_once_and_left_alone(shm, kind):
    """A root server once deleted another user's rlserve-shm-* file it had refused, answered
    INTERNAL for a directory and blocked in open() on a FIFO past the deadline."""
    assert os.geteuid() == 0, "needs root to make a file of another user (CI runs as root)"
    path = SHM_DIR / f"rlserve-shm-not-ours-{os.getpid()}"
    NOT_SEGMENTS[kind](path)
    before = await shm.lifecycle.GetState(lpb.GetStateRequest())
    try:
        request = cpb.InitWeightTransferEngineRequest(
            init_info_json=json.dumps({"segment": path.name, "size": 4096}).encode()
        )
        started = asyncio.get_running_loop().time()
        assert path.name in await expect(INVALID, shm.control.InitWeightTransferEngine(request, timeout=30))
        # Refused before anything waits: well inside the 10 s transfer deadline.
        assert asyncio.get_running_loop().time() - started < 5
        assert path.exists() or path.is_fifo(), "refused, and still there"
        state = await shm.lifecycle.GetState(lpb.GetStateRequest())  # nothing changed
        assert state.transport_ready == before.transport_ready and not state.transport_initializing
    finally:
        if path.is_dir():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)


async def test_a_segment_the_trainer_shrinks_mid_sync_is_refused_and_the_engine_lives(shm, tiny_model_dir):
    """A worker that mapped the segment died of SIGBUS reading past its new end; it reads the
    segment with pread now, and a short read refuses the chunk."""
    tokens, digest = await greedy(shm.inference), await checksum(shm.lifecycle)
    tensors, chunks = plan_sync(perturbed(tiny_model_dir, seed=35), torch.float32)
    (chunk,) = chunks
    hand = HandShmTrainer(shm.target, 64 * 1024 * 1024)
    fd = os.open(SHM_DIR / hand.sender.segment.name, os.O_RDWR)  # kept past the name's removal
    try:
        await asyncio.to_thread(hand.init)
        await pause(shm.control, KEEP)
        await shm.control.StartWeightUpdate(cpb.StartWeightUpdateRequest())
        hand.sender.write(chunk, tensors)
        os.ftruncate(fd, 4096)  # the trainer's own mapping is not touched past this point
        request = cpb.UpdateWeightsRequest(update_info_json=json.dumps(chunk.to_json()).encode())
        assert "shrank" in await expect(INVALID, shm.control.UpdateWeights(request, timeout=30))
        await shm.lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
        await shm.control.ResumeGeneration(cpb.ResumeGenerationRequest())
        assert await checksum(shm.lifecycle) == digest and await greedy(shm.inference) == tokens
    finally:
        os.close(fd)
        hand.close()


class HandShmTrainer:
    """The trainer's half of rlserve_shm by hand, to send what the SDK never would."""

    def __init__(self, target: str, capacity: int) -> None:
        self.client = Client(target)
        self.sender = ShmSender(capacity, timeout_s=10.0)

    def init(self) -> None:
        request = cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(self.sender.init_info()).encode())
        try:
            self.client.control.InitWeightTransferEngine(request, timeout=30)
        finally:
            self.sender.unlink()

    def update(self, chunk, tensors, corrupt: bool = False) -> None:
        self.sender.write(chunk, tensors)
        if corrupt:
            self.sender.segment.bytes[0] ^= 0xFF
        request = cpb.UpdateWeightsRequest(update_info_json=json.dumps(chunk.to_json()).encode())
        self.client.control.UpdateWeights(request, timeout=30)

    def close(self) -> None:
        self.sender.close()
        self.client.close()


FAULTS = ["larger than the segment", "bytes that do not match their digests", "a tensor sent again"]


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_bad_chunk_is_refused_and_the_next_good_one_lands(shm, tiny_model_dir, fault):
    digest = await checksum(shm.lifecycle)
    tensors, chunks = plan_sync(perturbed(tiny_model_dir, seed=33), torch.float32)
    (chunk,) = chunks
    hand = HandShmTrainer(shm.target, 1024 * 1024 if fault == FAULTS[0] else 64 * 1024 * 1024)
    try:
        await asyncio.to_thread(hand.init)
        await pause(shm.control, KEEP)
        await shm.control.StartWeightUpdate(cpb.StartWeightUpdateRequest())
        if fault == FAULTS[0]:
            # The SDK never plans such a chunk; by hand, the trainer's own layout refuses it first.
            with pytest.raises(ValueError, match="does not fit"):
                await asyncio.to_thread(hand.update, chunk, tensors)
            request = cpb.UpdateWeightsRequest(update_info_json=json.dumps(chunk.to_json()).encode())
            assert "does not fit" in await expect(INVALID, shm.control.UpdateWeights(request, timeout=30))
        elif fault == FAULTS[1]:
            with pytest.raises(grpc.RpcError) as e:
                await asyncio.to_thread(hand.update, chunk, tensors, True)
            assert e.value.code() == INVALID and chunk.tensors[0].name in e.value.details()
        else:
            # A tensor of the update sent once more, over the same bytes: refused, not reloaded.
            first = replace(chunk, tensors=chunk.tensors[:1])
            await asyncio.to_thread(hand.update, first, tensors)
            with pytest.raises(grpc.RpcError) as e:
                await asyncio.to_thread(hand.update, first, tensors)
            assert e.value.code() == INVALID and "sent twice" in e.value.details()
        await shm.lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
        await shm.control.ResumeGeneration(cpb.ResumeGenerationRequest())
        assert await checksum(shm.lifecycle) == digest
    finally:
        hand.close()
    # The transport still works: the SDK syncs the checkpoint back (it re-inits as needed).
    back = checkpoint(tiny_model_dir)
    await asyncio.to_thread(sync_in_thread, shm.target, back, "back")
    digests = (await shm.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())).per_tensor
    assert {n: digests[n] for n in back} == {n: tensor_checksum(t) for n, t in back.items()}
    assert segments() == []


async def test_an_update_in_several_chunks_through_one_chunk_of_memory_lands_whole(shm, tiny_model_dir, tmp_path):
    """Every chunk is written over the same bytes of a segment sized for one chunk: each is
    loaded into the update's shadows before UpdateWeights answers."""
    weights = perturbed(tiny_model_dir, seed=34)
    stats, _ = await asyncio.to_thread(
        sync_in_thread, shm.target, weights, "chunked", bucket_bytes=2**20, chunk_bytes=2**20
    )
    assert stats.num_chunks > 2
    _, mine = plan_sync(weights, torch.float32)
    digests = (await shm.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())).per_tensor
    assert {t.name: t.checksum for c in mine for t in c.tensors} == {n: digests[n] for n in weights}


def test_segment_files_of_this_process_are_only_names_of_ours():
    """A segment is a file only this user can open, named per process and session."""
    a, b = ShmSender(4096), ShmSender(4096)
    try:
        assert a.segment.name != b.segment.name and str(os.getpid()) in a.segment.name
        assert (Path(SHM_DIR) / a.segment.name).stat().st_mode & 0o777 == 0o600
    finally:
        a.close()
        b.close()
    assert not (Path(SHM_DIR) / a.segment.name).exists()


def test_a_segment_larger_than_shared_memory_is_refused_when_created():
    """Reserved at creation: a full /dev/shm is an OSError there, not a SIGBUS at the first
    write (ftruncate alone made a sparse file of any size)."""
    before = segments()
    with pytest.raises(OSError):
        ShmSender(1 << 45)
    assert segments() == before


def patch_syncs_in_thread(target: str, steps: list[tuple[dict, str]]) -> list:
    with Client(target) as client:
        sync = WeightSync(client, transport="shm")
        try:
            return [sync.sync(weights, version, patch=True) for weights, version in steps]
        finally:
            sync.close()


async def test_a_patch_sync_over_shared_memory_serves_the_patched_weights(
    shm, tiny_model_dir, tmp_path, engine_config, reference
):
    first = perturbed(tiny_model_dir, seed=35)
    second = changed_a_little(first, 0.01, seed=36)
    dense, patched = await asyncio.to_thread(patch_syncs_in_thread, shm.target, [(first, "sp0"), (second, "sp1")])
    assert patched.num_bytes < dense.num_bytes * 0.05
    digests = (await shm.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())).per_tensor
    assert {n: digests[n] for n in second} == {n: tensor_checksum(t) for n, t in second.items()}
    assert await greedy(shm.inference) == await reference.outputs(second, tmp_path)


def masked_sync_in_thread(target: str, first: dict, second: dict, masks: dict) -> tuple:
    with Client(target) as client:
        sync = WeightSync(client, transport="shm")
        try:
            return sync.sync(first, "mask-0"), sync.sync(second, "mask-1", patch=masks)
        finally:
            sync.close()


async def test_a_masked_patch_sends_only_the_masked_elements(shm, tiny_model_dir):
    """patch={name: mask}: only those tensors travel, as patches of their masked elements;
    every other tensor keeps what the server served."""
    first = perturbed(tiny_model_dir, seed=37)
    names = sorted(first)[:3]
    masks = {n: torch.zeros(first[n].shape, dtype=torch.bool) for n in names}
    second = dict(first)
    for n in names:
        masks[n].view(-1)[:5] = True
        second[n] = first[n].clone()
        second[n].view(-1)[:5] += 1.0
    whole, masked = await asyncio.to_thread(masked_sync_in_thread, shm.target, first, second, masks)
    assert masked.num_tensors == 3 and masked.num_bytes < 3 * 5 * 8 + 1 < whole.num_bytes
    digests = (await shm.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())).per_tensor
    assert {n: digests[n] for n in second} == {n: tensor_checksum(t) for n, t in second.items()}


async def test_a_fleet_on_the_trainers_host_syncs_over_shared_memory(shm, engines, engine_config, tiny_model_dir):
    """The fleet drives rlserve_shm as it drives rlserve_gloo (one segment per server, each
    server removes the name of its own): both servers serve what was sent, under one
    version, resumed, and nothing is left in /dev/shm."""
    from rlserve.fleet import Fleet

    other_config = replace(engine_config, weight_transfer_backend="rlserve_shm")
    async with engines.own(weight_transfer_backend="rlserve_shm") as other_engine:
        config = ServeConfig(engine=other_config, transfer_timeout_s=10.0)
        async with serving(other_engine, config) as other:
            weights = perturbed(tiny_model_dir, seed=35)
            before = segments()

            def sync_the_fleet():
                with Fleet([shm.target, other.target], timeout_s=10.0) as fleet:
                    return fleet.sync(weights, "fleet-shm"), segments()

            stats, during = await asyncio.to_thread(sync_the_fleet)
            assert stats.servers == (shm.target, other.target) and during == before == segments()
            sent = {n: tensor_checksum(t) for n, t in weights.items()}
            for s in (shm, other):
                state = await s.lifecycle.GetState(lpb.GetStateRequest())
                assert state.weight_version == "fleet-shm" and state.weights_consistent
                assert state.pause_phase == lpb.PAUSE_PHASE_RUNNING
                served = await s.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())
                assert dict(served.per_tensor) == sent
