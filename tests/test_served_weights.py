"""What the engine serves, checked against ground truth: partial updates of fused layers, a
digest that reads the model (so a change behind rlserve's back shows), and recovery from a
commit that fails half way.

The session's engines accept pickled callables (`conftest.Engines`), so that a test can reach
into the worker with vLLM's own `collective_rpc` and change the served weights behind
rlserve's back (or make one commit fail): edges a well-behaved engine never reaches by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import cloudpickle
import grpc
import pytest
import pytest_asyncio
import torch
import worker_faults
from worker_faults import fail_next_load, fail_next_prepare, slow_next_digest

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.sdk.client import Client
from rlserve.sdk.weight_sync import WeightSync
from rlserve.wire.protocol import ChunkInfo, TensorMeta, tensor_checksum

from helpers import (
    HandTrainer,
    begin_update,
    changed_a_little,
    checkpoint,
    chunk_of,
    gloo_server,
    greedy,
    perturbed,
)

# Functions sent to the worker travel by value: the worker cannot import the test modules.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(worker_faults)


@pytest_asyncio.fixture(scope="module")
async def s(wt_engine, engine_config, tiny_model_dir):
    """Over the session's gloo engine, which other modules leave serving their weights: the
    checkpoint's synced first."""
    async with gloo_server(wt_engine, engine_config, transfer_timeout_s=10) as stubs:
        await update(stubs, checkpoint(tiny_model_dir), "checkpoint")
        yield stubs


@pytest_asyncio.fixture(autouse=True)
async def checkpoint_weights_afterwards(s, tiny_model_dir):
    """Every test starts from the checkpoint's weights, served."""
    yield
    await s.lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
    await update(s, checkpoint(tiny_model_dir), "checkpoint")


async def update(s, weights: dict, version: str) -> None:
    """One update carrying `weights` (any subset of the checkpoint), through a real gloo group."""
    trainer = HandTrainer(s.target)
    try:
        await begin_update(s, trainer)
        pairs = sorted(weights.items())
        await trainer.send(chunk_of(pairs), [t for _, t in pairs])
        await s.control.FinishWeightUpdate(cpb.FinishWeightUpdateRequest(weight_version=version))
        await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
    finally:
        trainer.close()


async def served(s) -> lpb.WeightChecksum:
    return await s.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())


async def assert_unchanged_and_resume(s, version: str, before: lpb.WeightChecksum) -> None:
    """Nothing of a failed update stayed: no session, the old version and digests; resumes."""
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert state.weights_consistent and state.weight_version == version and not state.HasField("update_session")
    assert dict((await served(s)).per_tensor) == dict(before.per_tensor)
    await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())


def digests_of(weights: dict) -> dict[str, str]:
    return {n: tensor_checksum(t) for n, t in weights.items()}


async def test_the_served_digests_equal_the_checkpoint(s, tiny_model_dir):
    digest = await served(s)
    assert dict(digest.per_tensor) == digests_of(checkpoint(tiny_model_dir))
    assert not digest.inconsistent_tensors


async def test_a_partial_update_of_a_fused_layer_keeps_its_other_members(s, tiny_model_dir):
    """q_proj alone, re-sent with its current values: vLLM reloads qkv_proj as a whole, so k
    and v come from the weights being served and nothing changes."""
    before_tokens, before = await greedy(s.inference), await served(s)
    q = "model.layers.0.self_attn.q_proj.weight"
    await update(s, {q: checkpoint(tiny_model_dir)[q]}, "q-again")
    assert await greedy(s.inference) == before_tokens
    assert dict((await served(s)).per_tensor) == dict(before.per_tensor)


async def test_a_partial_update_of_fused_layers_equals_a_fresh_engine(
    s, tiny_model_dir, tmp_path, engine_config, reference
):
    weights = checkpoint(tiny_model_dir)
    changed = {
        name: weights[name] * 1.5
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight")
    }
    await update(s, changed, "partial")
    expected = {**weights, **changed}
    assert dict((await served(s)).per_tensor) == digests_of(expected)
    assert await greedy(s.inference) == await reference.outputs(expected, tmp_path)


