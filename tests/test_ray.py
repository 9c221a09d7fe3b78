"""`rlserve.sdk.ray.launch_fleet` on a real local Ray instance (started by this module, two CPUs):
servers as Ray actors, each an `rlserve serve` on the node's address with a token of its
own; the fleet syncs and routes across them; and nothing outlives the fleet, its close or
its driver's death (the engine core and workers included)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
import ray  # rlserve[ray]: `make install` installs it

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.sdk.client import Client, generate_request
from rlserve.sdk.fleet import FleetError
from rlserve.sdk.launch import free_port
from rlserve.wire.protocol import tensor_checksum

from helpers import ProcessLog, kill_tree, perturbed
from tiny_model import SERVE_ARGS

RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance with two CPUs, started by `ray start --head` in a process of its own;
    this process joins it, and its address lets another driver join it too. Started here by
    `ray.init()`, Ray forks its processes from this one, which runs many threads by then (the
    session's engines, gRPC), with a Python `preexec_fn` in the child, which Python documents
    can deadlock before the child runs anything. A full run once failed at that start: the
    raylet, forked last, never wrote its first log line, and ray.init gave up after 30 s (that
    deadlock is the likely cause; the child was gone before it could be looked at). Ray's token
    authentication is off for this local test cluster: a driver joining by address does not
    take the token `ray start` writes."""
    port, log = gcs_port(), ProcessLog("ray-head")
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--port", str(port), "--num-cpus", "2", "--include-dashboard", "false",
         "--object-store-memory", str(100 << 20), "--disable-usage-stats"],
        stdout=log.file, stderr=log.file, process_group=0, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.text():
            assert head.poll() is None, f"`ray start --head` exited with {head.returncode}: {log.tail()}"
            assert time.monotonic() < deadline, f"the Ray head did not start: {log.tail()}"
            time.sleep(0.5)
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        head.terminate()  # `ray start --block` stops the node's processes as it exits
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            kill_tree(head)
        log.close()


