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
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import control_pb2_grpc, inference_pb2_grpc
from rlserve.api.vllm import inference_pb2 as pb
from rlserve.sdk.client import generate_request
from rlserve.sdk.launch import free_port

from helpers import KEEP, ProcessLog, eventually, kill_tree, long_request, pause, read_rest, short_temp_dir
from tiny_model import SERVE_ARGS

START_S = 180


class Server:
    """`rlserve serve` launched now in a process group of its own (so the test can signal the
    whole group), waited for later; its log takes both streams (vLLM logs to stdout)."""

    def __init__(self, model: Path, grace_s: float, tmp: Path | None = None) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "rlserve.cli", "serve", "--model", str(model), "--port", str(self.port)]
        command += SERVE_ARGS
        command += ["--shutdown-grace-s", str(grace_s)]
        self.log = ProcessLog("serve")
        # `tmp`: the server's temp dir (TMPDIR), where the engine's sockets go.
        self.tmp = tmp
        env = None if tmp is None else {**os.environ, "TMPDIR": str(tmp)}
        self.proc = subprocess.Popen(command, process_group=0, stdout=self.log.file, stderr=self.log.file, env=env)

    async def serving(self) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + START_S
            while True:
                assert self.proc.poll() is None, self.log.tail()
                assert time.monotonic() < deadline, "the server did not start"
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                await asyncio.sleep(0.5)

    def close(self) -> None:
        kill_tree(self.proc)
        self.log.close()


@contextlib.asynccontextmanager
async def launched(*servers: Server | Launcher) -> AsyncIterator[None]:
    """Servers launched together, once all serve; killed when the block ends. A start is
    mostly one core importing vLLM in three processes in a row: here two at once took 1.4x
    one start (four at once, 3x), so this module starts its tests' servers in pairs."""
    try:
        await asyncio.gather(*(s.serving() for s in servers))
        yield
    finally:
        for server in servers:
            server.close()


@pytest_asyncio.fixture(scope="module")
async def drain_servers(tiny_model_dir):
    """The servers of the two drain tests (grace periods of 20 s and 4 s), the first with a
    temp dir of its own."""
    with short_temp_dir("server-tmp-") as tmp:
        servers = [Server(tiny_model_dir, 20, tmp), Server(tiny_model_dir, 4)]
        async with launched(*servers):
            yield servers


@pytest_asyncio.fixture(scope="module")
async def killed_servers(tiny_model_dir, tmp_path_factory):
    """The servers of the two kill tests: one to be SIGKILLed, and one under a launcher."""
    server, launcher = Server(tiny_model_dir, 5), Launcher(tiny_model_dir, tmp_path_factory.mktemp("launcher"))
    async with launched(server, launcher):
        yield server, launcher


