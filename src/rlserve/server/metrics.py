"""Prometheus metrics: rlserve's own (`rlserve_*`: lifecycle, weight updates, RPCs) next to
vLLM's (`vllm:*`: requests, tokens, latencies, KV cache), on one `/metrics` endpoint.

Generation is counted once, by vLLM; rlserve adds what only it sees. The lifecycle figures come
from the state owner's observer feed, which sees every change in order."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.multiprocess import MultiProcessCollector

from rlserve.frontends.prometheus import multiprocess_directory
from rlserve.lifecycle.state import AuditEntry, LifecycleState, UpdateSession
from rlserve.types import PausePhase

logger = logging.getLogger(__name__)

# Lifecycle operations whose failures are counted by reason.
WEIGHT_OPERATIONS = frozenset(
    {
        "init_weight_transfer",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "start_lora_update",
        "finish_lora_update",
    }
)
# How a weight-update session ended, by the operation during which it ended.
SESSION_ENDINGS = {
    "finish_weight_update": "committed",
    "finish_lora_update": "committed",
    "abort_weight_update": "aborted",
    "session_lease_expired": "expired",
}
SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


class Metrics:
    """rlserve's metrics, in a registry of its own (several servers may share a process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.rpcs = Counter("rlserve_rpcs", "RPCs answered, by method and status code", ["method", "code"], registry=r)
        self.rpc_seconds = Histogram(
            "rlserve_rpc_duration_seconds",
            "RPC duration (streams: to their end)",
            ["method"],
            buckets=SECONDS,
            registry=r,
        )
        self.paused = Gauge("rlserve_generation_paused", "1 while generation is paused or draining", registry=r)
        self.asleep = Gauge("rlserve_asleep", "1 while any engine memory is asleep", registry=r)
        self.consistent = Gauge("rlserve_weights_consistent", "0 after a half-applied update", registry=r)
        self.transport_ready = Gauge("rlserve_weight_transport_ready", "1 while the trainer's group is up", registry=r)
        self.held = Gauge("rlserve_held_requests", "generation requests held while paused", registry=r)
        self.version = Info("rlserve_weight_version", "the weight version being served", registry=r)
        self.pause_seconds = Histogram(
            "rlserve_pause_duration_seconds", "how long each pause lasted", buckets=SECONDS, registry=r
        )
        self.sleep_seconds = Histogram(
            "rlserve_sleep_duration_seconds", "how long each sleep lasted", buckets=SECONDS, registry=r
        )
        self.updates = Counter(
            "rlserve_weight_updates",
            "weight-update sessions ended: committed, aborted, expired, failed",
            ["outcome"],
            registry=r,
        )
        self.update_bytes = Counter("rlserve_weight_update_bytes", "bytes received by committed updates", registry=r)
        self.update_seconds = Histogram(
            "rlserve_weight_update_duration_seconds",
            "start to finish of each committed update",
            buckets=SECONDS,
            registry=r,
        )
        self.update_failures = Counter(
            "rlserve_weight_update_failures",
            "failed weight-transfer calls, by operation and reason (error)",
            ["operation", "reason"],
            registry=r,
        )
        self.engine_alive = Gauge("rlserve_engine_alive", "0 once the engine is dead", registry=r)
        self.frontend_restarts = Counter(
            "rlserve_frontend_restarts",
            "frontend processes started again after theirs exited unasked (--frontends), by frontend",
            ["frontend"],
            registry=r,
        )
        self.frontends_serving = Gauge(
            "rlserve_frontends_serving", "frontend processes serving the inference port", registry=r
        )
        self.frontends_serving.set(1)
        self._paused_at: float | None = None
        self._asleep_at: float | None = None
        self._ended: UpdateSession | None = None

    # Sources ---------------------------------------------------------------------------

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpcs.labels(method, code).inc()
        self.rpc_seconds.labels(method).observe(seconds)

    def published(self, before: LifecycleState, after: LifecycleState) -> None:
        now = time.monotonic()
        paused = after.pause_phase is not PausePhase.RUNNING
        if paused and self._paused_at is None:
            self._paused_at = now
        elif not paused and self._paused_at is not None:
            self.pause_seconds.observe(now - self._paused_at)
            self._paused_at = None
        asleep = bool(after.asleep)
        if asleep and self._asleep_at is None:
            self._asleep_at = now
        elif not asleep and self._asleep_at is not None:
            self.sleep_seconds.observe(now - self._asleep_at)
            self._asleep_at = None
        if before.update_session is not None and after.update_session is None:
            self._ended = before.update_session
        self.paused.set(paused)
        self.asleep.set(asleep)
        self.consistent.set(after.weights_consistent)
        self.transport_ready.set(after.transport_ready)
        self.held.set(after.num_held_requests)
        self.version.info({"weight_version": after.weight_version})
        self.engine_alive.set(1)

    def recorded(self, entry: AuditEntry) -> None:
        ok = entry.outcome in ("ok", "noop")
        if entry.operation in WEIGHT_OPERATIONS and not ok:
            self.update_failures.labels(entry.operation, entry.outcome).inc()
        if self._ended is None or entry.operation not in WEIGHT_OPERATIONS | SESSION_ENDINGS.keys():
            return  # (a resume recorded inside the lease expiry comes before the expiry's entry)
        ended, self._ended = self._ended, None
        outcome = SESSION_ENDINGS.get(entry.operation, "failed") if ok else "failed"
        self.updates.labels(outcome).inc()
        if outcome == "committed":
            self.update_bytes.inc(ended.num_bytes)
            self.update_seconds.observe(max(0.0, entry.unix_time_s - ended.started_unix_s))

    def engine_died(self) -> None:
        self.engine_alive.set(0)


class MetricsEndpoint:
    """`/metrics` over HTTP: rlserve's registry and vLLM's metrics: prometheus_client's global
    registry, where vLLM registers them, or with several frontend processes what all of them
    wrote (`rlserve.frontends.prometheus`), vLLM's alone (rlserve's own are this process's)."""

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        directory = multiprocess_directory()
        vllm = prometheus_client.REGISTRY if directory is None else _VllmOnly(MultiProcessCollector(None, directory))
        both = _Registries(vllm, metrics.registry)
        self._server, self._thread = prometheus_client.start_http_server(port, host, registry=both)

    @property
    def port(self) -> int:
        server: WSGIServer = self._server
        return server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _VllmOnly:
    def __init__(self, collector: MultiProcessCollector) -> None:
        self._collector = collector

    def collect(self):
        return (family for family in self._collector.collect() if family.name.startswith("vllm:"))


class _Collects(Protocol):
    def collect(self) -> Iterable[Any]: ...


class _Registries:
    def __init__(self, *registries: _Collects) -> None:
        self._registries = registries

    def collect(self):
        for registry in self._registries:
            yield from registry.collect()
