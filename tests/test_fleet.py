"""`rlserve.Fleet` over real servers: two engines in this process (they accept pickled
callables, so that a test can make one server's load fail) and, where a server must die, a
third one as its own `rlserve serve` process. One gloo group spans the trainer and every
server's workers; every check reads back what each server serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cloudpickle
import grpc
import pytest
import pytest_asyncio
import torch
import worker_faults
from worker_faults import fail_next_load, fail_next_prepare, slow_next_digest

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import inference_pb2 as pb
from rlserve.sdk.client import Client, generate_request
from rlserve.sdk.fleet import AsyncFleet, Fleet, FleetError, FleetSyncError
from rlserve.sdk.launch import free_port
from rlserve.sdk.weight_sync import WeightSync
from rlserve.wire.protocol import tensor_checksum

from helpers import (
    ProcessLog,
    checkpoint,
    eventually,
    gloo_config,
    greedy,
    kill_tree,
    models_listed,
    never_paused,
    perturbed,
    save_weights,
    serving,
    wait_for_state,
    watched,
)
from tiny_model import SERVE_ARGS

cloudpickle.register_pickle_by_value(worker_faults)

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def doomed(tiny_model_dir):
    """`rlserve serve` in a process of its own, for the test that kills it; launched first, so
    that it starts while this module's engine does (a start is mostly one core importing
    vLLM), and serving before the first test (`servers`). Killed at the end if still alive."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "rlserve", "serve", "--model", str(tiny_model_dir), "--port", str(port),
        *SERVE_ARGS,
        "--weight-transfer-backend", "rlserve_gloo", "--transfer-timeout-s", str(TIMEOUT_S),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)
    try:
        yield proc, f"127.0.0.1:{port}"
    finally:
        kill_tree(proc)


@pytest_asyncio.fixture(scope="module")
async def members(doomed, engines, wt_engine):
    """The session's gloo engine and one of this module's own."""
    async with engines.own(weight_transfer_backend="rlserve_gloo") as other:
        yield wt_engine, other


@pytest_asyncio.fixture(scope="module")
async def servers(members, engine_config, doomed):
    config = gloo_config(engine_config, transfer_timeout_s=TIMEOUT_S)
    with Client(doomed[1]) as client:
        await asyncio.to_thread(client.wait_ready, 300)
    async with serving(members[0], config) as a, serving(members[1], config) as b:
        yield a, b


@pytest_asyncio.fixture(autouse=True)
async def checkpoint_weights(servers, tiny_model_dir):
    """Every test starts with both servers serving the checkpoint as "checkpoint", running."""
    for s in servers:
        await s.lifecycle.AbortWeightUpdate(lpb.AbortWeightUpdateRequest())
        state = await s.lifecycle.GetState(lpb.GetStateRequest())
        if state.pause_phase != lpb.PAUSE_PHASE_RUNNING and state.weights_consistent:
            await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
    fleet = Fleet([s.target for s in servers], timeout_s=TIMEOUT_S)
    try:
        await asyncio.to_thread(fleet.init, require_same_weights=False)
        await asyncio.to_thread(fleet.sync, checkpoint(tiny_model_dir), "checkpoint")
    finally:
        fleet.close()


def digests_of(weights: dict) -> dict[str, str]:
    return {n: tensor_checksum(t) for n, t in weights.items()}


async def served(s) -> dict[str, str]:
    return dict((await s.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())).per_tensor)


async def sync_alone(target: str, weights: dict, version: str) -> None:
    """One server synced by itself (the single-server SDK): no longer like the others."""
    with Client(target) as client:
        sync = WeightSync(client, timeout_s=TIMEOUT_S)
        try:
            await asyncio.to_thread(sync.sync, weights, version)
        finally:
            sync.close()


async def state(s) -> lpb.LifecycleState:
    return await s.lifecycle.GetState(lpb.GetStateRequest())


