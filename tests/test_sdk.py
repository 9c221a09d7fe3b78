"""The trainer SDK against a server that accepts connections and never answers (a hung or
wedged server): every call ends at its deadline instead of waiting forever. No engine."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import torch

from rlserve.sdk.client import Client
from rlserve.sdk.weight_sync import WeightSync, WeightSyncError


@pytest.fixture
def silent_server():
    """A TCP listener that accepts and then says nothing."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    listener.close()


@pytest.mark.parametrize("step", ["init", "sync"])
def test_every_sdk_call_has_a_deadline(silent_server, step):
    with Client(silent_server) as client:
        sync = WeightSync(client, timeout_s=5.0, rpc_timeout_s=1.0)
        try:
            t0 = time.perf_counter()
            # init is a bare call; a sync says nothing changed, with the call's status.
            with pytest.raises(grpc.RpcError if step == "init" else WeightSyncError) as e:
                sync.init() if step == "init" else sync.sync({"w": torch.zeros(2)}, "never")
            code = e.value.code() if step == "init" else e.value.code
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert step == "init" or e.value.resumed_on_old_weights
            assert time.perf_counter() - t0 < 3
        finally:
            sync.close()
