"""The gRPC server: binds first (health NOT_SERVING), starts or attaches the engine (SERVING),
and on shutdown reports NOT_SERVING, drains in-flight RPCs for a grace period (what is still
running or held just before it ends is aborted, so every request gets its terminal message),
then stops the engine.
While generation is paused or asleep `vllm.Inference` reports NOT_SERVING (a router drains
the server) and the server as a whole stays SERVING. When the engine dies (its process
exits, or it stops answering) everything goes NOT_SERVING and every call answers UNAVAILABLE;
the process stays up so that a supervisor sees it.

Owns the listeners, health and the credentials; not the engine's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rlserve.config import ServeConfig, is_loopback
from rlserve.engine.adapter import EngineAdapter
from rlserve.engine.shared import FrontendClient
from rlserve.errors import RlserveError
from rlserve.frontends.follower import FollowerLifecycle, LeaderLink
from rlserve.lifecycle.controller import LifecycleController
from rlserve.lifecycle.state import LifecycleState
from rlserve.model_cache import default_model_dir
from rlserve.parent import is_gone, parent_exited, take_launcher_pid
from rlserve.server import listeners
from rlserve.server.control import ControlServicer
from rlserve.server.frontends import PROCESS_TITLE, Frontends
from rlserve.server.health import NOT_SERVING, SERVING, Health
from rlserve.server.inference import InferenceServicer
from rlserve.server.lifecycle import LifecycleServicer
from rlserve.server.metrics import Metrics, MetricsEndpoint
from rlserve.server.slot import EngineSlot

logger = logging.getLogger(__name__)

# Requests still running this long before the shutdown grace ends are aborted.
ABORT_MARGIN_S = 1.0


class RlserveServer:
    """`inference_only`: a following frontend process of a server with several (see
    `rlserve.server.frontends`): vllm.Inference and its reads only, admitted by the leader."""

    def __init__(self, config: ServeConfig, inference_only: bool = False) -> None:
        self.config = config
        self.slot = EngineSlot()
        self._owns_engine = False
        self._frontends: Frontends | None = None
        self._health = Health()
        self._health_task: asyncio.Task[None] | None = None
        self.metrics = Metrics()
        # Set by Control/Shutdown; `serve` then stops as on SIGTERM.
        self.shutdown_requested = asyncio.Event()
        self._metrics_endpoint: MetricsEndpoint | None = None
        security = config.security
        control = config.control_address or config.address
        self.insecure_control = not security.auth_enabled and not is_loopback(control)
        self.credentials = listeners.credential_source(security)
        servicers = listeners.Servicers(
            inference=InferenceServicer(self.slot, config.limits),
            control=ControlServicer(self.slot, config.limits, on_shutdown=self._request_shutdown),
            lifecycle=LifecycleServicer(self.slot, insecure_control=self.insecure_control),
            health=self._health,
        )
        # A following frontend counts its RPCs in frontend 0's metrics (attach_follower).
        self._observe_rpc = self.metrics.observe_rpc
        self._listenings = listeners.build(
            config,
            servicers,
            self.credentials,
            self._record_refusal,
            lambda method, code, seconds: self._observe_rpc(method, code, seconds),
            inference_only,
        )

    @property
    def port(self) -> int:
        """The inference listener's port (the only one, unless control has its own)."""
        return self._listenings[0].port

    @property
    def control_port(self) -> int:
        return self._listenings[-1].port

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_endpoint.port if self._metrics_endpoint is not None else None

    async def start(self) -> int:
        """Bind and start answering (health NOT_SERVING); returns the inference port."""
        await self._set_health(NOT_SERVING)
        await listeners.start(self._listenings, self.config.security)
        for listening in self._listenings:
            logger.info("rlserve listening on %s (%s; engine starting)", listening.address, listening.kind.value)
        if self.config.metrics_port is not None:
            self._metrics_endpoint = MetricsEndpoint(self.metrics, self.config.host, self.config.metrics_port)
            logger.info("metrics on http://%s:%d/metrics", self.config.host, self._metrics_endpoint.port)
        if self.insecure_control:
            logger.warning(
                "the control plane listens on %s WITHOUT authentication (--insecure-control): anyone who "
                "can reach it can pause the server and replace its weights",
                self.config.control_address or self.config.address,
            )
        return self.port

    async def start_engine(self) -> None:
        """Start the configured engine off the event loop, so health keeps answering (also
        while the default model is converted, the first time)."""
        if self.config.engine.is_default_model:
            await asyncio.to_thread(default_model_dir, Path(self.config.engine.model))
        if self.config.num_frontends > 1:
            self._frontends = Frontends(self.config, run_follower)
            engine = await self._frontends.launch_engine()
        else:
            engine = await asyncio.to_thread(EngineAdapter.start, self.config.engine)
        self._owns_engine = True
        if self._frontends is None:
            await self.attach_engine(engine)
            return
        # Health says SERVING once every frontend process serves the port (each restarted as
        # needed); the control plane answers meanwhile.
        await self.attach_engine(engine, serve=False)
        await self._frontends.start(
            self.slot.lifecycle, engine, self.port, _inference_serving, self.credentials, self.metrics
        )
        await self._frontends.wait_ready()
        await self._serve_health(self.slot.lifecycle)

    async def attach_follower(self, engine: EngineAdapter, link: LeaderLink) -> None:
        """Serve as a following frontend: generation admitted by the leader over `link`, the
        leader's credentials (and every reload of them)."""
        self._owns_engine = True
        self._observe_rpc = link.observe_rpc
        self.slot.set_follower(engine, FollowerLifecycle(engine, link))
        engine.monitor.on_dead(self._engine_died)
        engine.monitor.start()
        await self._set_health(SERVING)

        def serving(is_serving: bool) -> None:
            asyncio.ensure_future(self._set_inference_health(is_serving))

        link.on_serving = serving
        link.on_credentials = self._take_credentials
        await self._set_inference_health(link.is_serving)

    def _take_credentials(self, tokens_text: str | None) -> None:
        if self.credentials is None or tokens_text is None:
            return  # the leader's never change kind: none stay none
        try:
            self.credentials.replace(tokens_text)
        except ValueError as e:  # the leader parsed them: a bug if this happens
            logger.error("kept the old auth tokens: frontend 0's do not parse here: %s", e)
            return
        logger.info("took the auth tokens frontend 0 reloaded")

    async def attach_engine(self, engine: EngineAdapter, serve: bool = True) -> None:
        """Serve an engine started elsewhere (tests share one); stop() will not shut it down.
        `serve=False`: health stays NOT_SERVING (the caller serves it later)."""
        config = self.config
        lifecycle = await LifecycleController.create(
            engine,
            max_held_requests=config.max_held_requests,
            max_held_bytes=config.max_held_bytes,
            transfer_timeout_s=config.transfer_timeout_s,
            lease_s=config.lease_s,
            max_transfer_info_bytes=config.limits.max_transfer_info_bytes,
            transfer_allowed_hosts=config.security.transfer_allowed_hosts,
        )
        self.slot.set(engine, lifecycle)
        lifecycle.observe(self.metrics)
        engine.monitor.on_dead(self._engine_died)
        engine.monitor.start()
        if serve:
            await self._serve_health(lifecycle)

    async def _serve_health(self, lifecycle: LifecycleController) -> None:
        if not self.slot.is_set:
            return  # the engine died meanwhile
        await self._set_health(SERVING)
        self._health_task = asyncio.ensure_future(self._follow(lifecycle))
        logger.info("rlserve serving %s", self.slot.engine.model_info().served_model_name)

    async def _follow(self, lifecycle: LifecycleController) -> None:
        """vllm.Inference is NOT_SERVING while generation is paused or asleep."""
        serving = None
        async for state in lifecycle.watch():
            now = _inference_serving(state)
            if now != serving:
                serving = now
                await self._set_inference_health(now)

    async def _set_inference_health(self, is_serving: bool) -> None:
        for name in listeners.INFERENCE_SERVICES:
            await self._health.set(name, SERVING if is_serving else NOT_SERVING)

    def _engine_died(self, reason: str) -> None:
        self.metrics.engine_died()
        if self.slot.is_set:
            self.slot.clear(reason)
            self._stop_following()
            asyncio.ensure_future(self._set_health(NOT_SERVING))

    def _record_refusal(self, operation: str, detail: str, outcome: str) -> None:
        lifecycle = self.slot.serving_or_none
        if lifecycle is not None:
            lifecycle.record(operation, detail, outcome)

    def _request_shutdown(self) -> None:
        # Shortly after, so that the RPC that asked gets its answer first.
        asyncio.get_running_loop().call_later(0.1, self.shutdown_requested.set)

    def reload_credentials(self) -> None:
        """SIGHUP: re-read the tokens file; a file that does not parse keeps the old tokens.
        The other frontend processes take what this one took."""
        if self.credentials is not None and self.credentials.reload() and self._frontends is not None:
            self._frontends.reload_credentials()

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, then refuse new RPCs and drain in-flight ones for `grace_s` seconds;
        RPCs still running after that are cancelled, which aborts their engine requests."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self._stop_following()
        await self._health.enter_graceful_shutdown()
        stopping = [asyncio.ensure_future(listening.server.stop(grace)) for listening in self._listenings]
        if self._frontends is not None:  # the other frontends drain alongside, for as long
            stopping.append(asyncio.ensure_future(self._frontends.stop(grace)))
        lifecycle = self.slot.serving_or_none
        if lifecycle is not None and grace > 0:
            # Shortly before the grace ends, what still runs or is held ends ABORTED: a terminal
            # message for every request rather than a cancelled call.
            _, running = await asyncio.wait(stopping, timeout=grace - min(ABORT_MARGIN_S, grace / 4))
            if running:
                logger.info("grace period ending: aborting the requests still in flight")
                with contextlib.suppress(RlserveError):
                    await lifecycle.abort_everything()
        await asyncio.gather(*stopping)
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
            self._metrics_endpoint = None
        engine = self.slot.engine_or_none
        self.slot.clear("the server is shutting down")
        if engine is not None and self._owns_engine:
            await engine.close()
            await asyncio.to_thread(engine.shutdown)
        if self._frontends is not None:
            await asyncio.to_thread(self._frontends.shutdown_engine)

    def _stop_following(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None

    async def _set_health(self, status: int) -> None:
        for name in ("", *listeners.SERVICE_NAMES):
            await self._health.set(name, status)


def _inference_serving(state: LifecycleState) -> bool:
    return not state.is_paused and not state.is_sleeping


async def serve(config: ServeConfig) -> None:
    """Run until SIGINT, SIGTERM or Control/Shutdown (or, with `exit_with_parent`, the exit of
    the process that started it), then shut down gracefully; SIGHUP re-reads the tokens."""
    launcher = take_launcher_pid() if config.exit_with_parent else None
    if launcher is not None and is_gone(launcher):
        logger.warning("the process that started this server (pid %d) is gone: not starting", launcher)
        return
    server = RlserveServer(config)
    await server.start()
    stop = server.shutdown_requested
    _stop_on_signals(stop, on_hangup=server.reload_credentials)
    orphan_watch = asyncio.create_task(set_when_orphaned(stop, launcher)) if launcher is not None else None
    engine_task = asyncio.create_task(server.start_engine())
    stop_task = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({engine_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if engine_task in done:
            engine_task.result()  # an engine that failed to start ends the server with its error
            freeze_startup_heap()
            await stop_task
        else:
            engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await engine_task
    finally:
        if orphan_watch is not None:
            orphan_watch.cancel()
        logger.info("shutting down: draining in-flight requests for up to %.1f s", config.shutdown_grace_s)
        await server.stop()


def freeze_startup_heap() -> None:
    """Moves what start-up allocated (vLLM, torch, the tokenizer: about 680,000 objects) out
    of the collector's reach. Unfrozen, each full collection while serving walks all of it and
    stops the event loop for 0.3-0.4 s on two cores (every call in flight waits); frozen, it
    walks only what serving allocated. vLLM's engine core does the same to its own heap."""
    gc.collect()
    gc.freeze()
    logger.info("%d start-up objects frozen out of the garbage collector's reach", gc.get_freeze_count())


def _stop_on_signals(stop: asyncio.Event, on_hangup: Callable[[], None]) -> None:
    """SIGINT and SIGTERM set `stop` (a graceful shutdown); SIGHUP calls `on_hangup`."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, on_hangup)


async def set_when_orphaned(stop: asyncio.Event, parent: int) -> None:
    """Set `stop` once `parent`, the process that started this one, has exited."""
    await parent_exited(parent)
    logger.warning("the process that started this server (pid %d) exited: shutting down", parent)
    stop.set()


def run_follower(config: ServeConfig, client: FrontendClient, leader_path: str, instance_id: str, index: int) -> None:
    """Frontend `index` of a server with several (`Frontends` starts it), titled
    `rlserve::frontend-N`, in a process group of its own (what it leaves behind when it dies
    is killed with the group): vllm.Inference on the shared port, with frontend 0's
    credentials, admitted by frontend 0, until SIGINT/SIGTERM, frontend 0's end, or the end of
    the process that started it."""
    import setproctitle

    os.setpgid(0, 0)
    setproctitle.setproctitle(f"{PROCESS_TITLE}-{index}")
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s [frontend {index}]: %(message)s"
    )
    import uvloop

    uvloop.run(_follow(config, client, leader_path, instance_id, index))


async def _follow(config: ServeConfig, client: FrontendClient, leader_path: str, instance_id: str, index: int) -> None:
    stop = asyncio.Event()
    # Tokens come from frontend 0, reloads too: a SIGHUP to the group changes nothing here.
    _stop_on_signals(stop, on_hangup=lambda: None)
    orphan_watch = asyncio.ensure_future(set_when_orphaned(stop, take_launcher_pid()))
    link = await LeaderLink.connect(leader_path, index)
    leader_watch = asyncio.ensure_future(_set_when_lost(link, stop))
    server = None
    try:
        tokens_text = await link.credentials()
        security = replace(config.security, auth_tokens_file=None, auth_tokens_text=tokens_text)
        server = RlserveServer(replace(config, security=security), inference_only=True)
        server.shutdown_requested = stop
        engine = await asyncio.to_thread(
            EngineAdapter.connect, config.engine, client, None, instance_id, link.forward_load
        )
        await server.start()
        await server.attach_follower(engine, link)
        freeze_startup_heap()
        link.ready()
        await stop.wait()
    finally:
        orphan_watch.cancel()
        leader_watch.cancel()
        if server is not None:
            await server.stop()
        link.close()


async def _set_when_lost(link: LeaderLink, stop: asyncio.Event) -> None:
    await link.lost.wait()
    logger.warning("the leading frontend is gone: shutting down")
    stop.set()