async def test_one_sync_serves_the_trainers_weights_on_every_server(
    servers, tiny_model_dir, tmp_path, engine_config, reference
):
    """Through the asyncio twin: the test's event loop (which serves both servers) runs on."""
    weights = perturbed(tiny_model_dir, seed=11)
    async with AsyncFleet([s.target for s in servers], timeout_s=TIMEOUT_S) as fleet:
        stats = await fleet.sync(weights, "step-1")
        assert stats.servers == tuple(s.target for s in servers) and stats.num_tensors == len(weights)
        # Routed rollouts say where they ran and which weights produced them.
        out = await fleet.generate("Hello", max_new_tokens=4, ignore_eos=True, temperature=0.0)
        assert out.server in fleet.servers
        assert [span.weight_version for span in out.response.outputs.weight_version_spans] == ["step-1"]
        chunks = [r async for r in fleet.stream("Hello", max_new_tokens=4, ignore_eos=True, temperature=0.0)]
        assert len({r.server for r in chunks}) == 1
        assert [t for r in chunks for t in r.response.outputs.token_ids] == list(out.response.outputs.token_ids)
        # Leaving a stream early ends its request on the server.
        async with contextlib.aclosing(fleet.stream("A long story", max_new_tokens=400, ignore_eos=True)) as long:
            async for _ in long:
                break
        assert fleet.fleet.router.outstanding() == {a: 0 for a in fleet.fleet.router.outstanding()}
    expected = await reference.outputs(weights, tmp_path)
    for s in servers:
        st = await state(s)
        assert st.weight_version == "step-1" and st.pause_phase == lpb.PAUSE_PHASE_RUNNING
        assert await served(s) == digests_of(weights)
        assert await greedy(s.inference) == expected


async def test_a_fleet_sync_leaves_a_member_someone_else_paused_paused(servers, tiny_model_dir):
    """An operator drains one member (pause ABORT); the fleet's sync lands on both and resumes
    only the one it paused (it used to resume the operator's pause too)."""
    a, b = servers
    await b.control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_ABORT))
    try:
        weights = perturbed(tiny_model_dir, seed=12)
        async with AsyncFleet([s.target for s in servers], timeout_s=TIMEOUT_S) as fleet:
            stats = await fleet.sync(weights, "drained")
        assert stats.left_paused == (b.target,)
        assert [(await state(s)).pause_phase for s in servers] == [lpb.PAUSE_PHASE_RUNNING, lpb.PAUSE_PHASE_PAUSED]
        assert [(await state(s)).weight_version for s in servers] == ["drained", "drained"]
        assert await served(b) == digests_of(weights)
    finally:
        await b.control.ResumeGeneration(cpb.ResumeGenerationRequest())


async def test_init_names_the_server_that_does_not_fit(servers, tiny_model_dir):
    a, b = servers
    # b alone gets other weights: no longer the fleet's.
    await sync_alone(b.target, perturbed(tiny_model_dir, seed=12), "elsewhere")
    with Fleet([a.target, b.target], timeout_s=TIMEOUT_S) as fleet:
        with pytest.raises(FleetError, match=f"{b.target} serves other weights"):
            await asyncio.to_thread(fleet.init)
    dead = f"127.0.0.1:{free_port()}"
    with Fleet([a.target, dead], timeout_s=TIMEOUT_S, rpc_timeout_s=2) as fleet:
        with pytest.raises(FleetError, match=f"{dead}: UNAVAILABLE"):
            await asyncio.to_thread(fleet.init)
    assert (await state(a)).weight_version == "checkpoint"


async def test_init_waits_for_digests_as_for_work_of_the_models_size(servers, members, tiny_model_dir):
    """Each server reads every tensor back through its kernels (a minute for SmolLM2 in bf16
    on a CPU without native bf16): init waited a plain call's `rpc_timeout_s` for it, and
    failed with "cannot be digested: DEADLINE_EXCEEDED" where the demo's fleet started."""
    served_bytes = sum(t.numel() for t in checkpoint(tiny_model_dir).values()) * 4  # float32
    assert [(await state(s)).weight_bytes for s in servers] == [served_bytes] * 2
    await members[1].llm.collective_rpc(slow_next_digest)
    with Fleet([s.target for s in servers], timeout_s=TIMEOUT_S, rpc_timeout_s=2) as fleet:
        await asyncio.to_thread(fleet.init)
        assert fleet.servers == tuple(s.target for s in servers)


