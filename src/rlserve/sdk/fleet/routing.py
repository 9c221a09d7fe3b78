"""Rollouts across a fleet: every request goes to one server, chosen here.

- **Session affinity**: requests with the same `session_id` go to the server that took the
  session's first request (its prefix cache holds the session's context), while that server
  can serve; otherwise the session moves to the server chosen for it now.
- **Least outstanding requests**, as this router counts them, among the servers that serve.
- **Only servers that serve**: each server's `vllm.Inference` health is watched (it reports
  NOT_SERVING while generation is paused or asleep, while the server shuts down, and a dead
  server's watch fails). When no server serves, the request goes to the least loaded one
  anyway: a paused server holds it until resume.
- **Retries only where nothing ran**: a server that answers UNAVAILABLE before any output
  (it is down, starting, or stopping) is marked down and the request goes to another one,
  each server tried at most once. Every request ends with one result or one error.

Every output says which server produced it; its tokens keep their weight-version spans.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlserve.api.vllm import inference_pb2
from rlserve.sdk.client import Client, Prompt

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
# After a watch ends (the server went away), before watching it again.
REWATCH_S = 1.0
# How long a request waits for a new server's first health report.
FIRST_REPORT_S = 2.0


@dataclass(frozen=True)
class Routed:
    """One response and the server (its address) that produced it."""

    server: str
    response: inference_pb2.GenerateResponse


class NoServer(RuntimeError):
    """Every server of the fleet failed the request before producing anything."""


class _Watch:
    """One server's `vllm.Inference` health, kept current by a background stream."""

    def __init__(self, client: Client) -> None:
        self.serving = False
        # Set at the first report (or the first failure to get one).
        self.reported = threading.Event()
        self._stop = threading.Event()
        self._call: Any = None
        self.target = client.target
        self._stub = health_pb2_grpc.HealthStub(client.channel)
        self._thread = threading.Thread(target=self._run, name=f"rlserve-watch-{client.target}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        request = health_pb2.HealthCheckRequest(service=INFERENCE_SERVICE)
        while not self._stop.is_set():
            try:
                self._call = self._stub.Watch(request)
                for update in self._call:
                    self.serving = update.status == health_pb2.HealthCheckResponse.SERVING
                    self.reported.set()
            except grpc.RpcError:
                pass
            except ValueError:  # the channel was closed: the server left the fleet
                self._stop.set()
            self.serving = False
            self.reported.set()
            self._stop.wait(REWATCH_S)

    def close(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()


class FleetRouter:
    """Routes requests over the clients `members()` returns at each request (a fleet's
    membership may change between requests). Thread-safe."""

    def __init__(self, members: Callable[[], Sequence[Client]], *, max_sessions: int = 100_000) -> None:
        self._members = members
        self._lock = threading.Lock()
        self._watches: dict[str, _Watch] = {}
        self._outstanding: dict[str, int] = {}
        # Requests sent to each server (retries included).
        self._routed: dict[str, int] = {}
        # session_id -> server, oldest first; bounded (a new session evicts the oldest).
        self._sessions: dict[str, str] = {}
        self._max_sessions = max_sessions

    def outstanding(self) -> dict[str, int]:
        with self._lock:
            return dict(self._outstanding)

    def routed(self) -> dict[str, int]:
        """How many requests went to each server so far (a retry counts where it went)."""
        with self._lock:
            return dict(self._routed)

    def server_of(self, session_id: str) -> str | None:
        with self._lock:
            return self._sessions.get(session_id)

    def generate(
        self, prompt: Prompt, *, session_id: str | None = None, timeout_s: float | None = None, **kw: Any
    ) -> Routed:
        """One unary Generate on the chosen server; raises the server's grpc.RpcError, or
        NoServer."""
        tried: set[str] = set()
        while True:
            client = self._acquire(session_id, tried)
            try:
                return Routed(client.target, client.generate(prompt, timeout_s=timeout_s, **kw))
            except grpc.RpcError as e:
                if not self._retryable(e, client, tried):
                    raise
            finally:
                self._release(client)

    def stream(
        self, prompt: Prompt, *, session_id: str | None = None, timeout_s: float | None = None, **kw: Any
    ) -> Generator[Routed, None, None]:
        """GenerateStream on the chosen server, retried elsewhere only before its first output."""
        tried: set[str] = set()
        while True:
            client = self._acquire(session_id, tried)
            started = False
            call = client.stream(prompt, timeout_s=timeout_s, **kw)
            try:
                for response in call:
                    started = True
                    yield Routed(client.target, response)
                return
            except grpc.RpcError as e:
                if started or not self._retryable(e, client, tried):
                    raise
            finally:
                call.cancel()  # a no-op once it ended; ends it when the caller left early
                self._release(client)

    def generate_many(
        self,
        prompts: Sequence[Prompt],
        *,
        session_ids: Sequence[str | None] | None = None,
        max_concurrency: int = 64,
        **kw: Any,
    ) -> list[Routed | BaseException]:
        """Every prompt's result in order, or the error it ended with (nothing is dropped)."""
        sessions = list(session_ids) if session_ids is not None else [None] * len(prompts)
        if len(sessions) != len(prompts):
            raise ValueError("one session id (or None) per prompt")

        def one(args: tuple[Prompt, str | None]) -> Routed | BaseException:
            try:
                return self.generate(args[0], session_id=args[1], **kw)
            except Exception as e:  # the request's outcome, returned in its place
                return e

        with ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(prompts)))) as pool:
            return list(pool.map(one, zip(prompts, sessions, strict=True)))

    def close(self) -> None:
        with self._lock:
            watches, self._watches = list(self._watches.values()), {}
        for watch in watches:
            watch.close()

    # Choosing ----------------------------------------------------------------------------

    def _acquire(self, session_id: str | None, tried: set[str]) -> Client:
        members = [c for c in self._members() if c.target not in tried]
        if not members:
            raise NoServer(f"no server of the fleet could take the request (tried {sorted(tried)})")
        for watch in self._watch(members):
            watch.reported.wait(FIRST_REPORT_S)
        with self._lock:
            serving = [c for c in members if self._watches[c.target].serving]
            candidates = serving or members
            chosen = None
            if session_id is not None:
                target = self._sessions.get(session_id)
                chosen = next((c for c in candidates if c.target == target), None)
            if chosen is None:
                counter = itertools.count()
                chosen = min(candidates, key=lambda c: (self._outstanding.get(c.target, 0), next(counter)))
                if session_id is not None:
                    self._remember(session_id, chosen.target)
            self._outstanding[chosen.target] = self._outstanding.get(chosen.target, 0) + 1
            self._routed[chosen.target] = self._routed.get(chosen.target, 0) + 1
            return chosen

    def _release(self, client: Client) -> None:
        with self._lock:
            self._outstanding[client.target] -= 1

    def _retryable(self, error: grpc.RpcError, client: Client, tried: set[str]) -> bool:
        """UNAVAILABLE before any output: the server did not run the request."""
        if error.code() != grpc.StatusCode.UNAVAILABLE:
            return False
        tried.add(client.target)
        with self._lock:
            watch = self._watches.get(client.target)
            if watch is not None:
                watch.serving = False
        return True

    def _remember(self, session_id: str, target: str) -> None:
        self._sessions.pop(session_id, None)
        self._sessions[session_id] = target
        while len(self._sessions) > self._max_sessions:
            self._sessions.pop(next(iter(self._sessions)))

    def _watch(self, members: Sequence[Client]) -> list[_Watch]:
        """A watch per member (the new ones are returned); those of servers that left are
        closed."""
        current = {c.target for c in self._members()}
        with self._lock:
            new = [_Watch(c) for c in members if c.target not in self._watches]
            self._watches.update((w.target, w) for w in new)
            gone = [self._watches.pop(t) for t in [t for t in self._watches if t not in current]]
        for watch in gone:
            watch.close()
        return new