@contextlib.asynccontextmanager
async def connected(server: Server) -> AsyncIterator[tuple[subprocess.Popen, grpc.aio.Channel, ProcessLog]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server.proc, channel, server.log


def engine_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


async def exited(proc: subprocess.Popen, within_s: float) -> int:
    await eventually(lambda: proc.poll() is not None, timeout_s=within_s, interval_s=0.1)
    return proc.returncode


def left_behind(processes: list[psutil.Process], timeout_s: float = 10) -> list[psutil.Process]:
    gone, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return alive


async def test_sigterm_to_the_whole_process_group_drains_in_flight_streams(drain_servers):
    async with connected(drain_servers[0]) as (proc, channel, log):
        inference = inference_pb2_grpc.InferenceStub(channel)
        engine = engine_processes(proc)
        assert engine and all(os.getpgid(p.pid) != proc.pid for p in engine), "the engine has a group of its own"
        tmp = drain_servers[0].tmp
        assert tmp is not None
        # vLLM's engine processes talk over Unix sockets in a directory of the engine's own,
        # which only this user can enter.
        (sockets,) = tmp.glob("rlserve-engine-*")
        assert sockets.stat().st_mode & 0o777 == 0o700 and any(p.is_socket() for p in sockets.iterdir())
        assert not [p for p in tmp.iterdir() if p.is_socket()]
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
        # ... removed with every socket in it once the engine stopped (vLLM leaves its own).
        assert not [p for p in tmp.rglob("*") if p.is_socket()] and not sockets.exists()
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


async def test_sigterm_ends_held_requests_aborted_before_the_grace_runs_out(drain_servers):
    grace_s = 4.0
    async with connected(drain_servers[1]) as (proc, channel, log):
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


async def test_a_server_killed_outright_leaves_no_engine_behind(killed_servers):
    """SIGKILL to the server alone (an OOM kill, `kill -9`): nothing can run in it, so its
    engine core notices it is gone (rlserve's vLLM plugin) and shuts down with its workers."""
    proc = killed_servers[0].proc
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


class Launcher:
    """A process that starts `rlserve serve` through `rlserve.sdk.launch.ServerProcess` (what
    the demo and each Ray actor run, with --exit-with-parent), says the server's pid, and
    says "serving" once it serves; the server's log is `log`."""

    def __init__(self, model: Path, tmp_path: Path) -> None:
        self.log = tmp_path / "server.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(self.log), "--model", str(model), *SERVE_ARGS],
            stdout=subprocess.PIPE,
        )
        self.server: psutil.Process | None = None

    async def serving(self) -> None:
        assert self.proc.stdout is not None
        readline = self.proc.stdout.readline
        self.server = psutil.Process(int(await asyncio.wait_for(asyncio.to_thread(readline), 30)))
        said = await asyncio.wait_for(asyncio.to_thread(readline), START_S)
        assert said == b"serving\n", self.log.read_text()[-3000:]

    def close(self) -> None:
        if self.server is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in self.server.children(recursive=True):
                    child.kill()
                self.server.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


async def test_a_launched_server_shuts_down_when_its_launcher_dies(killed_servers):
    """`ServerProcess` starts the server with --exit-with-parent: when the launcher is
    SIGKILLed, the server shuts down gracefully on its own and its engine with it."""
    launcher = killed_servers[1]
    server = launcher.server
    tree = [server, *server.children(recursive=True)]
    launcher.proc.kill()
    await asyncio.to_thread(launcher.proc.wait)
    alive = await asyncio.to_thread(left_behind, tree, 30)
    assert not alive, [p.name() for p in alive]
    text = launcher.log.read_text()
    assert "exited: shutting down" in text and "shutting down: draining" in text, text[-3000:]


GONE_AT_ONCE = """
import os, sys
from pathlib import Path
from rlserve.sdk.launch import ServerProcess
server = ServerProcess(sys.argv[2:], log_path=Path(sys.argv[1]))
print(server.pid, flush=True)
os._exit(0)
"""


async def test_a_server_whose_launcher_died_before_it_looked_does_not_start(tiny_model_dir, tmp_path):
    """A launcher that dies while its server still imports (a suite run saw Ray kill two
    actors for memory seconds into their servers' start): the server knows its launcher's pid
    from the launcher itself, sees it gone, and exits without starting an engine. Read from
    its own parent id after the imports, the launcher was init, and the orphans served on."""
    log = tmp_path / "server.log"
    args = ["--model", str(tiny_model_dir), *SERVE_ARGS]
    launcher = subprocess.run(
        [sys.executable, "-c", GONE_AT_ONCE, str(log), *args], capture_output=True, check=True, timeout=60
    )
    server = psutil.Process(int(launcher.stdout))
    try:
        alive = await asyncio.to_thread(left_behind, [server], 60)
        assert not alive, log.read_text()[-3000:]
        text = log.read_text()
        assert "is gone: not starting" in text and "EngineCore" not in text, text[-3000:]
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in [*server.children(recursive=True), server]:
                process.kill()