@pytest.mark.parametrize("fault", ["chunk", "prepare"])
async def test_a_staged_sync_one_server_fails_neither_commits_and_neither_was_paused(
    servers, members, tiny_model_dir, fault
):
    """Both stage while they generate; one fails (loading a chunk, or preparing its commit):
    the vote fails, neither commits, and the states each server published show that neither
    was ever paused for it."""
    before = [await served(s) for s in servers]
    weights = perturbed(tiny_model_dir, seed=15)
    if fault == "prepare":
        # One tensor of a fused layer: the prepare completes the layer, the loader's second call.
        weights = {n: t for n, t in weights.items() if n == "model.layers.0.self_attn.q_proj.weight"}
    await members[1].llm.collective_rpc(fail_next_load if fault == "chunk" else fail_next_prepare)
    async with watched(servers[0].lifecycle) as first, watched(servers[1].lifecycle) as second:
        with Fleet([s.target for s in servers], timeout_s=TIMEOUT_S) as fleet:
            with pytest.raises(FleetSyncError) as e:
                await asyncio.to_thread(fleet.sync, weights, "never", staged=True)
    assert e.value.committed == () and e.value.resumed_on_old_weights
    assert "simulated failure" in e.value.outcomes[servers[1].target].message
    never_paused(first)
    never_paused(second)
    assert any(st.HasField("update_session") and st.update_session.staged for st in first)
    for s, digests in zip(servers, before, strict=True):
        st = await state(s)
        assert st.weight_version == "checkpoint" and not st.HasField("update_session")
        assert await served(s) == digests


async def test_a_staged_fleet_sync_pauses_every_server_for_the_commit_only(servers, tiny_model_dir):
    weights = perturbed(tiny_model_dir, seed=16)
    async with watched(servers[0].lifecycle) as first, watched(servers[1].lifecycle) as second:
        with Fleet([s.target for s in servers], timeout_s=TIMEOUT_S) as fleet:
            stats = await asyncio.to_thread(fleet.sync, weights, "staged")
    assert stats.staged and stats.stage_s > 0 and 0 < stats.pause_s < stats.pause_to_resume_s
    for states in (first, second):
        receiving = [st for st in states if st.HasField("update_session") and not st.update_session.prepared]
        never_paused(receiving)
        assert any(st.pause_phase != lpb.PAUSE_PHASE_RUNNING for st in states)
    for s in servers:
        st = await state(s)
        assert st.weight_version == "staged" and st.pause_phase == lpb.PAUSE_PHASE_RUNNING
        assert await served(s) == digests_of(weights)


async def test_a_server_that_fails_before_the_vote_leaves_every_server_as_it_was(servers, members, tiny_model_dir):
    before = [await served(s) for s in servers]
    await members[1].llm.collective_rpc(fail_next_load)
    with Fleet([s.target for s in servers], timeout_s=TIMEOUT_S) as fleet:
        with pytest.raises(FleetSyncError) as e:
            await asyncio.to_thread(fleet.sync, perturbed(tiny_model_dir, seed=13), "never")
        assert e.value.committed == () and e.value.resumed_on_old_weights
        assert "simulated failure" in e.value.outcomes[servers[1].target].message
        assert fleet.servers == tuple(s.target for s in servers)
        for s, digests in zip(servers, before, strict=True):
            st = await state(s)
            assert st.weight_version == "checkpoint" and st.pause_phase == lpb.PAUSE_PHASE_RUNNING
            assert not st.HasField("update_session") and await served(s) == digests
        # The group is still in step: the next sync lands everywhere.
        weights = perturbed(tiny_model_dir, seed=14)
        await asyncio.to_thread(fleet.sync, weights, "after")
    for s in servers:
        assert (await state(s)).weight_version == "after" and await served(s) == digests_of(weights)