def gcs_port() -> int:
    """A free port outside the range Ray gives its workers (10002-19999 by default), which
    `ray start` refuses for its GCS."""
    while (port := free_port()) < 20_000:
        pass
    return port


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[str]:
    """The processes still running after `timeout_s` (name and pid), if any."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return [f"{p.pid} {p.name()}" for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_launch_fleet_starts_servers_as_actors_syncs_them_and_stops_them(ray_cluster, tiny_model_dir):
    from rlserve.sdk.ray import launch_fleet

    fleet = launch_fleet(2, tiny_model_dir, serve_args=SERVE_ARGS, ready_timeout_s=300, timeout_s=60)
    with fleet:
        node = ray.util.get_node_ip_address()
        assert len(fleet.servers) == 2 and all(s.startswith(f"{node}:") for s in fleet.servers)
        trees = [process_tree(ray.get(actor.pid.remote())) for actor in fleet.actors.values()]
        # The engine core and its worker under each server, so that the check below covers them.
        assert all(len(_engine_processes(tree)) >= 2 for tree in trees), [_names(tree) for tree in trees]
        # Off loopback the control plane wants the fleet's token; without it: refused.
        with Client(fleet.servers[0]) as anonymous, pytest.raises(grpc.RpcError) as refused:
            anonymous.server_info()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        weights = perturbed(tiny_model_dir, seed=31)
        stats = fleet.sync(weights, "ray-1")
        assert set(stats.servers) == set(fleet.servers)
        mine = {n: tensor_checksum(t) for n, t in weights.items()}
        for client in fleet.clients:
            lifecycle = lifecycle_pb2_grpc.LifecycleStub(client.channel)
            state = lifecycle.GetState(lpb.GetStateRequest())
            assert state.weight_version == "ray-1" and state.pause_phase == lpb.PAUSE_PHASE_RUNNING
            assert dict(lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest()).per_tensor) == mine

        prompts = [
            generate_request(f"Count to {i}", max_new_tokens=6, ignore_eos=True, temperature=0.0) for i in range(8)
        ]
        results = fleet.generate_many(prompts)
        assert all(not isinstance(r, BaseException) for r in results), results
        assert {r.server for r in results} == set(fleet.servers)
        assert all([s.weight_version for s in r.response.outputs.weight_version_spans] == ["ray-1"] for r in results)
        # The same weights on both: the same greedy tokens wherever a prompt ran.
        a, b = (c.generate(prompts[0]).outputs.token_ids for c in fleet.clients)
        assert list(a) == list(b)
        actors = list(fleet.actors.values())
    assert wait_gone([p for tree in trees for p in tree], timeout_s=30) == []
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.target.remote(), timeout=30)


def test_a_server_that_cannot_start_is_named_and_nothing_is_left(ray_cluster, tiny_model_dir):
    from rlserve.sdk.ray import launch_fleet

    with pytest.raises(FleetError, match=r"(?s)server \d of 2 did not start: .*exited with 2.*--no-such-flag"):
        launch_fleet(2, tiny_model_dir, serve_args=("--no-such-flag",), ready_timeout_s=60)
    # Resources the cluster does not have: bounded, and said so.
    started = time.monotonic()
    with pytest.raises(FleetError, match="(?s)not serving after 2 s.*resources"):
        launch_fleet(1, tiny_model_dir, serve_args=SERVE_ARGS, num_gpus=1, ready_timeout_s=2)
    assert time.monotonic() - started < 30
    assert _servers_running() == []


def test_the_servers_end_with_their_driver_however_it_ends(ray_cluster, tiny_model_dir, tmp_path):
    """`rlserve demo --num-servers 1` as a driver of this Ray instance: it trains through a
    server it launched on Ray; SIGKILLed, its job ends, Ray kills the actor (and the
    `rlserve serve` under it), and the engine core and its workers follow."""
    out = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "rlserve", "demo", "--num-servers", "1", "--model", str(tiny_model_dir),
         "--steps", "1000", "--minutes", "0", "--prompts-per-step", "2", "--group-size", "2",
         "--max-new-tokens", "4", "--out", str(out)],
        env={**os.environ, "RAY_ADDRESS": ray_cluster},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    tree: list[psutil.Process] = []
    output, problem = "", None
    try:
        while (found := re.search(r"via rlserve at (\S+):(\d+) ", output)) is None:
            line = demo.stdout.readline()
            if not line:
                problem = "the demo ended before it named its server"
                break
            output += line
        else:
            (server,) = [p for p in _servers_running() if f"--port {found[2]} " in " ".join(p.cmdline()) + " "]
            tree, problem = _engine_under(server, timeout_s=30)
            deadline = time.monotonic() + 120
            while problem is None and not ((out / "steps.jsonl").exists() and (out / "steps.jsonl").read_text()):
                if demo.poll() is not None or time.monotonic() > deadline:
                    problem = "no step was trained"
                time.sleep(0.5)
            # Now every engine process is up (the workers start after the engine core).
            tree = list({p.pid: p for p in [*tree, *process_tree(server.pid)]}.values())
    finally:
        demo.send_signal(signal.SIGKILL)
        demo.wait()
    # What the demo said up to its kill (it explains a demo that failed on its own).
    assert problem is None, f"{problem}; the demo's output:\n{(output + _unread(demo.stdout))[-4000:]}"
    assert wait_gone(tree, timeout_s=60) == []


def _unread(pipe) -> str:
    """What the pipe holds now, without waiting for a writer that may live on."""
    os.set_blocking(pipe.fileno(), False)
    try:
        return pipe.read() or ""
    except OSError:
        return ""


def _engine_under(server: psutil.Process, timeout_s: float) -> tuple[list[psutil.Process], str | None]:
    """The server's process tree once it holds an engine core, or what the tree held after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        tree = process_tree(server.pid)
        if _engine_processes(tree):
            return tree, None
        if time.monotonic() > deadline:
            return tree, f"no engine core under the server: {_names(tree)}"
        time.sleep(0.5)


def _engine_processes(tree: list[psutil.Process]) -> list[psutil.Process]:
    """The engine's processes in a server's tree: multiprocessing's spawned children (the
    engine core, and its workers under it). vLLM titles them VLLM::EngineCore and
    VLLM::Worker as they start (setproctitle), but under Ray CI runs have twice found a
    serving server with no such title in its tree, so the title alone does not tell."""
    found = []
    for p in tree:
        try:
            if "VLLM::" in p.name() or "multiprocessing.spawn" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _names(processes: list[psutil.Process]) -> list[str]:
    names = []
    for p in processes:
        try:
            names.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())[:120]}")
        except psutil.Error as e:
            names.append(f"{p.pid} {e!r}")
    return names


def _servers_running() -> list[psutil.Process]:
    """`rlserve serve` processes a launcher started (they run with --exit-with-parent)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        if "serve" in cmdline and "--exit-with-parent" in cmdline:
            found.append(p)
    return found