def _zero_o_proj_kernel(worker) -> None:
    """Repack layer 1's o_proj kernel from zeros, as a buggy loader might, leaving no trace
    in any parameter (on CPU the layer has none: its weight lives in the kernel)."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = worker.model_runner.get_model().model.layers[1].self_attn.o_proj
    shape = (layer.output_size_per_partition, layer.input_size_per_partition)
    layer.weight = torch.nn.Parameter(torch.zeros(shape, dtype=layer.weight.dtype), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)


async def test_a_change_behind_rlservers_back_shows_in_the_digest(s, wt_engine, tiny_model_dir):
    """The digest is read from the model, not remembered from what was sent."""
    mine = digests_of(checkpoint(tiny_model_dir))
    # The fixture's last commit dropped any cached digest: the next one is computed anew.
    await wt_engine.llm.collective_rpc(_zero_o_proj_kernel)
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    now = dict((await served(s)).per_tensor)
    assert now[o_proj] != mine[o_proj]
    assert {n: d for n, d in now.items() if n != o_proj} == {n: d for n, d in mine.items() if n != o_proj}


async def test_vllms_weight_reset_shows_what_is_really_served(s, wt_engine, tiny_model_dir):
    """vLLM's own `reset_weights` zeroes every parameter. On CPU the linear layers keep their
    packed kernels (they are still served), the norms and the embedding are zeros, and the
    lm_head tied to the embedding still computes with the old one: a digest of the
    parameters would say "all zero", this one says exactly that and no more."""
    mine = digests_of(checkpoint(tiny_model_dir))
    await wt_engine.llm.collective_rpc("reset_weights")
    digest = await served(s)
    changed = sorted(n for n, d in digest.per_tensor.items() if d != mine[n])
    assert changed == sorted(n for n in mine if "norm" in n or "embed" in n)
    assert list(digest.inconsistent_tensors) == ["model.embed_tokens.weight"]


async def test_a_load_that_fails_half_way_changes_nothing_and_the_next_update_lands(
    s, wt_engine, tiny_model_dir, tmp_path, engine_config, reference
):
    """The update is loaded into shadows as it arrives: a failure half way (here, after 3
    tensors) leaves the served weights, digests and version as they were, and generation
    may resume at once."""
    weights = checkpoint(tiny_model_dir)
    before = await served(s)
    version = (await s.lifecycle.GetState(lpb.GetStateRequest())).weight_version
    await wt_engine.llm.collective_rpc(fail_next_load)
    trainer = HandTrainer(s.target)
    try:
        await begin_update(s, trainer)
        pairs = sorted((n, t * 1.5) for n, t in weights.items())
        with pytest.raises(grpc.RpcError) as e:
            await trainer.send(chunk_of(pairs), [t for _, t in pairs])
        assert e.value.code() == grpc.StatusCode.INTERNAL and "simulated failure" in e.value.details()
    finally:
        trainer.close()
    await assert_unchanged_and_resume(s, version, before)
    # The transport is still in step with the trainer: the next complete update is taken.
    await update(s, weights, "recovered")
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert state.weights_consistent and state.weight_version == "recovered"
    assert dict((await served(s)).per_tensor) == digests_of(weights)
    assert await greedy(s.inference) == await reference.outputs(weights, tmp_path)


async def test_prepare_does_all_but_the_swap_and_the_commit_then_lands(s, tiny_model_dir):
    """PrepareWeightUpdate completes the fused layer sent in part and processes it beside the
    served model: the served digests are still the old ones, no further chunk is taken (the
    session stays open), and the commit serves the new weights."""
    weights = checkpoint(tiny_model_dir)
    before = await served(s)
    q = "model.layers.0.self_attn.q_proj.weight"
    trainer = HandTrainer(s.target)
    try:
        await begin_update(s, trainer)
        await trainer.send(chunk_of([(q, weights[q] * 1.5)]), [weights[q] * 1.5])
        prepared = await s.lifecycle.PrepareWeightUpdate(lpb.PrepareWeightUpdateRequest())
        assert prepared.session.prepared and prepared.session.num_tensors == 1 and prepared.session.num_chunks == 1
        again = await s.lifecycle.PrepareWeightUpdate(lpb.PrepareWeightUpdateRequest())
        assert again.session.session_id == prepared.session.session_id
        assert dict((await served(s)).per_tensor) == dict(before.per_tensor)
        k = "model.layers.0.self_attn.k_proj.weight"
        with pytest.raises(grpc.RpcError) as e:
            await s.control.UpdateWeights(cpb.UpdateWeightsRequest(update_info_json=b"{}"))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "prepared" in e.value.details()
        state = await s.lifecycle.GetState(lpb.GetStateRequest())
        assert state.update_session.prepared and state.weights_consistent
        await s.control.FinishWeightUpdate(cpb.FinishWeightUpdateRequest(weight_version="prepared"))
        await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
    finally:
        trainer.close()
    digests = dict((await served(s)).per_tensor)
    assert digests == digests_of({**weights, q: weights[q] * 1.5})
    assert digests[k] == before.per_tensor[k]


async def test_the_shadow_bytes_count_what_packed_kernels_hold(s, tiny_model_dir):
    """On CPU vLLM packs a processed layer's weight into a kernel of its own and drops the
    parameter: the bytes the shadows hold (GetState, PrepareWeightUpdate) count that copy. A
    staged sync of SmolLM2 in bf16 reported 57 MB of shadows; 382 MB now, against a peak of
    449 MB above the server's resting memory with the 67 MB bucket it lands in."""
    weights = perturbed(tiny_model_dir, seed=93)
    trainer = HandTrainer(s.target)
    try:
        await begin_update(s, trainer)
        pairs = sorted(weights.items())
        await trainer.send(chunk_of(pairs), [t for _, t in pairs])
        prepared = await s.lifecycle.PrepareWeightUpdate(lpb.PrepareWeightUpdateRequest())
        state = await s.lifecycle.GetState(lpb.GetStateRequest())
    finally:
        trainer.close()
    sent = sum(t.numel() * t.element_size() for t in weights.values())
    assert prepared.session.shadow_bytes == state.update_session.shadow_bytes >= sent