class _LoseUpdateWeights(grpc.UnaryUnaryClientInterceptor):
    """A test double for a server that refuses a chunk before its workers vote (another
    admin aborted its session, say): its UpdateWeights fails here, never reaching it."""

    def intercept_unary_unary(self, continuation, details, request):
        if details.method.endswith("/UpdateWeights"):
            return continuation(details._replace(method="/vllm.Control/NoSuchMethod"), request)
        return continuation(details, request)


async def test_a_refusal_before_the_vote_ends_the_others_collective_at_once(servers, tiny_model_dir):
    a, b = servers
    lossy = Client(b.target, channel=grpc.intercept_channel(grpc.insecure_channel(b.target), _LoseUpdateWeights()))
    with Fleet([Client(a.target), lossy], timeout_s=TIMEOUT_S) as fleet:
        # The rendezvous first, outside the bound: each worker starts a gloo helper process as
        # it joins, seconds on two cores (8.9 s in all once in a full run here).
        await asyncio.to_thread(fleet.init, require_same_weights=False)
        t0 = time.monotonic()
        with pytest.raises(FleetSyncError) as e:
            await asyncio.to_thread(fleet.sync, perturbed(tiny_model_dir, seed=15), "never")
        # Without ending b's membership, a would wait in the vote for its transfer timeout.
        assert time.monotonic() - t0 < TIMEOUT_S * 0.8
        assert e.value.committed == () and e.value.outcomes[b.target].code == grpc.StatusCode.UNIMPLEMENTED
    for s in servers:
        st = await state(s)
        assert st.weight_version == "checkpoint" and st.pause_phase == lpb.PAUSE_PHASE_RUNNING


async def test_a_server_gone_between_syncs_gets_no_request_and_is_dropped_at_the_next_sync(servers, tiny_model_dir):
    a, b = servers
    gone = f"127.0.0.1:{free_port()}"
    with Fleet([a.target, gone, b.target], timeout_s=TIMEOUT_S, rpc_timeout_s=2) as fleet:
        routed = await asyncio.to_thread(fleet.generate_many, ["Hi"] * 12, max_new_tokens=2)
        assert all(not isinstance(r, BaseException) and r.server in (a.target, b.target) for r in routed)
        weights = perturbed(tiny_model_dir, seed=19)
        stats = await asyncio.to_thread(fleet.sync, weights, "without-it")
        assert stats.servers == (a.target, b.target) and fleet.servers == (a.target, b.target)
        assert [d.server for d in fleet.dropped] == [gone] and "UNAVAILABLE" in fleet.dropped[0].reason
    for s in servers:
        assert (await state(s)).weight_version == "without-it" and await served(s) == digests_of(weights)


async def test_a_server_joins_with_a_full_sync_and_leaves(servers, tiny_model_dir):
    a, b = servers
    await sync_alone(b.target, perturbed(tiny_model_dir, seed=16), "b-alone")
    weights = perturbed(tiny_model_dir, seed=17)
    with Fleet([a.target], timeout_s=TIMEOUT_S) as fleet:
        await asyncio.to_thread(fleet.sync, weights, "one")
        fleet.add(b.target)
        name = "model.layers.0.self_attn.q_proj.weight"
        with pytest.raises(ValueError, match="send every tensor"):
            await asyncio.to_thread(fleet.sync, {name: weights[name]}, "partial")
        await asyncio.to_thread(fleet.sync, weights, "two")
        for s in servers:
            assert (await state(s)).weight_version == "two" and await served(s) == digests_of(weights)
        fleet.remove(b.target)
        assert fleet.servers == (a.target,)
        # A subset is fine again, and only a is synced.
        await asyncio.to_thread(fleet.sync, {name: weights[name] * 2}, "three")
    assert (await state(a)).weight_version == "three" and (await state(b)).weight_version == "two"


