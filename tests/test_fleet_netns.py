"""A fleet across hosts, as far as one machine can tell: two `rlserve serve` processes in a
network namespace of their own, reached over a veth pair, authentication on; the trainer in
the root namespace. Nothing is on a shared loopback: a trainer address, a gloo device or a
store that only works on 127.0.0.1 fails here. Needs root (`ip netns`); CI runs as root.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import uuid

import grpc
import psutil
import pytest
import pytest_asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.sdk.client import ChannelCredentials, Client
from rlserve.sdk.fleet import Fleet, FleetError
from rlserve.sdk.launch import free_port
from rlserve.wire.protocol import tensor_checksum

from helpers import perturbed
from tiny_model import SERVE_ARGS

TRAINER_IP, SERVER_IP = "10.231.0.1", "10.231.0.2"
TOKEN = "fleet-admin-" + uuid.uuid4().hex
TIMEOUT_S = 20.0


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def namespace():
    # A failure, not a skip: CI runs as root, and must run this.
    assert os.geteuid() == 0 and shutil.which("ip"), "needs root and iproute2 (ip netns): CI runs as root"
    name = f"rlserve-{os.getpid()}"
    veth = f"rlv{os.getpid() % 100000}"
    ip("netns", "add", name)
    try:
        ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        ip("link", "set", f"{veth}p", "netns", name)
        ip("addr", "add", f"{TRAINER_IP}/24", "dev", veth)
        ip("link", "set", veth, "up")
        ip("netns", "exec", name, "ip", "addr", "add", f"{SERVER_IP}/24", "dev", f"{veth}p")
        ip("netns", "exec", name, "ip", "link", "set", f"{veth}p", "up")
        ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("link", "del", veth)
        ip("netns", "del", name)


@pytest_asyncio.fixture(scope="module")
async def servers(namespace, tiny_model_dir, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text(f"admin {TOKEN} trainer\n")
    procs, targets = [], []
    try:
        for port in (50061, 50062):
            cmd = [
                "ip", "netns", "exec", namespace,
                sys.executable, "-m", "rlserve", "serve", "--model", str(tiny_model_dir),
                "--host", SERVER_IP, "--port", str(port), "--auth-tokens-file", str(tokens),
                *SERVE_ARGS,
                "--weight-transfer-backend", "rlserve_gloo", "--transfer-timeout-s", str(TIMEOUT_S),
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0))
            targets.append(f"{SERVER_IP}:{port}")
        for target in targets:
            with Client(target) as client:  # health needs no credentials
                await asyncio.to_thread(client.wait_ready, 300)
        yield targets
    finally:
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
            proc.kill()
            proc.wait()


def admin() -> ChannelCredentials:
    return ChannelCredentials(token=TOKEN)


async def test_a_fleet_syncs_servers_in_another_network_namespace(servers, tiny_model_dir):
    weights = perturbed(tiny_model_dir, seed=31)
    port = free_port()
    with Fleet(servers, credentials=admin(), master_address=TRAINER_IP, master_port=port, timeout_s=TIMEOUT_S) as fleet:
        await asyncio.to_thread(fleet.init)
        # The rendezvous is where it was asked to be: the trainer's address on the veth, that port.
        assert fleet.master == (TRAINER_IP, port)
        stats = await asyncio.to_thread(fleet.sync, weights, "across")
        assert stats.servers == tuple(servers)
        routed = await asyncio.to_thread(fleet.generate_many, ["Hi"] * 6, max_new_tokens=2)
        assert all(not isinstance(r, BaseException) and r.server in servers for r in routed)
    mine = {n: tensor_checksum(t) for n, t in weights.items()}
    for target in servers:
        with Client(target, credentials=admin()) as client:
            lifecycle = lifecycle_pb2_grpc.LifecycleStub(client.channel)
            state = await asyncio.to_thread(lifecycle.GetState, lpb.GetStateRequest())
            digests = await asyncio.to_thread(lifecycle.GetWeightChecksum, lpb.GetWeightChecksumRequest())
        assert state.weight_version == "across" and dict(digests.per_tensor) == mine


async def test_without_credentials_the_fleet_names_the_server_that_refuses(servers):
    with Fleet(servers, master_address=TRAINER_IP, timeout_s=TIMEOUT_S) as fleet:
        with pytest.raises(FleetError, match=f"{servers[0]}: UNAUTHENTICATED"):
            await asyncio.to_thread(fleet.init)


async def test_a_trainer_address_the_servers_cannot_reach_fails_clearly(servers):
    """127.0.0.1 is the servers' own loopback in their namespace: nobody listens there."""
    with Fleet(servers, credentials=admin(), master_address="127.0.0.1", timeout_s=5) as fleet:
        with pytest.raises(FleetError, match="rendezvous failed") as e:
            await asyncio.to_thread(fleet.init)
    assert any(code in str(e.value) for code in ("DEADLINE_EXCEEDED", "UNAVAILABLE", "trainer's side"))
    with Client(servers[0], credentials=admin()) as client:
        try:
            info = await asyncio.to_thread(client.server_info)
        except grpc.RpcError as err:  # pragma: no cover - the server must still answer
            pytest.fail(f"the server stopped answering: {err}")
    assert info.rl_capabilities.weight_transfer_backend == "rlserve_gloo"
