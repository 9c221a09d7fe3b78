"""The RL loop: rollout -> score -> train -> sync, on one rlserve server or a fleet.

`GrpoLoop` owns the servers (their clients, the fleet, the weight push) and the order of a
step; the rooms it drives own the rest: `sampler` the rollouts (synchronous mode samples every
batch with the weights just synced; asynchronous mode keeps a rollout thread generating while
the trainer trains and syncs, pause KEEP), `train` the train step (the loss drops tokens more
than `max_staleness` versions old and importance-weights the rest), `agreement` the check of
the trainer's logprobs against the server's, `record` what a step leaves behind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import grpc
import torch

from rlserve.api.rlserve.v1.lifecycle_pb2 import GetStateRequest
from rlserve.api.rlserve.v1.lifecycle_pb2_grpc import LifecycleStub
from rlserve.rl.agreement import Agreement, measure_agreement
from rlserve.rl.config import TRAIN_DTYPES, GrpoConfig
from rlserve.rl.policy import Policy
from rlserve.rl.record import StepRecord, step_record
from rlserve.rl.rollout import Rollout
from rlserve.rl.sampler import Batch, FleetStreams, RolloutClient, Sampler, batches
from rlserve.rl.tasks import Task
from rlserve.rl.train import TrainStep
from rlserve.sdk.client import AsyncClient, ChannelCredentials, Client
from rlserve.sdk.fleet import Fleet, FleetSyncStats
from rlserve.sdk.weight_sync import SyncStats, WeightSync
from rlserve.types import PauseMode

# How long a run waits at most for its servers to serve (less when the run is shorter).
DEFAULT_SERVER_WAIT_S = 300.0
# How often a wait says what it waits for.
WAIT_REPORT_S = 5.0

SyncFn = Callable[[torch.nn.Module, str], SyncStats | FleetSyncStats]


class ServerNotServing(RuntimeError):
    """A server the loop needs did not serve in time; the message says which and why."""


def wait_serving(
    client: Client, target: str, deadline: float, timeout_s: float, on_wait: Callable[[str], None]
) -> None:
    """Until `client`'s server reports SERVING, or ServerNotServing at `deadline`
    (time.monotonic()), with a line to `on_wait` every WAIT_REPORT_S saying why not yet."""
    started = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        try:
            client.wait_ready(timeout_s=max(0.1, min(WAIT_REPORT_S, left)))
            return
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        why = client.health_problem()
        if time.monotonic() >= deadline:
            raise ServerNotServing(f"the server at {target} did not serve within {timeout_s:.0f} s: {why}")
        on_wait(f"waiting for the server at {target} ({time.monotonic() - started:.0f} of {timeout_s:.0f} s): {why}")


class GrpoLoop:
    """GRPO against the rlserve server at `target`, or a fleet of them (several targets:
    synced as one `Fleet`, rollouts routed across it; or a `Fleet` of any size, which the
    loop uses and leaves open). `sync(model, version)` publishes the trainer's weights; the
    default pushes them with the SDK (`WeightSync` or `Fleet.sync`, pause KEEP)."""

    def __init__(
        self,
        policy: Policy,
        task: Task,
        target: str | Sequence[str] | Fleet,
        config: GrpoConfig = GrpoConfig(),
        *,
        credentials: ChannelCredentials | None = None,
        sync: SyncFn | None = None,
    ) -> None:
        if config.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if not config.sampling.temperature > 0:
            raise ValueError(f"the sampling temperature must be > 0, got {config.sampling.temperature}")
        self.policy, self.task, self.config = policy, task, config
        self._credentials = credentials
        self._weight_sync: WeightSync | None = None
        self.fleet: Fleet | None = None
        self._owned: list[Client | Fleet] = []
        if isinstance(target, Fleet):
            self._targets, self._clients, self.fleet = list(target.servers), target.clients, target
        else:
            self._targets = [target] if isinstance(target, str) else list(target)
            self._clients = [Client(t, credentials=credentials) for t in self._targets]
            self._owned += self._clients
            if len(self._targets) > 1:
                self.fleet = Fleet(self._clients)
                self._owned.append(self.fleet)
        if not self._targets:
            raise ValueError("no server to train against")
        if self.fleet is None:
            self._weight_sync = WeightSync(self._clients[0])
        self._sync = sync or self._push
        self.records: list[StepRecord] = []
        if config.train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"train_dtype must be one of {TRAIN_DTYPES}")
        self._trainer = TrainStep(policy, task, config)

    @property
    def train_dtype(self) -> str | None:
        """The training pass's dtype; None until the first step chose it (train_dtype "auto")."""
        return self._trainer.dtype

    @property
    def train_dtype_seconds(self) -> dict[str, float]:
        """What each dtype took on the first step's slice, when it was chosen there."""
        return self._trainer.dtype_seconds

    def close(self) -> None:
        if self._weight_sync is not None:
            self._weight_sync.close()
        for owned in reversed(self._owned):
            owned.close()

    def _push(self, model: torch.nn.Module, version: str) -> SyncStats | FleetSyncStats:
        if self.fleet is not None:
            return self.fleet.sync(model, version, pause_mode=PauseMode.KEEP)
        assert self._weight_sync is not None
        return self._weight_sync.sync(model, version, pause_mode=PauseMode.KEEP)

    def publish_initial(
        self, timeout_s: float = DEFAULT_SERVER_WAIT_S, on_wait: Callable[[str], None] = lambda _: None
    ) -> SyncStats | FleetSyncStats:
        """Make every server serve the trainer's weights as version 0 (checked by digest).
        Waits up to `timeout_s` in all for the servers to serve, saying every few seconds
        what it waits for (`on_wait`); raises ServerNotServing after that."""
        deadline = time.monotonic() + timeout_s
        for target, client in zip(self._targets, self._clients):
            wait_serving(client, target, deadline, timeout_s, on_wait)
            self._check_logprobs_mode(target, client)
        if self.fleet is not None:
            self.fleet.init(require_same_weights=False)  # the first sync sends every tensor
        return self._push(self.policy.model, str(self.policy.version))

    def _check_logprobs_mode(self, target: str, client: Client) -> None:
        """Sampling at a temperature other than 1 needs the logprobs of the distribution
        sampled from (processed ones): with raw ones the ratio and the agreement would
        compare two distributions. ValueError naming the server and the flag otherwise."""
        temperature = self.config.sampling.temperature
        if temperature == 1.0:
            return
        state = LifecycleStub(client.channel).GetState(GetStateRequest(), timeout=30.0)
        if state.logprobs_mode != "processed_logprobs":
            raise ValueError(
                f"sampling at temperature {temperature} needs processed logprobs, but the server at {target} "
                f"returns {state.logprobs_mode or 'raw_logprobs'}: start it with --logprobs-mode processed_logprobs"
            )

    def agreement(self, rollouts: Sequence[Rollout]) -> Agreement:
        """`agreement_sample` of the rollouts scored under the weights of the versions that
        sampled them, against the server's logprobs (see `agreement.measure_agreement`)."""
        return measure_agreement(self.policy, rollouts, self.config.agreement_sample, self.config.sampling.temperature)

    def run(
        self,
        steps: int,
        *,
        max_seconds: float | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        on_phase: Callable[[str], None] | None = None,
        stop: threading.Event | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> list[StepRecord]:
        """`steps` steps (or until `max_seconds`, counted from the call, or `stop`); the
        initial publish first. `on_wait(text)` hears every few seconds what the run waits for
        while a server does not serve yet (default: `on_phase`)."""
        stop = stop or threading.Event()
        phase = on_phase or (lambda _: None)
        t_start = time.perf_counter()
        phase("waiting for the servers, then publishing the initial weights")
        # Bounded by the run's own limit: a server that is not there ends the run, not the day.
        wait_s = min(DEFAULT_SERVER_WAIT_S, max_seconds) if max_seconds is not None else DEFAULT_SERVER_WAIT_S
        self.publish_initial(wait_s, on_wait or phase)
        sampler = Sampler(self._open_client, self.task, self.policy.prompt_ids, self.config)
        with batches(sampler, self.config, stop) as next_batch:
            for step in range(1, steps + 1):
                if stop.is_set() or (max_seconds is not None and time.perf_counter() - t_start > max_seconds):
                    break
                record = self._step(step, next_batch, phase)
                record.elapsed_s = time.perf_counter() - t_start
                self.records.append(record)
                if on_step:
                    on_step(record)
        return self.records

    def _open_client(self) -> RolloutClient:
        if self.fleet is not None:
            return FleetStreams(self.fleet)
        return AsyncClient(self._targets[0], credentials=self._credentials)

    def _step(self, step: int, next_batch: Callable[[], Batch], phase: Callable[[str], None]) -> StepRecord:
        """Rollouts, the train step, the sync, and the step's record."""
        phase(f"step {step}: rollouts")
        t0 = time.perf_counter()
        rollouts, sample_s = next_batch()
        rollout_s = time.perf_counter() - t0
        phase(f"step {step}: training on {len(rollouts)} completions")
        trained = self._trainer.step(step, rollouts, phase)
        version = str(self.policy.version)
        phase(f"step {step}: syncing version {version}")
        synced = self._sync(self.policy.model, version)
        return step_record(
            step,
            version,
            rollouts,
            trained,
            synced,
            rollout_s=rollout_s,
            sample_s=sample_s,
            tolerance=self.config.agreement_tolerance,
            train_dtype=self.train_dtype or "float32",
        )
