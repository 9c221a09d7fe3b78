"""Staged weight updates (rlserve.v1 StageWeightUpdate) against a real engine and server: the
update is received, checked and prepared beside the served weights while generation runs on
the old ones, and generation pauses only for the commit. The states are read from WatchState
throughout, so "never paused" is what the server published, not what the test assumed."""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
import pytest
import pytest_asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.sdk.client import Client, generate_request
from rlserve.sdk.plan import TensorStream
from rlserve.sdk.weight_sync import WeightSync, WeightSyncError
from rlserve.wire.protocol import tensor_checksum

from helpers import (
    PROMPT,
    HandTrainer,
    checkpoint,
    chunk_of,
    eventually,
    expect,
    gloo_server,
    greedy,
    never_paused,
    pause,
    perturbed,
    watched,
)

TIMEOUT_S = 20.0
LEASE_S = 4.0
RUNNING = lpb.PAUSE_PHASE_RUNNING
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
ABORTED = grpc.StatusCode.ABORTED


@pytest_asyncio.fixture(scope="module")
async def s(wt_engine, engine_config, tiny_model_dir):
    async with gloo_server(wt_engine, engine_config, transfer_timeout_s=TIMEOUT_S, update_lease_s=LEASE_S) as stubs:
        # The shared engine may serve what an earlier module synced: the checkpoint first.
        await asyncio.to_thread(_sync, stubs.target, checkpoint(tiny_model_dir), "checkpoint", staged=False)
        yield stubs


def _sync(target: str, weights: dict, version: str, **kw):
    with Client(target) as client:
        return WeightSync(client, timeout_s=TIMEOUT_S).sync(weights, version, **kw)


async def state(s) -> lpb.LifecycleState:
    return await s.lifecycle.GetState(lpb.GetStateRequest())


async def served(s) -> dict[str, str]:
    return dict((await s.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())).per_tensor)


async def staged_session(s, weights: dict, *, prepare: bool = True) -> HandTrainer:
    """A hand trainer's rendezvous, a staged session, every tensor in one chunk and (by
    default) the prepare: generation ran throughout."""
    trainer = HandTrainer(s.target, timeout_s=TIMEOUT_S)
    await trainer.init()
    await s.lifecycle.StageWeightUpdate(lpb.StageWeightUpdateRequest())
    pairs = sorted(weights.items())
    await trainer.send(chunk_of(pairs), [t for _, t in pairs])
    if prepare:
        await s.lifecycle.PrepareWeightUpdate(lpb.PrepareWeightUpdateRequest())
    return trainer


def digests_of(weights: dict) -> dict[str, str]:
    return {n: tensor_checksum(t) for n, t in weights.items()}


async def test_the_server_offers_staged_updates(s):
    st = await state(s)
    assert st.staged_weight_updates and st.stages_updates


@pytest.mark.parametrize("staged", [True, False])
async def test_a_sync_equals_a_fresh_engine_and_pauses_as_asked(s, tiny_model_dir, tmp_path, reference, staged):
    """Staged: every state with the session still receiving or preparing is RUNNING, and the
    pause starts only once the update is prepared. Not staged: paused from before the session
    opened to after it ended. Both serve what a fresh engine on the same weights serves."""
    weights = perturbed(tiny_model_dir, seed=101 if staged else 102)
    version = f"staged-{staged}"
    async with watched(s.lifecycle) as states:
        stats = await asyncio.to_thread(_sync, s.target, weights, version, staged=staged)
    assert stats.staged is staged and stats.weight_version == version
    assert (stats.stage_s > 0) is staged and stats.pause_to_resume_s > 0
    assert 0 < stats.pause_s < stats.pause_to_resume_s  # the pause took effect, then the commit
    in_session = [st for st in states if st.HasField("update_session")]
    assert in_session and all(st.update_session.staged is staged for st in in_session)
    receiving = [st for st in in_session if not st.update_session.prepared]
    if staged:
        never_paused(receiving)
        paused = [st for st in states if st.pause_phase != RUNNING]
        assert paused, "the commit is made under a pause"
        assert all(
            st.update_session.prepared if st.HasField("update_session") else st.weight_version == version
            for st in paused
        )
    else:
        assert all(st.pause_phase == lpb.PAUSE_PHASE_PAUSED for st in in_session)
    assert (await state(s)).pause_phase == RUNNING
    assert await served(s) == digests_of(weights)
    assert await greedy(s.inference) == await reference.outputs(weights, tmp_path)


