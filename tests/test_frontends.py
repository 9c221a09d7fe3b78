"""`rlserve serve --frontends 2`: two frontend processes over one engine, both serving
vllm.Inference on one port (the kernel spreads connections over them), one lifecycle. Health
serves once both do; a pause holds the requests of every process, Abort reaches them all, the
one audit, GetState, GetLoad and vLLM's metrics see both; a frontend killed outright leaves
nothing running in the engine, the other serves on, and it is started again; the follower
takes frontend 0's credentials (a tokens file broken meanwhile changes nothing) and every
reload; SIGTERM drains every process's streams and leaves no process behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import psutil
import pytest

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import control_pb2_grpc, inference_pb2_grpc
from rlserve.api.vllm import inference_pb2 as pb
from rlserve.sdk.client import Client
from rlserve.sdk.launch import ServerProcess, free_port
from rlserve.sdk.weight_sync import WeightSync

from helpers import eventually, kill_tree, long_request, perturbed, read_rest, scrape, value
from tiny_model import SERVE_ARGS

# Connections each land on one process; with this many, both get some (all on one: 2^-15).
NUM_CHANNELS = 16
LENGTH, ABORTED = pb.FinishInfo.LENGTH, pb.FinishInfo.ABORTED


class Frontends:
    """A running `--frontends 2` server: its inference channels (each its own connection) and
    a control channel."""

    def __init__(self, server: ServerProcess, control_target: str, metrics_port: int, token: str = "") -> None:
        self.server = server
        self.control_target = control_target
        self.metrics_port = metrics_port
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.open()

    def open(self) -> None:
        # A channel of its own per connection: grpc would otherwise share one.
        self.channels = [
            grpc.aio.insecure_channel(self.server.target, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(NUM_CHANNELS)
        ]
        self.inference = [inference_pb2_grpc.InferenceStub(ch) for ch in self.channels]
        self.control_channel = grpc.aio.insecure_channel(self.control_target)
        self.control = control_pb2_grpc.ControlStub(self.control_channel)
        self.lifecycle = lifecycle_pb2_grpc.LifecycleStub(self.control_channel)

    async def state(self) -> lpb.LifecycleState:
        return await self.lifecycle.GetState(lpb.GetStateRequest(), metadata=self.metadata)

    async def open_requests(self) -> list[int]:
        return [f.num_open_requests for f in (await self.state()).frontends]

    async def close(self) -> None:
        for ch in (*self.channels, self.control_channel):
            await ch.close()


@contextlib.asynccontextmanager
async def frontends_server(
    model: Path, tmp_path: Path, *extra: str, token: str = "", while_starting: Callable[[], None] = lambda: None
) -> AsyncIterator[Frontends]:
    """`token`: what GetState is called with (a server started with tokens);
    `while_starting()` runs once frontend 0 listens, before the other frontend starts."""
    control, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    extra = ("--weight-transfer-backend", "rlserve_gloo", *extra)
    args = ["--model", str(model), "--frontends", "2", "--control-address", control]
    args += ["--metrics-port", str(metrics_port)]
    args += [*SERVE_ARGS, *extra]
    server = ServerProcess(args, log_path=tmp_path / "server.log")
    fronts = None
    try:
        await asyncio.to_thread(server.wait_listening, 120)
        while_starting()
        # SERVING only once both frontends serve the port.
        await asyncio.to_thread(server.wait_serving, 300)
        fronts = Frontends(server, control, metrics_port, token)
        assert len((await fronts.state()).frontends) == 2
        yield fronts
    finally:
        if fronts is not None:
            await fronts.close()
        kill_tree(server.process)


@pytest.fixture(scope="module")
async def fronts(tiny_model_dir, tmp_path_factory):
    async with frontends_server(tiny_model_dir, tmp_path_factory.mktemp("frontends")) as f:
        yield f


async def generate_on_every_channel(fronts: Frontends, max_new_tokens: int = 8) -> list[pb.GenerateResponse]:
    return await asyncio.gather(
        *(s.Generate(long_request(f"Request {i}:", max_new_tokens)) for i, s in enumerate(fronts.inference))
    )


async def test_both_frontends_serve_and_answer_for_one_server(fronts):
    before = {f.index: f.num_requests for f in (await fronts.state()).frontends}
    generated = "/vllm.Inference/Generate"
    counted = value(scrape(fronts.metrics_port), "rlserve_rpcs_total", method=generated, code="OK")
    replies = await generate_on_every_channel(fronts)
    assert [r.outputs.finish_info.finish_reason for r in replies] == [LENGTH] * NUM_CHANNELS
    state = await fronts.state()
    served = {f.index: f.num_requests - before[f.index] for f in state.frontends}
    assert sorted(served) == [0, 1] and all(served.values()), served
    assert sum(served.values()) == NUM_CHANNELS
    pids = {f.pid for f in state.frontends}
    assert fronts.server.pid in pids and len(pids) == 2 and state.num_frontends == 2
    # Either process answers the inference address's reads as the one server it is.
    infos = await asyncio.gather(
        *(control_pb2_grpc.ControlStub(ch).GetServerInfo(cpb.GetServerInfoRequest()) for ch in fronts.channels)
    )
    assert len({i.SerializeToString() for i in infos}) == 1
    listed = await asyncio.gather(
        *(control_pb2_grpc.ControlStub(ch).ListLoras(cpb.ListLorasRequest()) for ch in fronts.channels)
    )
    assert [list(r.adapters) for r in listed] == [[]] * NUM_CHANNELS
    # One set of metrics: frontend 0 counts the other's RPCs too (they arrive as it answers them).
    wanted = counted + NUM_CHANNELS

    async def all_counted() -> bool:
        return (
            value(
                await asyncio.to_thread(scrape, fronts.metrics_port), "rlserve_rpcs_total", method=generated, code="OK"
            )
            == wanted
        )

    await eventually(all_counted, timeout_s=10)


async def test_a_pause_holds_the_requests_of_every_frontend(fronts):
    await fronts.control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
    try:
        calls = [
            asyncio.ensure_future(s.Generate(long_request(f"Held {i}:", 8))) for i, s in enumerate(fronts.inference)
        ]

        async def all_held() -> bool:
            return (await fronts.state()).num_held_requests == NUM_CHANNELS

        await eventually(all_held, timeout_s=30)
        assert not any(c.done() for c in calls)
        assert all(await fronts.open_requests()), "each process holds some of them"
        # Callers that give up while held leave the one gate, whichever process held them.
        impatient = [
            s.Generate(long_request(f"Impatient {i}:", 8), timeout=1.0) for i, s in enumerate(fronts.inference)
        ]
        outcomes = await asyncio.gather(*impatient, return_exceptions=True)
        assert {e.code() for e in outcomes} == {grpc.StatusCode.DEADLINE_EXCEEDED}

        async def only_the_patient_held() -> bool:
            state = await fronts.state()
            return (
                state.num_held_requests == NUM_CHANNELS
                and sum(f.num_open_requests for f in state.frontends) == NUM_CHANNELS
            )

        await eventually(only_the_patient_held, timeout_s=10)
    finally:
        await fronts.control.ResumeGeneration(cpb.ResumeGenerationRequest())
    replies = await asyncio.gather(*calls)
    assert [r.outputs.num_tokens for r in replies] == [8] * NUM_CHANNELS
    assert (await fronts.state()).num_held_requests == 0


async def test_abort_by_id_reaches_requests_in_every_frontend(fronts):
    calls = []
    for i, stub in enumerate(fronts.inference):
        request = long_request(f"Story {i}:", 400)
        request.request_id = f"frontends-{i}"
        calls.append(stub.GenerateStream(request))
    await asyncio.gather(*(c.read() for c in calls))  # every one is running
    assert all(await fronts.open_requests())
    await fronts.control.Abort(cpb.AbortRequest(request_ids=[f"frontends-{i}" for i in range(NUM_CHANNELS)]))
    lasts = [(await read_rest(c))[-1].outputs for c in calls]
    assert [o.finish_info.finish_reason for o in lasts] == [ABORTED] * NUM_CHANNELS
    assert all(o.finish_info.num_output_tokens < 400 for o in lasts)
    assert await fronts.open_requests() == [0, 0]


async def test_a_refusal_on_the_other_frontend_lands_in_the_one_audit(fronts):
    """Control's mutations are not served on the inference address, by either process; each
    refusal is audited by frontend 0."""
    codes = []
    for channel in fronts.channels:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await control_pb2_grpc.ControlStub(channel).ResumeGeneration(cpb.ResumeGenerationRequest())
        codes.append(e.value.code())
    assert set(codes) == {grpc.StatusCode.PERMISSION_DENIED}
    audit = (await fronts.state()).recent_mutations
    refusals = [a for a in audit if a.operation == "ResumeGeneration"]
    assert len(refusals) >= NUM_CHANNELS
    assert any("(frontend 1)" in a.detail for a in refusals)


async def test_a_weight_sync_reaches_the_requests_of_every_frontend(fronts, tiny_model_dir):
    """The trainer's one call (pause KEEP, transfer, commit, resume) through frontend 0's control
    plane: requests kept in both processes go on under the new weights and say so. Not staged:
    a staged sync pauses only for its commit, and under load (two pytest processes) the 300
    tokens were done on the old weights before it did."""
    with Client(fronts.control_target) as client:
        weight_sync = WeightSync(client, timeout_s=60)
        try:
            await asyncio.to_thread(weight_sync.init)  # the trainer's rendezvous, before the requests
            calls = [s.GenerateStream(long_request(f"Synced {i}:", 300)) for i, s in enumerate(fronts.inference)]
            await asyncio.gather(*(c.read() for c in calls))
            assert all(await fronts.open_requests())
            # Verified: the digests of what the engine serves are the trainer's.
            weights = perturbed(tiny_model_dir, seed=5)
            await asyncio.to_thread(weight_sync.sync, weights, "frontends-1", staged=False)
        finally:
            weight_sync.close()
    lasts = [(await read_rest(c))[-1].outputs for c in calls]
    assert {o.finish_info.finish_reason for o in lasts} == {LENGTH}
    # Kept across the update in both processes: begun on the old weights, ended on the new.
    assert {tuple(s.weight_version for s in o.weight_version_spans) for o in lasts} == {("default", "frontends-1")}
    replies = await generate_on_every_channel(fronts)
    assert {tuple(s.weight_version for s in r.outputs.weight_version_spans) for r in replies} == {("frontends-1",)}


async def channels_of(fronts: Frontends) -> dict[int, list[int]]:
    """Which frontend each channel's connection landed on: {frontend index: channel numbers}."""
    placed: dict[int, list[int]] = {}
    for i, stub in enumerate(fronts.inference):
        before = {f.index: f.num_requests for f in (await fronts.state()).frontends}
        await stub.Generate(long_request(f"Where {i}:", 1))
        after = {f.index: f.num_requests for f in (await fronts.state()).frontends}
        (index,) = [k for k in after if after[k] != before.get(k)]
        placed.setdefault(index, []).append(i)
    return placed


