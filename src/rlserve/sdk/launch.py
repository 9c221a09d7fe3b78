"""`rlserve serve` as a child process: started with its flags (secrets in its environment,
never on the command line), waited for until it serves, and stopped with its engine. What
`rlserve demo` starts when no server is named, and what each actor of `rlserve.sdk.ray` runs."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from rlserve.parent import LAUNCHER_PID_ENV
from rlserve.sdk.client import ChannelCredentials, Client


class ServerExited(RuntimeError):
    """The server process ended before it served (or while it was waited for)."""


class ServerProcess:
    """One `rlserve serve --host HOST --port PORT [args...]` in a process group of its own (a
    Ctrl-C meant for the launcher does not reach it), its output in `log_path`. It runs with
    `--exit-with-parent`, so it shuts itself down when the launcher goes, however it goes, also
    before it has looked: it is told the launcher's pid."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        log_path: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.host, self.port, self.log_path = host, port or free_port(host), log_path
        command = [
            sys.executable, "-m", "rlserve", "serve", "--host", host, "--port", str(self.port),
            "--exit-with-parent", *args,
        ]  # fmt: skip
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {}), LAUNCHER_PID_ENV: str(os.getpid())},
                process_group=0,
            )

    @property
    def target(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_serving(self, timeout_s: float = 600.0, credentials: ChannelCredentials | None = None) -> str:
        """Until the server reports SERVING (its engine has started); returns its target.
        Raises ServerExited (with the end of its log) if it exits first, TimeoutError after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with Client(self.target, credentials=credentials) as client:
            while True:
                if self.process.poll() is not None:
                    raise ServerExited(
                        f"the server for {self.target} exited with {self.process.returncode}:\n{self.log_tail()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the server at {self.target} did not serve within {timeout_s:.0f} s")
                try:
                    client.wait_ready(timeout_s=min(5.0, left))
                    return self.target
                except grpc.RpcError:
                    continue

    def wait_listening(self, timeout_s: float = 120.0) -> None:
        """Until the server answers health at all (it binds before its engine starts; a
        plaintext server: this asks without TLS).
        Raises ServerExited if it exits first, TimeoutError after `timeout_s`."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.process.poll() is not None:
                    raise ServerExited(f"the server for {self.target} exited with {self.process.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the server at {self.target} did not listen within {timeout_s:.0f} s")
                try:
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    return
                except grpc.RpcError:
                    time.sleep(0.1)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a graceful shutdown that stops the engine), SIGKILL after `timeout_s`.
        Returns the exit status; a second call returns it again."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - num_bytes))
                return f.read().decode(errors="replace")
        except OSError as e:
            return f"(no log: {e})"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing holds on `host` now, below the kernel's ephemeral range: a port handed
    out for bind(0) is released again, and the kernel may give it to an outgoing connection
    (the server's own engine sockets) before the server binds it. Another process may still
    take it first."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(200):
        port = random.randrange(max(1024, low - 16384), low)
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} on {host}")
