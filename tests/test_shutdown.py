"""`rlserve serve` as a process, stopped the way supervisors stop it: SIGTERM to the server, and
SIGTERM to its whole process group (systemd's default, `kill -- -PGID`). Requests in flight
finish within the grace period, held ones end ABORTED with their terminal message, the server
exits 0, and no engine process is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import control_pb2_grpc, inference_pb2_grpc
from rlserve.api.vllm import inference_pb2 as pb
from rlserve.sdk.client import generate_request
from rlserve.sdk.launch import free_port

from helpers import KEEP, ProcessLog, eventually, kill_tree, long_request, pause, read_rest

START_S = 180


@contextlib.asynccontextmanager
async def rlserve_process(
    model: Path, grace_s: float
) -> AsyncIterator[tuple[subprocess.Popen, grpc.aio.Channel, ProcessLog]]:
    """A server in a process group of its own (so the test can signal the whole group), and
    its log (both streams: vLLM logs to stdout)."""
    port = free_port()
    command = [sys.executable, "-m", "rlserve.cli", "serve", "--model", str(model), "--port", str(port)]
    command += ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--kv-cache-gib", "0.5"]
    command += ["--shutdown-grace-s", str(grace_s)]
    log = ProcessLog("serve")
    proc = subprocess.Popen(command, process_group=0, stdout=log.file, stderr=log.file)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + START_S
            while True:
                assert proc.poll() is None, log.tail()
                assert time.monotonic() < deadline, "the server did not start"
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                await asyncio.sleep(0.5)
            yield proc, channel, log
    finally:
        kill_tree(proc)
        log.close()


def engine_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


async def exited(proc: subprocess.Popen, within_s: float) -> int:
    await eventually(lambda: proc.poll() is not None, timeout_s=within_s, interval_s=0.1)
    return proc.returncode


def left_behind(processes: list[psutil.Process], timeout_s: float = 10) -> list[psutil.Process]:
    gone, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return alive


async def test_sigterm_to_the_whole_process_group_drains_in_flight_streams(tiny_model_dir):
    async with rlserve_process(tiny_model_dir, grace_s=20) as (proc, channel, log):
        inference = inference_pb2_grpc.InferenceStub(channel)
        engine = engine_processes(proc)
        assert engine and all(os.getpgid(p.pid) != proc.pid for p in engine), "the engine has a group of its own"
        stream = inference.GenerateStream(long_request("in flight", max_new_tokens=300))
        first = await stream.read()
        os.killpg(proc.pid, signal.SIGTERM)  # the engine processes are not in this group
        rest = await read_rest(stream)
        tokens = sum(r.outputs.num_tokens for r in (first, *rest))
        final = rest[-1].outputs.finish_info
        assert tokens == 300 and final.finish_reason == pb.FinishInfo.LENGTH
        assert (await stream.code()) == grpc.StatusCode.OK
        assert await exited(proc, 30) == 0, log.tail()
        assert not left_behind(engine)
        # A clean shutdown logs no error: vLLM's output handler, left running while the engine
        # stopped, used to log the engine's death with a traceback.
        said = log.text()
        assert "Traceback" not in said and " ERROR " not in said, said[-3000:]
        # The server says how its engine processes ended: cleanly, not SIGKILLed by vLLM 5 s
        # after its SIGTERM (what keeps them within it: rlserve.worker.lifetime, whose test is
        # tests/test_lifetime.py; here they had got out just in time before it).
        assert re.search(r"engine process \S+ exited cleanly", said), said[-3000:]
        assert not re.search(r"engine process \S+ (ended with|is still running)", said), said[-3000:]
        # Start-up's heap was frozen once serving: a full collection no longer walks it.
        frozen = re.search(r"(\d+) start-up objects frozen", said)
        assert frozen and int(frozen[1]) > 100_000, said[-3000:]


async def test_sigterm_ends_held_requests_aborted_before_the_grace_runs_out(tiny_model_dir):
    grace_s = 4.0
    async with rlserve_process(tiny_model_dir, grace_s=grace_s) as (proc, channel, log):
        inference, control = inference_pb2_grpc.InferenceStub(channel), control_pb2_grpc.ControlStub(channel)
        engine = engine_processes(proc)
        await pause(control, KEEP)
        held = asyncio.ensure_future(inference.Generate(generate_request("held", max_new_tokens=4)))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out = await asyncio.wait_for(held, grace_s + 5)
        assert out.outputs.finish_info.finish_reason == pb.FinishInfo.ABORTED
        assert time.monotonic() - t0 < grace_s, "ended before the grace period ran out"
        assert await exited(proc, 30) == 0, log.tail()
        assert not left_behind(engine)
        with pytest.raises(grpc.aio.AioRpcError):
            await control.ResumeGeneration(cpb.ResumeGenerationRequest(), timeout=2)


async def test_a_server_killed_outright_leaves_no_engine_behind(tiny_model_dir):
    """SIGKILL to the server alone (an OOM kill, `kill -9`): nothing can run in it, so its
    engine core notices it is gone (rlserve's vLLM plugin) and shuts down with its workers."""
    async with rlserve_process(tiny_model_dir, grace_s=5) as (proc, _, _log):
        engine = engine_processes(proc)
        assert any("EngineCor" in p.name() for p in engine)
        proc.kill()
        assert await exited(proc, 10) == -signal.SIGKILL
        alive = await asyncio.to_thread(left_behind, engine, 30)
        assert not alive, [p.name() for p in alive]


LAUNCHER = """
import sys, time
from pathlib import Path
from rlserve.sdk.launch import ServerProcess
server = ServerProcess(sys.argv[2:], log_path=Path(sys.argv[1]))
print(server.pid, flush=True)
server.wait_serving(180)
print("serving", flush=True)
time.sleep(3600)
"""


async def test_a_launched_server_shuts_down_when_its_launcher_dies(tiny_model_dir, tmp_path):
    """`rlserve.sdk.launch.ServerProcess` (what the demo and each Ray actor run) starts the server
    with --exit-with-parent: when the launcher is SIGKILLed, the server shuts down gracefully
    on its own and its engine with it."""
    log = tmp_path / "server.log"
    args = ["--model", str(tiny_model_dir), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
    launcher = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LAUNCHER, str(log), *args, "--kv-cache-gib", "0.25", stdout=asyncio.subprocess.PIPE
    )
    try:
        server = psutil.Process(int(await asyncio.wait_for(launcher.stdout.readline(), 30)))
        assert await asyncio.wait_for(launcher.stdout.readline(), START_S) == b"serving\n", log.read_text()[-3000:]
        tree = [server, *server.children(recursive=True)]
        launcher.kill()
        await launcher.wait()
        alive = await asyncio.to_thread(left_behind, tree, 30)
        assert not alive, [p.name() for p in alive]
        text = log.read_text()
        assert "exited: shutting down" in text and "shutting down: draining" in text, text[-3000:]
    finally:
        if launcher.returncode is None:
            launcher.kill()
