"""rlserve on Ray (`pip install rlserve[ray]`): `launch_fleet` starts rlserve servers as Ray
actors and returns the `Fleet` that drives them.

Each actor holds the resources asked for (Ray places it; rlserve schedules nothing) and runs
one `rlserve serve` as its child on the node Ray chose, listening on that node's address with
a bearer token made for this fleet (in the server's environment, never on a command line).
The child gets the actor's view of the node (CUDA_VISIBLE_DEVICES and the like) and shuts
itself down when the actor goes, however the actor goes (`--exit-with-parent`); Ray ends a
job's actors when its driver exits. `RayFleet.close()` stops every server at once and is
also run at interpreter exit.

    import rlserve.sdk.ray
    with rlserve.sdk.ray.launch_fleet(2, "/models/policy", num_gpus=1) as fleet:
        fleet.sync(model, "1")
        fleet.generate_many(prompts)
"""

from __future__ import annotations

import atexit
import secrets
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from rlserve.config import AUTH_TOKENS_ENV
from rlserve.sdk.client import ChannelCredentials
from rlserve.sdk.fleet import Fleet, FleetError
from rlserve.sdk.launch import ServerProcess
from rlserve.wire.protocol import BACKEND_NAME

# Beyond a server's own start-up deadline: the time Ray may take to place its actor.
PLACE_SLACK_S = 10.0


class ServerActor:
    """A Ray actor that owns one `rlserve serve` on its node (see the module doc)."""

    def __init__(self, args: Sequence[str], tokens: str, log_path: str) -> None:
        self._server = ServerProcess(
            args, host=ray.util.get_node_ip_address(), env={AUTH_TOKENS_ENV: tokens}, log_path=Path(log_path)
        )

    def target(self) -> str:
        return self._server.target

    def pid(self) -> int:
        return self._server.pid

    def wait_serving(self, timeout_s: float) -> str:
        return self._server.wait_serving(timeout_s)

    def stop(self) -> int:
        return self._server.stop()


class RayFleet(Fleet):
    """A `Fleet` whose servers are Ray actors it started: `close()` also stops them (and
    `remove()` stops the one removed). `actors`: server name -> actor handle."""

    def __init__(self, actors: Mapping[str, Any], **kw: Any) -> None:
        super().__init__(list(actors), **kw)
        self.actors = dict(actors)
        self._closed = False
        atexit.register(self.close)

    def remove(self, server: str) -> None:
        super().remove(server)
        actor = self.actors.pop(server, None)  # None: a server added by address, not launched here
        if actor is not None:
            _stop([actor])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        super().close()
        _stop(list(self.actors.values()))


def launch_fleet(
    num_servers: int,
    model: str | Path = "",
    *,
    serve_args: Sequence[str] = (),
    num_cpus: float = 1,
    num_gpus: float = 0,
    resources: Mapping[str, float] | None = None,
    actor_options: Mapping[str, Any] | None = None,
    ready_timeout_s: float = 600.0,
    log_dir: str | Path | None = None,
    init: bool = True,
    **fleet_options: Any,
) -> RayFleet:
    """Start `num_servers` rlserve servers of `model` (a model directory every node can read;
    "" for the default model) as Ray actors, each holding `num_cpus`, `num_gpus` and
    `resources`; `actor_options` go to Ray's `.options()` as well (a scheduling strategy, a
    placement group, a runtime env). `serve_args`: more `rlserve serve` flags, e.g.
    `("--dtype", "bfloat16", "--max-model-len", "4096")`; the weight transfer is rlserve_gloo
    unless they name another. Waits up to `ready_timeout_s` for every server to serve, then
    (with `init`) runs `Fleet.init()`. `fleet_options` go to `Fleet` (timeouts, bucket
    sizes); the trainer's address is this node's. Connects to Ray with `ray.init()` unless
    it is connected already. A server that does not come up raises FleetError naming it, and
    every server started is stopped."""
    if num_servers < 1:
        raise ValueError("num_servers must be at least 1")
    if not ray.is_initialized():
        ray.init()
    token = secrets.token_urlsafe(32)
    args = [*(("--model", str(model)) if model else ()), *serve_args]
    if "--weight-transfer-backend" not in args:
        args += ["--weight-transfer-backend", BACKEND_NAME]
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.gettempdir()) / "rlserve-ray" / uuid.uuid4().hex[:8]
    options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": dict(resources or {}), **(actor_options or {})}
    # Two calls at once: stop() answers while wait_serving() still waits (an interrupted launch).
    actor_class = ray.remote(ServerActor).options(max_concurrency=2, **options)
    actors = [
        actor_class.remote(args, f"admin {token} trainer\n", str(logs / f"server-{i}.log")) for i in range(num_servers)
    ]
    try:
        targets = _wait_serving(actors, ready_timeout_s)
        fleet = RayFleet(
            dict(zip(targets, actors)),
            credentials=ChannelCredentials(token=token),
            master_address=ray.util.get_node_ip_address(),
            **fleet_options,
        )
    except BaseException:
        _stop(actors)
        raise
    if init:
        try:
            fleet.init()
        except BaseException:
            fleet.close()
            raise
    return fleet


def _wait_serving(actors: list[Any], timeout_s: float) -> list[str]:
    waiting = {actor.wait_serving.remote(timeout_s): i for i, actor in enumerate(actors)}
    # An actor Ray cannot place never answers: the wait is bounded here too, not only in the actor.
    _, pending = ray.wait(list(waiting), num_returns=len(waiting), timeout=timeout_s + PLACE_SLACK_S)
    if pending:
        for ref in pending:  # ended now: a graceful stop would wait for them to be placed
            ray.kill(actors[waiting[ref]])
        raise FleetError(
            f"servers {sorted(waiting[r] for r in pending)} of {len(actors)} were not serving after "
            f"{timeout_s:.0f} s (does the Ray cluster have the resources asked for? `ray status` tells)"
        )
    targets = []
    for ref, i in waiting.items():
        try:
            targets.append(ray.get(ref))
        except ray.exceptions.RayError as e:
            raise FleetError(f"server {i} of {len(actors)} did not start: {_cause(e)}") from e
    return targets


def _stop(actors: list[Any], grace_s: float = 60.0) -> None:
    """Stop the servers gracefully (their engines too), then end their actors; an actor that
    is gone already is skipped (its server exits on its own)."""
    stopping = [actor.stop.remote() for actor in actors]
    ray.wait(stopping, num_returns=len(stopping), timeout=grace_s)
    for actor in actors:
        try:
            ray.kill(actor)
        except ray.exceptions.RayError:
            pass


def _cause(error: BaseException) -> str:
    cause = getattr(error, "cause", None)
    return str(cause if cause is not None else error)