async def test_a_prepare_that_fails_drops_the_update_and_changes_nothing(s, wt_engine, tiny_model_dir):
    weights = checkpoint(tiny_model_dir)
    before = await served(s)
    version = (await s.lifecycle.GetState(lpb.GetStateRequest())).weight_version
    q = "model.layers.0.self_attn.q_proj.weight"
    await wt_engine.llm.collective_rpc(fail_next_prepare)
    trainer = HandTrainer(s.target)
    try:
        await begin_update(s, trainer)
        await trainer.send(chunk_of([(q, weights[q] * 1.5)]), [weights[q] * 1.5])
        with pytest.raises(grpc.RpcError) as e:
            await s.lifecycle.PrepareWeightUpdate(lpb.PrepareWeightUpdateRequest())
        assert e.value.code() == grpc.StatusCode.INTERNAL and "simulated failure while preparing" in e.value.details()
    finally:
        trainer.close()
    await assert_unchanged_and_resume(s, version, before)
    with pytest.raises(grpc.RpcError) as e:
        await s.lifecycle.PrepareWeightUpdate(lpb.PrepareWeightUpdateRequest())
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _hold_garbage(worker) -> None:
    """From now on the garbage collector keeps what it finds unreachable (in gc.garbage)."""
    import gc

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)


def _garbage_tensor_bytes(worker) -> int:
    """Bytes of the tensors that were left for the garbage collector since `_hold_garbage`."""
    import gc

    import torch

    try:
        gc.collect()
        return sum(t.numel() * t.element_size() for t in gc.garbage if isinstance(t, torch.Tensor) and not t.is_meta)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def test_a_sync_leaves_no_tensor_for_the_garbage_collector(s, wt_engine, tiny_model_dir):
    """A commit frees the update's shadows at once. They held their layers' tensors in
    reference cycles (a tensor's weight loader bound to its shadow), which only a garbage
    collection frees, some time later: each sync left an update's worth of memory behind
    until then (about 200 MB per sync of SmolLM2-135M)."""
    await wt_engine.llm.collective_rpc(_hold_garbage)
    try:
        await update(s, perturbed(tiny_model_dir, seed=61), "no-garbage")
    finally:
        (left,) = await wt_engine.llm.collective_rpc(_garbage_tensor_bytes)
    assert left == 0


@contextlib.contextmanager
def _packed_kernels_run_by(wrap):
    """In a worker: every packed kernel the served-weight read runs goes through
    `wrap(run)(module, x, weight)`, `run` being the real call."""
    from rlserve.worker import vllm_compat

    run = vllm_compat.run_packed_kernel
    vllm_compat.run_packed_kernel = wrap(run)
    try:
        yield
    finally:
        vllm_compat.run_packed_kernel = run


