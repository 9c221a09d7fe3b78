"""Weight transfer end to end on CPU: a real vLLM engine with the rlserve_gloo backend, a real
gloo group, and the trainer SDK in another process (or, where a test plays a misbehaving
trainer by hand, a gloo member in a thread of this process)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.sdk.client import generate_request
from rlserve.sdk.launch import free_port
from rlserve.wire.protocol import combined_checksum, tensor_checksum

from helpers import (
    PROMPT,
    HandTrainer,
    checkpoint,
    checksum,
    chunk_of,
    engine_greedy,
    expect,
    gloo_server,
    greedy,
    perturbed,
    run_trainer,
    save_weights,
)

INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


@pytest_asyncio.fixture(scope="module")
async def wt(wt_engine, engine_config):
    async with gloo_server(wt_engine, engine_config, transfer_timeout_s=10.0) as stubs:
        yield stubs


@pytest.fixture(scope="module")
def target(wt) -> str:
    return wt.target


@pytest.fixture(scope="module")
def stubs(wt):
    return wt.control, wt.inference, wt.lifecycle


@pytest_asyncio.fixture(autouse=True)
async def running_afterwards(stubs):
    """Every test leaves no session open and generation running."""
    yield
    control, _, lifecycle = stubs
    await lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
    state = await lifecycle.GetState(lpb.GetStateRequest())
    if state.weights_consistent:
        await control.ResumeGeneration(cpb.ResumeGenerationRequest())


async def test_the_reference_engine_answers_as_a_fresh_engine_on_the_checkpoint(
    engine, engines, reference, tiny_model_dir, tmp_path
):
    """The ground truth of every "equals a fresh engine" is itself checked against one: the
    reference (the session's plain engine, which rlserve never updates) reloaded with other
    weights gives the tokens of an engine started on them, serves the checkpoint's again
    afterwards, and reloaded with the checkpoint gives them too."""
    weights = perturbed(tiny_model_dir, seed=77)
    ckpt = tmp_path / "fresh"
    shutil.copytree(tiny_model_dir, ckpt)
    save_weights(weights, ckpt / "model.safetensors")
    async with engines.own(model=str(ckpt)) as fresh:
        truth = await engine_greedy(fresh.llm)
    original = await engine_greedy(engine.llm)
    assert truth != original
    assert await reference.outputs(weights, tmp_path) == truth
    assert await engine_greedy(engine.llm) == original
    assert await reference.outputs(checkpoint(tiny_model_dir), tmp_path) == original


async def test_sync_equals_a_fresh_engine_on_the_same_weights(
    target, stubs, tiny_model_dir, tmp_path, engine_config, reference
):
    control, inference, lifecycle = stubs
    before = await greedy(inference)
    weights = perturbed(tiny_model_dir, seed=1)
    rc, stats, err = await run_trainer(target, save_weights(weights, tmp_path / "w.safetensors"), "step-1")
    assert rc == 0, err
    assert stats["weight_version"] == "step-1" and stats["num_tensors"] == len(weights)
    assert stats["num_bytes"] == sum(t.numel() * t.element_size() for t in weights.values())
    after = await greedy(inference)
    assert after != before
    assert after == await reference.outputs(weights, tmp_path)
    served = await lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())
    assert dict(served.per_tensor) == {n: tensor_checksum(t) for n, t in weights.items()}
    assert served.overall == combined_checksum({n: tensor_checksum(t) for n, t in weights.items()}) == stats["checksum"]
    assert (await control.GetWeightVersion(cpb.GetWeightVersionRequest())).weight_version == "step-1"


async def test_kept_requests_continue_across_a_sync_with_two_spans(target, stubs, tiny_model_dir, tmp_path):
    control, inference, _ = stubs
    old = (await control.GetWeightVersion(cpb.GetWeightVersionRequest())).weight_version
    calls = [
        inference.GenerateStream(generate_request(f"Story {i}:", max_new_tokens=200, ignore_eos=True)) for i in range(4)
    ]
    firsts = await asyncio.gather(*(c.read() for c in calls))
    # Freeze them now: the trainer process takes seconds to start. Its own KEEP pause is
    # then a no-op; it leaves this pause in place, and resuming it lets them continue on
    # the new weights.
    await control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
    weights = save_weights(perturbed(tiny_model_dir, seed=2), tmp_path / "w.safetensors")
    rc, stats, err = await run_trainer(target, weights, "step-2", "--pause-mode", "keep")
    assert rc == 0, err
    assert stats["resumed"] is False
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    for call, first in zip(calls, firsts):
        chunks = [first]
        while (r := await call.read()) != grpc.aio.EOF:
            chunks.append(r)
        final = chunks[-1].outputs
        assert final.finish_info.num_output_tokens == sum(c.outputs.num_tokens for c in chunks) == 200
        spans = [(s.weight_version, s.start, s.end) for s in final.weight_version_spans]
        assert [s[0] for s in spans] == [old, "step-2"]
        assert spans[0][1] == 0 and spans[0][2] == spans[1][1] and spans[1][2] == 200
        assert 0 < spans[0][2] < 200


async def test_no_stale_prefix_cache_after_an_update(target, stubs, tiny_model_dir, tmp_path, engine_config, reference):
    _, inference, _ = stubs
    long_prompt = PROMPT * 8  # several KV blocks, cached by the first request
    first = await greedy(inference, long_prompt)
    assert await greedy(inference, long_prompt) == first
    weights = perturbed(tiny_model_dir, seed=3)
    rc, _, err = await run_trainer(target, save_weights(weights, tmp_path / "w.safetensors"), "step-3")
    assert rc == 0, err
    # A fresh engine on the new weights is the truth; the cached prefix must not leak in.
    fresh_first = await reference.outputs(weights, tmp_path, long_prompt)
    assert await greedy(inference, long_prompt) == fresh_first != first


async def test_trainer_killed_mid_transfer_leaves_the_old_weights(target, stubs, tiny_model_dir, tmp_path):
    control, inference, lifecycle = stubs
    before_tokens, before_sum = await greedy(inference), await checksum(lifecycle)
    version = (await control.GetWeightVersion(cpb.GetWeightVersionRequest())).weight_version
    weights = save_weights(perturbed(tiny_model_dir, seed=4), tmp_path / "w.safetensors")
    rc, _, _ = await run_trainer(
        target, weights, "never", "--die-after-buckets", "2", "--bucket-bytes", str(2**20), "--timeout-s", "5"
    )
    assert rc == 17, "the trainer died as planned"
    # The server notices the dead peer on its own (its RPC was cancelled with the trainer).
    watch = lifecycle.WatchState(lpb.WatchStateRequest())
    while (await asyncio.wait_for(watch.read(), timeout=30)).HasField("update_session"):
        pass
    watch.cancel()
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert not state.HasField("update_session") and state.weights_consistent
    audit = [a for a in state.recent_mutations if a.operation == "update_weights"]
    assert audit[-1].outcome == "TransferTimeout"
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    assert await greedy(inference) == before_tokens
    assert await checksum(lifecycle) == before_sum
    assert (await control.GetWeightVersion(cpb.GetWeightVersionRequest())).weight_version == version
    # A new trainer re-initializes the transport and syncs normally.
    rc, stats, err = await run_trainer(target, weights, "after-crash")
    assert rc == 0, err
    assert stats["weight_version"] == "after-crash"


@pytest_asyncio.fixture
async def paused_session(stubs, target):
    control, _, _ = stubs
    trainer = HandTrainer(target)
    await trainer.init()
    await control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
    await control.StartWeightUpdate(cpb.StartWeightUpdateRequest())
    yield trainer
    trainer.close()


def norm_weight(model_dir: Path) -> tuple[str, torch.Tensor]:
    return "model.norm.weight", load_file(str(model_dir / "model.safetensors"))["model.norm.weight"]


async def assert_nothing_changed(stubs, tokens, digest, version):
    control, inference, lifecycle = stubs
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert not state.HasField("update_session") and state.weights_consistent
    assert await checksum(lifecycle) == digest
    assert state.weight_version == version
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    assert await greedy(inference) == tokens


@pytest_asyncio.fixture
async def baseline(stubs):
    control, inference, lifecycle = stubs
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    version = (await control.GetWeightVersion(cpb.GetWeightVersionRequest())).weight_version
    return await greedy(inference), await checksum(lifecycle), version


BAD_CHUNKS = {
    # name: builder from a valid (name, tensor) of (update_info, tensors the trainer sends if
    # the workers take part in the vote, else None)
    "unknown name": lambda n, t: (chunk_of([("model.bogus.weight", t)]), [t]),
    "wrong shape": lambda n, t: (chunk_of([(n, t[:-1])]), [t[:-1]]),
    "duplicate name": lambda n, t: (chunk_of([(n, t), (n, t)]), [t, t]),
    "wrong dtype": lambda n, t: (chunk_of([(n, t)], dtype_names=["int8"]), None),
    "list lengths differ": lambda n, t: (chunk_of([(n, t)], shapes=[]), None),
    "bad checksum": lambda n, t: (chunk_of([(n, t)], checksums=["0" * 32]), [t]),
}


@pytest.mark.parametrize("case", list(BAD_CHUNKS))
async def test_bad_update_info_is_refused_and_changes_nothing(case, stubs, baseline, paused_session, tiny_model_dir):
    name, tensor = norm_weight(tiny_model_dir)
    chunk, tensors = BAD_CHUNKS[case](name, tensor * 2)
    await expect(INVALID, paused_session.send(chunk, tensors))
    await assert_nothing_changed(stubs, *baseline)


async def test_bad_json_drops_the_session(stubs, baseline, paused_session):
    control, _, _ = stubs
    await expect(INVALID, control.UpdateWeights(cpb.UpdateWeightsRequest(update_info_json=b"{nope")))
    await expect(PRECONDITION, control.UpdateWeights(cpb.UpdateWeightsRequest(update_info_json=b"{}")))
    await assert_nothing_changed(stubs, *baseline)


async def test_abort_mid_update_keeps_old_weights_and_version(stubs, baseline, paused_session, tiny_model_dir):
    control, _, lifecycle = stubs
    name, tensor = norm_weight(tiny_model_dir)
    await paused_session.send(chunk_of([(name, tensor * 3)]), [tensor * 3])
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert state.update_session.num_chunks == 1 and state.update_session.num_tensors == 1
    await expect(PRECONDITION, control.ResumeGeneration(cpb.ResumeGenerationRequest()))
    await lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
    await assert_nothing_changed(stubs, *baseline)


async def test_partial_update_commits_only_what_was_sent(stubs, baseline, paused_session, tiny_model_dir):
    control, inference, lifecycle = stubs
    before = dict((await lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())).per_tensor)
    name, tensor = norm_weight(tiny_model_dir)
    await paused_session.send(chunk_of([(name, tensor * 3)]), [tensor * 3])
    await control.FinishWeightUpdate(cpb.FinishWeightUpdateRequest(weight_version="norm-x3"))
    after = dict((await lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())).per_tensor)
    assert after[name] == tensor_checksum(tensor * 3)
    assert {n: d for n, d in after.items() if n != name} == {n: d for n, d in before.items() if n != name}
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    assert await greedy(inference) != baseline[0], "the new norm weight is live"


async def test_wrong_state_rows(stubs, target, baseline):
    control, _, lifecycle = stubs
    trainer = HandTrainer(target)
    try:
        await trainer.init()
        details = await expect(PRECONDITION, control.StartWeightUpdate(cpb.StartWeightUpdateRequest()))
        assert "pause generation before StartWeightUpdate (state: RUNNING)" in details
        await expect(PRECONDITION, control.FinishWeightUpdate(cpb.FinishWeightUpdateRequest()))
        await control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_ABORT))
        await expect(PRECONDITION, control.StartDraftWeightUpdate(cpb.StartDraftWeightUpdateRequest()))
        await control.StartWeightUpdate(cpb.StartWeightUpdateRequest())
        await expect(grpc.StatusCode.ABORTED, control.StartWeightUpdate(cpb.StartWeightUpdateRequest()))
        valid = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
        await expect(
            grpc.StatusCode.ABORTED,
            control.InitWeightTransferEngine(
                cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(valid).encode())
            ),
        )
        await expect(INVALID, control.FinishWeightUpdate(cpb.FinishWeightUpdateRequest(weight_version="")))
        await lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
        await lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())  # idempotent
    finally:
        trainer.close()
    await assert_nothing_changed(stubs, *baseline)


async def test_init_deadline_and_bad_init_info_leave_the_transport_as_it_was(stubs, baseline):
    control, _, lifecycle = stubs
    ready = (await lifecycle.GetState(lpb.GetStateRequest())).transport_ready
    await expect(INVALID, control.InitWeightTransferEngine(cpb.InitWeightTransferEngineRequest(init_info_json=b"[]")))
    await expect(
        INVALID,
        control.InitWeightTransferEngine(
            cpb.InitWeightTransferEngineRequest(init_info_json=b'{"master_address": "127.0.0.1", "world_size": 2}')
        ),
    )
    nobody = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
        "timeout_s": 2,
    }
    await expect(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        control.InitWeightTransferEngine(
            cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(nobody).encode())
        ),
    )
    assert (await lifecycle.GetState(lpb.GetStateRequest())).transport_ready == ready
    await assert_nothing_changed(stubs, *baseline)


async def test_without_weight_transfer_every_transfer_rpc_fails_closed(control):
    """The session-wide engine has no weight-transfer backend configured."""
    for call, req in (
        (control.InitWeightTransferEngine, cpb.InitWeightTransferEngineRequest(init_info_json=b"{}")),
        (control.StartWeightUpdate, cpb.StartWeightUpdateRequest()),
        (control.StartDraftWeightUpdate, cpb.StartDraftWeightUpdateRequest()),
    ):
        details = await expect(PRECONDITION, call(req))
        assert "weight transfer is not configured" in details


@pytest.mark.parametrize("mode", [cpb.PAUSE_MODE_ABORT, cpb.PAUSE_MODE_KEEP])
async def test_a_sync_leaves_someone_elses_pause_in_place(mode, target, stubs, tiny_model_dir, tmp_path):
    """An operator paused the server (to drain it, say); a trainer's sync lands, and the
    server stays paused: the SDK used to resume a pause it had not made."""
    control, _, lifecycle = stubs
    await control.PauseGeneration(cpb.PauseGenerationRequest(mode=mode))
    weights = save_weights(perturbed(tiny_model_dir, seed=6), tmp_path / "w.safetensors")
    rc, stats, err = await run_trainer(target, weights, "while-paused")
    assert rc == 0, err
    assert stats["weight_version"] == "while-paused" and stats["resumed"] is False
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert state.pause_phase == lpb.PAUSE_PHASE_PAUSED and state.weight_version == "while-paused"