async def test_routing_keeps_sessions_and_skips_a_paused_server(servers):
    a, b = servers
    with Fleet([a.target, b.target], timeout_s=TIMEOUT_S) as fleet:
        first = await asyncio.to_thread(fleet.generate, "Hi", session_id="s1", max_new_tokens=2)
        again = [
            await asyncio.to_thread(fleet.generate, "Hi there", session_id="s1", max_new_tokens=2) for _ in range(4)
        ]
        assert {r.server for r in again} == {first.server}
        # Spread: with sessions of their own, both servers take requests.
        many = await asyncio.to_thread(
            fleet.generate_many, ["Hi"] * 16, session_ids=[f"x{i}" for i in range(16)], max_new_tokens=8
        )
        assert {r.server for r in many} == {a.target, b.target}
        await b.control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
        try:
            await eventually(lambda: not fleet.router._watches[b.target].serving)
            routed = await asyncio.to_thread(fleet.generate_many, ["Hi"] * 12, max_new_tokens=2)
            assert all(r.server == a.target for r in routed)
            # A session on the paused server moves to one that serves.
            moved = [
                await asyncio.to_thread(fleet.generate, "Hi", session_id=f"x{i}", max_new_tokens=2) for i in range(16)
            ]
            assert {r.server for r in moved} == {a.target}
        finally:
            await b.control.ResumeGeneration(cpb.ResumeGenerationRequest())


class _KillAtCommit(grpc.UnaryUnaryClientInterceptor):
    """A test double for a server that dies at its commit: kills the server and its engine
    just as FinishWeightUpdate is sent to it (a real death; only its moment is chosen)."""

    def __init__(self, proc) -> None:
        self._proc = proc

    def intercept_unary_unary(self, continuation, details, request):
        if details.method.endswith("/FinishWeightUpdate"):
            kill_tree(self._proc)
        return continuation(details, request)


async def test_a_server_killed_at_its_commit_is_dropped_and_the_others_serve_the_new_version(
    servers, doomed, tiny_model_dir
):
    a, b = servers
    proc, target = doomed
    dying = Client(target, channel=grpc.intercept_channel(grpc.insecure_channel(target), _KillAtCommit(proc)))
    weights = perturbed(tiny_model_dir, seed=18)
    with Fleet([Client(a.target), Client(b.target), dying], timeout_s=TIMEOUT_S) as fleet:
        # Requests in flight while the server dies: every one ends, with a result or an error.
        rollouts = asyncio.ensure_future(
            asyncio.to_thread(fleet.generate_many, ["Tell me a story"] * 24, max_new_tokens=64)
        )
        with pytest.raises(FleetSyncError) as e:
            await asyncio.to_thread(fleet.sync, weights, "survivors")
        results = await rollouts
        assert len(results) == 24
        assert all(not isinstance(r, BaseException) or isinstance(r, grpc.RpcError) for r in results)
        assert set(e.value.committed) == {a.target, b.target} and e.value.dropped == (target,)
        outcome = e.value.outcomes[target]
        assert outcome.code == grpc.StatusCode.UNAVAILABLE and outcome.message.startswith("commit failed")
        assert fleet.servers == (a.target, b.target) and fleet.dropped[0].server == target
        for s in servers:
            st = await state(s)
            assert st.weight_version == "survivors" and st.pause_phase == lpb.PAUSE_PHASE_RUNNING
            assert await served(s) == digests_of(weights)
        # The fleet goes on without it: a new group of the two that are left.
        await asyncio.to_thread(fleet.sync, checkpoint(tiny_model_dir), "checkpoint")
        routed = await asyncio.to_thread(fleet.generate_many, ["Hi"] * 8, max_new_tokens=2)
        assert {r.server for r in routed} <= {a.target, b.target}


# A trainer that dies the moment every server has voted (a real SIGKILL; a test double only
# chooses its moment): after the vote, before any FinishWeightUpdate.
TRAINER_KILLED_AFTER_THE_VOTE = """
import os, signal, sys
from safetensors.torch import load_file
import rlserve.sdk.protocol as protocol
from rlserve.fleet import Fleet

count_votes = protocol.check_votes
def and_die(*args):
    count_votes(*args)
    print("voted", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
protocol.check_votes = and_die
staged = os.environ["STAGED"] == "1"
Fleet(sys.argv[2:], timeout_s=float(os.environ["TIMEOUT_S"])).sync(load_file(sys.argv[1]), "never", staged=staged)
"""