async def test_while_it_stages_generation_uses_the_old_weights_and_names_the_old_version(s, tiny_model_dir):
    weights = perturbed(tiny_model_dir, seed=103)
    before, old_version = await greedy(s.inference), (await state(s)).weight_version
    trainer = await staged_session(s, weights)
    try:
        st = await state(s)
        assert st.pause_phase == RUNNING and st.update_session.staged and st.update_session.prepared
        assert st.update_session.shadow_bytes > 0, "the shadows hold the update beside the served weights"
        assert await greedy(s.inference) == before
        call = s.inference.GenerateStream(generate_request(PROMPT, max_new_tokens=8, temperature=0.0, ignore_eos=True))
        final = [r async for r in call][-1].outputs
        assert [span.weight_version for span in final.weight_version_spans] == [old_version]
        await pause(s.control, cpb.PAUSE_MODE_KEEP)
        await s.control.FinishWeightUpdate(cpb.FinishWeightUpdateRequest(weight_version="staged-103"))
        await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
    finally:
        trainer.close()
    assert (await state(s)).weight_version == "staged-103"
    assert await served(s) == digests_of(weights)
    assert await greedy(s.inference) != before


@pytest.mark.parametrize("phase", ["opened", "received", "prepared"])
async def test_an_abort_at_any_phase_leaves_the_old_weights_serving_never_paused(s, tiny_model_dir, phase):
    before, digests, version = await greedy(s.inference), await served(s), (await state(s)).weight_version
    async with watched(s.lifecycle) as states:
        trainer = HandTrainer(s.target, timeout_s=TIMEOUT_S)
        try:
            await trainer.init()
            await s.lifecycle.StageWeightUpdate(lpb.StageWeightUpdateRequest())
            if phase != "opened":
                pairs = sorted(perturbed(tiny_model_dir, seed=104).items())
                await trainer.send(chunk_of(pairs), [t for _, t in pairs])
            if phase == "prepared":
                await s.lifecycle.PrepareWeightUpdate(lpb.PrepareWeightUpdateRequest())
            assert await greedy(s.inference) == before
            await s.lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
        finally:
            trainer.close()
    never_paused(states)
    st = await state(s)
    assert not st.HasField("update_session") and st.weights_consistent and st.weight_version == version
    assert await served(s) == digests
    assert await greedy(s.inference) == before


async def test_the_commit_is_refused_unless_paused_and_nothing_changes(s, tiny_model_dir):
    before, digests = await greedy(s.inference), await served(s)
    trainer = await staged_session(s, perturbed(tiny_model_dir, seed=105))
    try:
        message = await expect(
            FAILED_PRECONDITION, s.control.FinishWeightUpdate(cpb.FinishWeightUpdateRequest(weight_version="never"))
        )
        assert "pause generation before FinishWeightUpdate" in message
        st = await state(s)
        assert st.update_session.prepared and st.weight_version != "never" and st.pause_phase == RUNNING
        assert await served(s) == digests and await greedy(s.inference) == before
    finally:
        await s.lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
        trainer.close()


async def test_what_is_refused_and_allowed_while_a_session_stages(s, tiny_model_dir):
    """The table in docs/control-plane.md: a second session (either kind) and a new
    rendezvous are ABORTED; a pause and a resume leave the session open for its commit."""
    trainer = await staged_session(s, perturbed(tiny_model_dir, seed=106), prepare=False)
    try:
        await expect(ABORTED, s.lifecycle.StageWeightUpdate(lpb.StageWeightUpdateRequest()))
        await pause(s.control, cpb.PAUSE_MODE_KEEP)
        await expect(ABORTED, s.control.StartWeightUpdate(cpb.StartWeightUpdateRequest()))
        await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
        info = json.dumps(trainer.init_info(port=1)).encode()  # well-formed: refused for the session
        request = cpb.InitWeightTransferEngineRequest(init_info_json=info)
        await expect(ABORTED, s.control.InitWeightTransferEngine(request))
        st = await state(s)
        assert st.pause_phase == RUNNING and st.update_session.staged and st.update_session.num_chunks == 1
        await s.lifecycle.PrepareWeightUpdate(lpb.PrepareWeightUpdateRequest())
        await pause(s.control, cpb.PAUSE_MODE_ABORT)
        await s.control.FinishWeightUpdate(cpb.FinishWeightUpdateRequest(weight_version="staged-106"))
        await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
        assert (await state(s)).weight_version == "staged-106"
    finally:
        trainer.close()