def _one_digest_pass_piece_by_piece(worker) -> tuple[dict[str, list[int]], dict[str, int], dict[str, str]]:
    """A digest pass of the served model, one piece of work per `advance(0)`, watching each
    packed kernel it runs: per layer the identity rows each piece fed it, per layer its
    inputs, and the digests the pass gave."""
    from rlserve.worker import vllm_compat

    served = worker._rlserve_served()
    fed: dict[str, list[int]] = {}
    pieces: list[dict[str, int]] = []
    layer_of = {id(m): n for n, m in worker.model_runner.get_model().named_modules()}

    def watched(run):
        def call(module, x, weight):
            if not (x.shape[0] == 1 and weight.shape[0] == 1):  # not the one-row probe
                pieces[-1][layer_of[id(module)]] = pieces[-1].get(layer_of[id(module)], 0) + x.shape[0]
            return run(module, x, weight)

        return call

    with _packed_kernels_run_by(watched):
        served.invalidate()
        done = False
        while not done and len(pieces) < 10_000:
            pieces.append({})
            done = served.advance(0.0)  # each call does one piece of work, however short its budget
    assert done, "a digest pass of the tiny model did not end in 10,000 pieces"
    for piece in pieces:
        assert len(piece) <= 1, piece  # a piece runs one kernel
        for layer, rows in piece.items():
            fed.setdefault(layer, []).append(rows)
    model = worker.model_runner.get_model()
    inputs = {n: vllm_compat.kernel_shape(m)[1] for n, m in model.named_modules() if n in fed}
    return fed, inputs, dict(served.digests)


async def test_a_digest_pass_reads_each_packed_layer_once_in_pieces(s, wt_engine, tiny_model_dir):
    """A layer that serves several checkpoint tensors (q, k, v; gate, up) is read through its
    kernel once per pass, not once per tensor (SmolLM2's digest pass: 0.94 -> 0.75 s on two
    cores); the pass yields to the engine between pieces of a few ms, not between tensors
    (the lm_head alone was one slice of 155 ms on two cores, 300 on the worker's one)."""
    ((fed, inputs, digests),) = await wt_engine.llm.collective_rpc(_one_digest_pass_piece_by_piece)
    assert fed, "no layer of the test model is read through a packed kernel"
    assert any("qkv_proj" in layer for layer in fed) and any("gate_up_proj" in layer for layer in fed)
    assert {layer: sum(rows) for layer, rows in fed.items()} == inputs
    assert digests == digests_of(checkpoint(tiny_model_dir))  # what every test here starts from


def _a_digest_pass_that_fails_once_half_way(worker) -> tuple[str, bool, dict[str, str]]:
    """A digest pass whose third packed-kernel read fails (as running out of memory would),
    then the next call: what the failing call raised, whether the next call reported done at
    once, and the digests it ended with."""
    served = worker._rlserve_served()
    calls = []

    def failing_once(run):
        def call(module, x, weight):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("simulated: cannot allocate memory")
            return run(module, x, weight)

        return call

    with _packed_kernels_run_by(failing_once):
        served.invalidate()
        try:
            served.advance(60.0)
            raised = ""
        except RuntimeError as e:
            raised = str(e)
        done_at_once = served.advance(0.0)
        while not served.advance(60.0):
            pass
    return raised, done_at_once, dict(served.digests)


async def test_a_digest_pass_that_fails_half_way_starts_over(s, wt_engine, tiny_model_dir):
    """It never reports done without the tensors it had left: the next pass digests them all."""
    ((raised, done_at_once, digests),) = await wt_engine.llm.collective_rpc(_a_digest_pass_that_fails_once_half_way)
    assert raised == "simulated: cannot allocate memory" and not done_at_once
    assert digests == digests_of(checkpoint(tiny_model_dir))


async def test_digest_callers_that_vanish_or_overlap_get_what_is_served(s, wt_engine, tiny_model_dir):
    """A caller that gives up during a read-back (its deadline passes while the worker is in
    it) disturbs nothing: callers after it, two at once, get the digests of what is served."""
    weights = perturbed(tiny_model_dir, seed=97)
    await update(s, weights, "vanishing-readers")  # a commit: the next read-back is a new pass
    await wt_engine.llm.collective_rpc(slow_next_digest)
    with pytest.raises(grpc.RpcError) as e:
        await s.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest(), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    first, second = await asyncio.gather(served(s), served(s))
    assert dict(first.per_tensor) == dict(second.per_tensor) == digests_of(weights)
    assert not first.inconsistent_tensors