async def fresh_load(fronts: Frontends, since_unix_s: float) -> lpb.EngineLoad:
    """The engine's figures as reported after `since_unix_s` (by whichever frontend got them)."""

    async def reported() -> bool:
        load = await fronts.lifecycle.GetLoad(lpb.GetLoadRequest())
        return load.engines[0].unix_time_s > since_unix_s

    await eventually(reported, timeout_s=10)
    return (await fronts.lifecycle.GetLoad(lpb.GetLoadRequest())).engines[0]


async def test_load_and_vllm_metrics_count_the_requests_of_every_frontend(fronts):
    """The engine sends each step's scheduler figures to one frontend, the first with outputs:
    with requests on frontend 1 alone, frontend 0 used to report running=0 from stale figures,
    and vLLM's request counters left frontend 1's requests out."""
    on_follower = (await channels_of(fronts))[1]
    finished = "vllm:request_success_total"
    done_before = sum(v for (name, _), v in scrape(fronts.metrics_port).items() if name == finished)
    calls = [fronts.inference[i].GenerateStream(long_request(f"Pinned {i}:", 300)) for i in on_follower]
    await asyncio.gather(*(c.read() for c in calls))
    started = time.time()
    load = await fresh_load(fronts, started)
    assert load.num_running_requests + load.num_waiting_requests == len(on_follower)
    lasts = [(await read_rest(c))[-1].outputs.finish_info for c in calls]
    assert {f.finish_reason for f in lasts} == {LENGTH}

    async def all_counted() -> bool:
        samples = await asyncio.to_thread(scrape, fronts.metrics_port)
        return sum(v for (name, _), v in samples.items() if name == finished) == done_before + len(on_follower)

    await eventually(all_counted, timeout_s=10)