TRAINER = """
import sys, time
from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb, lifecycle_pb2_grpc
from rlserve.sdk.client import Client
from rlserve.sdk.weight_sync import WeightSync

target, paused = sys.argv[1], sys.argv[2] == "paused"
client = Client(target)
WeightSync(client, timeout_s=20).init()
lifecycle_pb2_grpc.LifecycleStub(client.channel).StageWeightUpdate(lpb.StageWeightUpdateRequest())
if paused:
    from rlserve.api.vllm import control_pb2 as cpb
    client.control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
print("staged", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("when", ["staging", "paused for the commit"])
async def test_a_trainer_killed_mid_stage_has_its_session_dropped_by_the_lease(s, when):
    """Staging: the session goes and generation was never paused. Paused for the commit
    (a pause re-arms the session's lease): the session goes and generation resumes."""
    digests = await served(s)
    async with watched(s.lifecycle) as states:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", TRAINER, s.target, "paused" if when != "staging" else "running",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            async with asyncio.timeout(60):
                assert (await proc.stdout.readline()).strip() == b"staged"
            assert (await state(s)).update_session.staged
        finally:
            proc.kill()
            await proc.wait()

        async def dropped() -> bool:
            st = await state(s)
            return not st.HasField("update_session") and st.pause_phase == RUNNING

        await eventually(dropped, timeout_s=LEASE_S + 10)
    if when == "staging":
        never_paused(states)
    st = await state(s)
    assert any(m.operation == "session_lease_expired" for m in st.recent_mutations)
    assert await served(s) == digests


async def test_a_staged_sync_the_server_refuses_keeps_the_old_weights_never_paused(s, tiny_model_dir):
    weights = perturbed(tiny_model_dir, seed=107)
    name = next(iter(sorted(weights)))
    digests = await served(s)
    weights[name] = weights[name][:1]  # a shape the model does not have
    async with watched(s.lifecycle) as states:
        with pytest.raises(WeightSyncError) as e:
            await asyncio.to_thread(_sync, s.target, weights, "never")
    assert e.value.resumed_on_old_weights
    never_paused(states)
    assert await served(s) == digests


def _stream(weights: dict, *, broken: str | None = None) -> tuple[TensorStream, list[str]]:
    """`weights` announced, then yielded one at a time (as TRL does), the names taken so far
    listed; `broken`: that tensor is yielded with a shape other than announced."""
    taken: list[str] = []

    def items():
        for n, t in weights.items():
            taken.append(n)
            yield n, (t[:1] if n == broken else t)

    return TensorStream([(n, "float32", list(t.shape)) for n, t in weights.items()], items()), taken


@pytest.mark.parametrize("staged", [True, False])
async def test_a_streamed_sync_serves_what_streamed_and_a_stream_that_breaks_changes_nothing(s, tiny_model_dir, staged):
    """Chunk by chunk from a TensorStream (several chunks): what is served is what streamed.
    A stream whose last tensor is not the one announced aborts the sync after earlier chunks
    went: the old weights serve, resumed (never paused, staged)."""
    weights = perturbed(tiny_model_dir, seed=121 if staged else 122)
    chunk_bytes = max(t.numel() * 4 for t in weights.values())
    stream, taken = _stream(weights)

    def sync(stream, version):
        with Client(s.target) as client:
            ws = WeightSync(client, timeout_s=TIMEOUT_S, chunk_bytes=chunk_bytes, bucket_bytes=chunk_bytes // 2)
            try:
                return ws.sync(stream, version, staged=staged)
            finally:
                ws.close()

    stats = await asyncio.to_thread(sync, stream, f"streamed-{staged}")
    assert stats.num_chunks > 1 and stats.num_tensors == len(weights) == len(taken)
    assert await served(s) == digests_of(weights)

    again = perturbed(tiny_model_dir, seed=123)
    broken, taken = _stream(again, broken=list(again)[-1])
    async with watched(s.lifecycle) as states:
        with pytest.raises(WeightSyncError, match="announced") as e:
            await asyncio.to_thread(sync, broken, "never")
    assert e.value.resumed_on_old_weights and len(taken) == len(again)
    if staged:
        never_paused(states)
    st = await state(s)
    assert st.pause_phase == RUNNING and st.weight_version == f"streamed-{staged}"
    assert not st.HasField("update_session")
    assert await served(s) == digests_of(weights)