async def test_a_read_back_slower_than_a_plain_call_still_verifies_the_sync(s, wt_engine, tiny_model_dir):
    """The digests after the commit are read back from the kernels, work of the model's size:
    the SDK waits for them as for a chunk, not as for a plain call (it reported a committed
    sync as failed, "digests cannot be read: Deadline Exceeded", on a slow CPU)."""
    weights = perturbed(tiny_model_dir, seed=81)

    def sync() -> object:
        with Client(s.target) as client:
            weight_sync = WeightSync(client, timeout_s=10.0, rpc_timeout_s=2.0)
            try:
                return weight_sync.sync(weights, "slow-read-back")
            finally:
                weight_sync.close()

    await wt_engine.llm.collective_rpc(slow_next_digest)
    stats = await asyncio.to_thread(sync)
    assert stats.weight_version == "slow-read-back" and stats.checksum == (await served(s)).overall
    assert dict((await served(s)).per_tensor) == digests_of(weights)


def _patch_syncs(target: str, steps: list[tuple[dict, str]]) -> list:
    with Client(target) as client:
        sync = WeightSync(client)
        try:
            return [sync.sync(weights, version, patch=True) for weights, version in steps]
        finally:
            sync.close()


async def test_a_patch_sync_sends_what_changed_and_serves_the_patched_weights(
    s, tiny_model_dir, tmp_path, engine_config, reference
):
    """After a whole sync, a sync with patch=True sends only the 1% of elements that changed
    (indices and values) and the server serves exactly the patched tensors; the next patch
    builds on what the first committed (kept by the server, not read back again)."""
    first = perturbed(tiny_model_dir, seed=71)
    second = changed_a_little(first, 0.01, seed=72)
    third = changed_a_little(second, 0.01, seed=73)
    steps = [(first, "p0"), (second, "p1"), (third, "p2")]
    dense, patched, again = await asyncio.to_thread(_patch_syncs, s.target, steps)
    assert patched.num_bytes < dense.num_bytes * 0.05 and again.num_bytes == patched.num_bytes
    assert dict((await served(s)).per_tensor) == digests_of(third)
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert state.weight_version == "p2" and state.weights_consistent
    assert await greedy(s.inference) == await reference.outputs(third, tmp_path)


def _patch_chunk(name: str, target: torch.Tensor, at: torch.Tensor, base_weight_version: str, **override) -> tuple:
    """update_info and wire bytes of a patch turning the server's tensor into `target` at
    flat indices `at` (8 of them: 64 bytes of float32, one aligned bucket)."""
    blob = torch.cat([at.to(torch.int32).view(torch.uint8), target.view(-1)[at].view(torch.uint8)])
    meta = TensorMeta(name, "float32", tuple(target.shape), tensor_checksum(target), num_changed=at.numel())
    info = {**ChunkInfo((meta,), base_weight_version=base_weight_version).to_json(), **override}
    return info, blob


PATCH_FAULTS = ["an index outside the tensor", "a patch made on other weights", "another base version"]


@pytest.mark.parametrize("fault", PATCH_FAULTS)
async def test_a_bad_patch_is_refused_and_changes_nothing(s, tiny_model_dir, fault):
    weights = checkpoint(tiny_model_dir)
    name = "model.layers.0.mlp.down_proj.weight"
    before = await served(s)
    version = (await s.lifecycle.GetState(lpb.GetStateRequest())).weight_version
    at = torch.arange(8) * 3
    target = weights[name].clone()
    target.view(-1)[at] += 1.0
    if fault == PATCH_FAULTS[1]:
        target.view(-1)[100] += 1.0  # the trainer believes the server serves this element too
    info, blob = _patch_chunk(name, target, at, "not-served" if fault == PATCH_FAULTS[2] else version)
    if fault == PATCH_FAULTS[0]:
        blob[:4] = torch.tensor([target.numel() + 5], dtype=torch.int32).view(torch.uint8)
    trainer = HandTrainer(s.target)
    try:
        await begin_update(s, trainer)
        with pytest.raises(grpc.RpcError) as e:
            # A stale base is refused before the workers see the chunk: no vote to join.
            await trainer.send(info, None if fault == PATCH_FAULTS[2] else [blob])
        expected = grpc.StatusCode.ABORTED if fault == PATCH_FAULTS[2] else grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.code() == expected, e.value.details()
        assert ["indices", "not the trainer's", "not-served"][PATCH_FAULTS.index(fault)] in e.value.details()
    finally:
        trainer.close()
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert state.weight_version == version and state.weights_consistent
    assert dict((await served(s)).per_tensor) == dict(before.per_tensor)