async def test_a_killed_frontend_is_noticed_by_its_process_cleared_and_started_again(fronts):
    """Last in the module: it kills frontend 1. Every request is frozen (pause KEEP) before the
    kill, so none can end on its own: the first figures the engine reports after the resume
    count exactly what it still runs, and without the abort they would count frontend 1's."""
    calls = [s.GenerateStream(long_request(f"Killed {i}:", 400)) for i, s in enumerate(fronts.inference)]
    await asyncio.gather(*(c.read() for c in calls))
    leader, follower = (await fronts.state()).frontends
    assert leader.num_open_requests + follower.num_open_requests == NUM_CHANNELS
    assert follower.num_open_requests > 0 and leader.num_open_requests > 0
    await fronts.control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
    os.kill(follower.pid, signal.SIGKILL)

    async def only_the_leader() -> bool:
        return [f.index for f in (await fronts.state()).frontends] == [0]

    # Dropped from GetState once its aborts went to the engine.
    await eventually(only_the_leader, timeout_s=10)
    assert (await fronts.state()).num_frontends == 2, "one configured frontend does not serve"
    before_resume = time.time()
    await fronts.control.ResumeGeneration(cpb.ResumeGenerationRequest())
    load = await fresh_load(fronts, before_resume)
    assert load.num_running_requests + load.num_waiting_requests == leader.num_open_requests
    outcomes = await asyncio.gather(*(read_rest(c) for c in calls), return_exceptions=True)
    lost = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(lost) == follower.num_open_requests
    assert {e.code() for e in lost} == {grpc.StatusCode.UNAVAILABLE}
    # The leader's own streams run to their end.
    finished = [o[-1].outputs.finish_info for o in outcomes if not isinstance(o, BaseException)]
    assert {f.finish_reason for f in finished} == {LENGTH}

    # Started again (on a spare engine socket pair), counted, and serving its share.
    async def restarted() -> bool:
        return [f.index for f in (await fronts.state()).frontends] == [0, 1]

    await eventually(restarted, timeout_s=120)
    again = (await fronts.state()).frontends[1]
    assert again.pid != follower.pid and again.num_restarts == 1
    assert not psutil.pid_exists(follower.pid)
    assert value(scrape(fronts.metrics_port), "rlserve_frontend_restarts_total", frontend="1") == 1
    # New connections reach it (the old ones went to frontend 0 when theirs broke).
    await fronts.close()
    fronts.open()
    placed = await channels_of(fronts)
    assert sorted(placed) == [0, 1], placed
    replies = await generate_on_every_channel(fronts)
    assert {r.outputs.finish_info.finish_reason for r in replies} == {LENGTH}