@pytest.mark.parametrize("staged", [False, True], ids=["paused", "staged"])
async def test_a_trainer_killed_after_the_vote_leaves_every_server_as_it_was(servers, tiny_model_dir, tmp_path, staged):
    """Every server holds a prepared update, paused (or, staged, still generating: the pause
    comes after the vote); nothing will finish it. Each server's session lease ends it: the
    prepared weights are dropped, every server serves the old weights and version again
    (staged: without ever having paused), a request held meanwhile completes, and a new
    trainer syncs the same servers at once."""
    weights = save_weights(perturbed(tiny_model_dir, seed=23), tmp_path / "w.safetensors")
    async with watched(servers[0].lifecycle) as states:
        trainer = await asyncio.create_subprocess_exec(
            sys.executable, "-c", TRAINER_KILLED_AFTER_THE_VOTE, str(weights), *(s.target for s in servers),
            env={**os.environ, "TIMEOUT_S": str(TIMEOUT_S), "STAGED": "1" if staged else "0"},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(trainer.communicate(), 120)
        assert trainer.returncode == -signal.SIGKILL and out == b"voted\n", err.decode()[-3000:]
        for s in servers:
            st = await state(s)
            assert st.update_session.prepared and st.update_session.staged is staged
            assert (st.pause_phase == lpb.PAUSE_PHASE_RUNNING) is staged
        held = asyncio.ensure_future(servers[0].inference.Generate(generate_request("held", max_new_tokens=4)))
        mine = digests_of(checkpoint(tiny_model_dir))
        for s in servers:
            st = await wait_for_state(
                s.lifecycle,
                lambda st: st.pause_phase == lpb.PAUSE_PHASE_RUNNING and not st.HasField("update_session"),
                TIMEOUT_S + 10,
            )
            assert st.weight_version == "checkpoint" and st.weights_consistent
            assert await served(s) == mine
        assert (await asyncio.wait_for(held, 30)).outputs.finish_info.finish_reason == pb.FinishInfo.LENGTH
    if staged:
        never_paused(states)
    with Fleet([s.target for s in servers], timeout_s=TIMEOUT_S) as fleet:
        await asyncio.to_thread(fleet.sync, perturbed(tiny_model_dir, seed=23), "after")
    for s in servers:
        assert (await state(s)).weight_version == "after"


async def test_the_rl_loop_and_the_demo_drive_a_fleet_as_one(servers, tiny_model_dir, tmp_path):
    """GRPO over both servers: every step syncs both (one version everywhere, the trainer's
    digests on each), rollouts go to both, and every token names its version. Then the same
    through `rlserve demo --server A --server B`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlserve.rl.loop import GrpoConfig, GrpoLoop, Policy
    from rlserve.rl.rollout import SamplingConfig
    from rlserve.rl.tasks import Arithmetic

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = Policy(model, AutoTokenizer.from_pretrained(tiny_model_dir), lr=1e-3)
    config = GrpoConfig(prompts_per_step=4, sampling=SamplingConfig(group_size=4, max_new_tokens=6), lr=1e-3)
    loop = GrpoLoop(policy, Arithmetic(seed=0), [s.target for s in servers], config)
    try:
        records = await asyncio.to_thread(loop.run, 2)
        routed = loop.fleet.router.routed()
    finally:
        loop.close()
    assert [r.version for r in records] == ["1", "2"]
    assert [r.token_versions for r in records] == [{str(r.step - 1): r.completion_tokens} for r in records]
    assert all(r.agreement_ok for r in records)
    assert set(routed) == {s.target for s in servers} and all(n > 0 for n in routed.values())
    mine = {n: tensor_checksum(t.detach().contiguous()) for n, t in policy.model.state_dict().items()}
    for s in servers:
        assert (await state(s)).weight_version == "2"
        digests = await served(s)
        assert {n: mine[n] for n in digests} == digests
    out = tmp_path / "demo"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rlserve", "demo", "--server", servers[0].target, "--server", servers[1].target,
        "--model", str(tiny_model_dir), "--steps", "2", "--minutes", "0", "--prompts-per-step", "2",
        "--group-size", "4", "--out", str(out), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    assert proc.returncode == 0, output.decode()[-3000:]
    assert "2 steps" in output.decode() and ", ".join(s.target for s in servers) in output.decode()
    for s in servers:
        assert (await state(s)).weight_version == "2"


def _completion(port: int, model: str, i: int) -> str:
    """One completion through the router: its text, or the error it ended with."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        body = {"model": model, "prompt": [1, 2, 3, 4 + i % 5], "max_tokens": 24, "temperature": 0}
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        return (
            json.loads(data)["choices"][0]["text"]
            if response.status == 200
            else f"HTTP {response.status}: {data[:200]!r}"
        )
    except (OSError, http.client.HTTPException) as e:
        return f"error: {e}"
    finally:
        conn.close()


async def test_requests_through_vllm_router_all_end_while_the_fleet_syncs(servers, tiny_model_dir, engine_config):
    """vllm-router in front of both servers while `Fleet` syncs them: a paused server holds
    what the router sends it (the router does not look at health; told to round-robin, it
    sends every other request there) and runs it at resume, so every request ends with a
    completion."""
    router = Path(__file__).resolve().parent.parent / ".venv-router" / "bin" / "vllm-router"
    assert router.exists(), "vllm-router is not installed: run `make install`"
    port = free_port()
    cmd = [str(router), "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--policy", "round_robin", "--worker-urls", *(f"grpc://{s.target}" for s in servers)]  # fmt: skip
    log = ProcessLog("router")
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL, stderr=log.file)
    try:
        # Polled from a thread: the router asks the servers, which this loop serves.
        for _ in range(200):
            if proc.poll() is not None or await asyncio.to_thread(models_listed, port):
                break
            await asyncio.sleep(0.3)
        assert proc.poll() is None, log.tail()
        assert await asyncio.to_thread(models_listed, port), "vllm-router did not start"
        model = engine_config.model
        # A thread per request: the held ones must go out while the earlier ones still run (a
        # KEEP pause freezes those on the paused server too, until the resume below).
        with ThreadPoolExecutor(30) as pool, Fleet([s.target for s in servers], timeout_s=TIMEOUT_S) as fleet:
            loop = asyncio.get_running_loop()
            before = [loop.run_in_executor(pool, _completion, port, model, i) for i in range(12)]
            await asyncio.sleep(0.2)
            syncing = asyncio.ensure_future(asyncio.to_thread(fleet.sync, perturbed(tiny_model_dir, seed=21), "routed"))
            during = [loop.run_in_executor(pool, _completion, port, model, i) for i in range(12)]
            await syncing
            # One server paused alone: what the router sends it waits there until resume.
            await servers[1].control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
            held = [loop.run_in_executor(pool, _completion, port, model, i) for i in range(6)]
            # Every request not done yet is held by the paused server, none is anywhere else.
            for _ in range(300):
                waiting = (await state(servers[1])).num_held_requests
                if sum(f.done() for f in held) + waiting == 6:
                    break
                await asyncio.sleep(0.1)
            else:
                unfinished = sum(not f.done() for f in (*before, *during))
                pytest.fail(
                    f"{6 - waiting} requests neither done nor held by the paused server ({unfinished} sent before "
                    f"it paused not done either); vllm-router said:\n{log.tail()}"
                )
            await servers[1].control.ResumeGeneration(cpb.ResumeGenerationRequest())
            texts = await asyncio.gather(*before, *during, *held)
        errors = [t for t in texts if t.startswith(("HTTP ", "error: "))]
        assert len(texts) == 30 and not errors, errors[:3]
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