async def test_the_follower_takes_frontend_0s_tokens_and_reloads_and_sigterm_drains_them_all(tiny_model_dir, tmp_path):
    """The tokens file no longer parses when the follower starts: it takes frontend 0's tokens
    (it used to read the file itself and die, silently, leaving health SERVING on one process)."""
    tokens = tmp_path / "tokens"
    old, new = "read-token-old-0123456789", "read-token-new-0123456789"
    tokens.write_text(f"read {old} trainer\n")
    extra = ("--shutdown-grace-s", "30", "--auth-tokens-file", str(tokens))

    def break_the_file() -> None:
        tokens.write_text("superuser nonsense\n")

    async with frontends_server(tiny_model_dir, tmp_path, *extra, token=old, while_starting=break_the_file) as fronts:
        assert [f.num_restarts for f in (await fronts.state()).frontends] == [0, 0]

        async def generate_with(token: str) -> set:
            bearer = (("authorization", f"Bearer {token}"),)
            calls = (s.Generate(long_request(f"Auth {i}:", 4), metadata=bearer) for i, s in enumerate(fronts.inference))
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            return {o.code() if isinstance(o, grpc.aio.AioRpcError) else "OK" for o in outcomes}

        assert await generate_with(old) == {"OK"}
        assert all(f.num_requests for f in (await fronts.state()).frontends)
        tokens.write_text(f"read {new} trainer\n")
        os.kill(fronts.server.pid, signal.SIGHUP)  # to frontend 0 alone, as a supervisor would

        async def old_token_refused_everywhere() -> bool:
            return await generate_with(old) == {grpc.StatusCode.UNAUTHENTICATED}

        await eventually(old_token_refused_everywhere, timeout_s=10)
        assert await generate_with(new) == {"OK"}

        # SIGTERM while streams run in both processes: they end, then so does every process.
        bearer = (("authorization", f"Bearer {new}"),)
        processes = psutil.Process(fronts.server.pid).children(recursive=True)
        calls = [
            s.GenerateStream(long_request(f"Drained {i}:", 150), metadata=bearer)
            for i, s in enumerate(fronts.inference)
        ]
        await asyncio.gather(*(c.read() for c in calls))
        fronts.metadata = bearer
        assert all(await fronts.open_requests())
        os.kill(fronts.server.pid, signal.SIGTERM)
        lasts = [(await read_rest(c))[-1].outputs.finish_info for c in calls]
        assert {f.finish_reason for f in lasts} == {LENGTH}
        assert await asyncio.to_thread(fronts.server.process.wait, 60) == 0
        _, alive = psutil.wait_procs(processes, timeout=15)
        assert not alive, alive
