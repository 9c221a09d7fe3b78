"""The RL loop: rollout -> score -> train -> sync, on one rlserve server.

`Policy` is the trainer's copy of the model (optimizer, version, recent weights); `GrpoLoop`
drives it against a server. Synchronous mode samples every batch with the weights just
synced; asynchronous mode keeps a rollout thread generating while the trainer trains and
syncs (pause KEEP: requests in flight carry on under the new weights), and the loss drops
tokens more than `max_staleness` versions old and importance-weights the rest.

Every step also measures train/inference agreement: the trainer's logprobs of sampled tokens,
under the weights of the version that sampled them, against the logprobs rlserve returned.
A missed weight update, a wrong version label or a repacking bug shows up there as a jump.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from rlserve.rl.grpo import UNKNOWN, completion_logprobs, group_advantages, grpo_loss, staleness
from rlserve.rl.rollout import Rollout, SamplingConfig, sample_batch
from rlserve.rl.tasks import Problem, Task
from rlserve.sdk.client import AsyncClient, ChannelCredentials, Client
from rlserve.sdk.fleet import AsyncFleet, Fleet, FleetSyncStats
from rlserve.sdk.weight_sync import SyncStats, WeightSync
from rlserve.types import PauseMode

# How long a run waits at most for its servers to serve (less when the run is shorter).
DEFAULT_SERVER_WAIT_S = 300.0
# How often a wait says what it waits for.
WAIT_REPORT_S = 5.0


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


@dataclass(frozen=True)
class GrpoConfig:
    prompts_per_step: int = 8
    sampling: SamplingConfig = SamplingConfig()
    lr: float = 5e-6
    clip: float = 0.2
    max_grad_norm: float = 1.0
    # Asynchronous mode: rollouts keep running while the trainer trains and syncs.
    asynchronous: bool = False
    # Tokens sampled more than this many versions before the trainer's get no gradient.
    max_staleness: int = 0
    # The training pass: "bfloat16" (autocast), "float32", or "auto": both are timed on a
    # slice of the first step's batch and the faster kept (bfloat16 autocast is ~2.4x faster
    # on a CPU with native bf16, ~4x slower on one without). The agreement check is float32.
    train_dtype: str = "auto"
    # Rollouts per step re-scored in float32 under the weights of the version that sampled
    # each token, and the largest |logprob difference| that still counts as agreement.
    agreement_sample: int = 16
    agreement_tolerance: float = 1e-3
    seed: int = 0


@dataclass
class StepRecord:
    step: int
    version: str  # published at the end of the step
    reward_mean: float
    reward_std: float
    completion_tokens: int
    rollout_s: float  # waiting for rollouts (async: only what the trainer waited)
    train_s: float
    sync_s: float  # pause -> resume on the server
    transfer_s: float
    tokens_per_s: float
    token_versions: dict[str, int]  # completion tokens per weight version that sampled them
    staleness_mean: float
    staleness_max_used: int
    tokens_used: int
    tokens_dropped: int
    # |trainer - server| over the tokens compared, each under its own version's weights.
    logprob_diff_mean: float
    logprob_diff_max: float
    agreement_tokens: int
    # "ok" (logprob_diff_max within the tolerance), "mismatch", or "none": nothing compared
    # (no token's version kept), which is never a pass.
    agreement: str
    mixed_sequences: int  # sampled across a weight update (KEEP), compared like the others
    mixed_diff_max: float  # their part of logprob_diff_max
    loss: float
    clipped_fraction: float
    elapsed_s: float
    train_dtype: str = "float32"
    sample: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def agreement_ok(self) -> bool:
        return self.agreement == AGREEMENT_OK


class Policy:
    """The trainer's model, its optimizer, the version it is at, and the weights of the last
    `keep_versions` versions before it (to re-score stale rollouts under the weights that
    sampled them)."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, lr: float, keep_versions: int = 0) -> None:
        self.model, self.tokenizer = model.float().train(), tokenizer
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.version = 0
        self._keep = keep_versions
        self._history: dict[int, dict[str, torch.Tensor]] = {}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def prompt_ids(self, problem: Problem) -> list[int]:
        turns = [{"role": "system", "content": problem.system}] if problem.system else []
        turns.append({"role": "user", "content": problem.question})
        ids = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def weights_of(self, version: int) -> dict[str, torch.Tensor] | None:
        """The weights of an earlier version, if still kept."""
        return self._history.get(version)

    def step(self, loss: torch.Tensor, max_grad_norm: float) -> None:
        """One optimizer step on `loss`; the version counts one up (publish it next)."""
        if self._keep:
            self._history[self.version] = _copy_weights(self.model)
            for old in [v for v in self._history if v <= self.version - self._keep]:
                del self._history[old]
        self.optimizer.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
            self.optimizer.step()
        self.version += 1


def _copy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the state dict in which tied tensors (embedding and output head) stay one."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in copies:
            copies[tensor.data_ptr()] = tensor.detach().clone()
        out[name] = copies[tensor.data_ptr()]
    return out


AGREEMENT_OK, AGREEMENT_MISMATCH, AGREEMENT_NONE = "ok", "mismatch", "none"


@dataclass
class Agreement:
    diffs: list[float] = field(default_factory=list)
    mixed: int = 0
    mixed_max: float = 0.0

    def add(self, trainer: torch.Tensor, rollout: Rollout) -> None:
        """`trainer`: the trainer's logprob of each token under the weights of the version
        that sampled it. Every token counts, those of a sequence kept across an update (KEEP)
        too: the commit drops the KV of kept requests and the engine recomputes it under the
        new weights, so each token's whole prefix was computed by its own version."""
        diff = (trainer.detach() - torch.tensor(rollout.logprobs)).abs()
        self.diffs.extend(diff.tolist())
        if len(set(rollout.versions)) > 1:
            self.mixed += 1
            self.mixed_max = max(self.mixed_max, float(diff.max()))

    def verdict(self, tolerance: float) -> str:
        if not self.diffs:
            return AGREEMENT_NONE
        return AGREEMENT_OK if max(self.diffs) <= tolerance else AGREEMENT_MISMATCH


SyncFn = Callable[[torch.nn.Module, str], SyncStats | FleetSyncStats]
TRAIN_DTYPES = ("auto", "float32", "bfloat16")
# Rollouts of the first batch the two training dtypes are timed on (each once to warm up).
DTYPE_PROBE_ROLLOUTS = 8


def faster_train_dtype(policy: Policy, rollouts: Sequence[Rollout]) -> tuple[str, dict[str, float]]:
    """Time a forward and backward pass over a slice of `rollouts` in float32 and in
    bfloat16 autocast (after one pass each to warm up) and return the faster, with the
    seconds of each. No gradient is kept."""
    probe = list(rollouts[:DTYPE_PROBE_ROLLOUTS])
    seconds = {}
    for dtype in ("float32", "bfloat16"):
        for timed in (False, True):
            t0 = time.perf_counter()
            logprobs = completion_logprobs(policy.model, probe, policy.pad_id, bf16=dtype == "bfloat16")
            torch.stack([lp.sum() for lp in logprobs]).sum().backward()
            if timed:
                seconds[dtype] = time.perf_counter() - t0
    policy.model.zero_grad(set_to_none=True)
    return min(seconds, key=seconds.__getitem__), seconds


class FleetStreams:
    """What the rollouts need of a client (`stream`, `close`), across a fleet: a prompt's
    completions go to one server (session affinity on the prompt: its prefix cache)."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = AsyncFleet(fleet)

    async def stream(self, request: Any, *, timeout_s: float | None = None) -> AsyncIterator[Any]:
        prompt = request.text.encode() + request.token_ids.SerializeToString(deterministic=True)
        session = hashlib.blake2b(prompt, digest_size=8).hexdigest()
        async with contextlib.aclosing(self._fleet.stream(request, session_id=session, timeout_s=timeout_s)) as out:
            async for routed in out:
                yield routed.response

    async def close(self) -> None:
        await self._fleet.close()


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
        # Chosen on the first step's batch when "auto"; the seconds each took, then.
        self.train_dtype: str | None = None if config.train_dtype == "auto" else config.train_dtype
        self.train_dtype_seconds: dict[str, float] = {}

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
        if self.fleet is not None:
            self.fleet.init(require_same_weights=False)  # the first sync sends every tensor
        return self._push(self.policy.model, str(self.policy.version))

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
        with self._rollouts(stop) as next_batch:
            for step in range(1, steps + 1):
                if stop.is_set() or (max_seconds is not None and time.perf_counter() - t_start > max_seconds):
                    break
                phase(f"step {step}: rollouts")
                t0 = time.perf_counter()
                rollouts, sample_s = next_batch()
                rollout_s = time.perf_counter() - t0
                phase(f"step {step}: training on {len(rollouts)} completions")
                record = self._train_and_sync(step, rollouts, rollout_s, sample_s, phase)
                record.elapsed_s = time.perf_counter() - t_start
                self.records.append(record)
                if on_step:
                    on_step(record)
        return self.records

    # -- rollouts -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _rollouts(self, stop: threading.Event):
        """`next_batch() -> (rollouts, seconds the batch took to sample)`: sampled on demand
        (sync), or by a thread that samples ahead while the trainer trains (async)."""
        loop = asyncio.new_event_loop()

        async def open_client() -> AsyncClient | FleetStreams:  # a grpc.aio channel belongs to its loop
            if self.fleet is not None:
                return FleetStreams(self.fleet)
            return AsyncClient(self._targets[0], credentials=self._credentials)

        client = loop.run_until_complete(open_client())
        batches = itertools.count()

        async def one_batch() -> tuple[list[Rollout], float]:
            """A batch of new problems; aborted sequences (the server was paused with ABORT)
            are dropped, and a batch with nothing left is sampled again, up to three times."""
            t0 = time.perf_counter()
            for _ in range(3):
                problems = self.task.problems(self.config.prompts_per_step)
                ids = [self.policy.prompt_ids(p) for p in problems]
                seed = self.config.seed * 1_000_003 + next(batches) * self.config.prompts_per_step
                rollouts = await sample_batch(client, problems, ids, self.config.sampling, seed)
                kept = [r for r in rollouts if r.finish != "ABORTED" and r.num_tokens]
                if kept:
                    return kept, time.perf_counter() - t0
            raise RuntimeError("three batches in a row came back aborted: is the server being paused with ABORT?")

        if not self.config.asynchronous:
            try:
                yield lambda: loop.run_until_complete(one_batch())
            finally:
                loop.run_until_complete(client.close())
                loop.close()
            return

        # A batch starts only when the trainer takes one: with K credits, at most K batches
        # are sampled ahead of the one in training, so no token is more than K versions old
        # when it is trained on (the loss still drops any that are).
        ahead = max(1, self.config.max_staleness)
        credits = threading.Semaphore(ahead)
        ready: queue.Queue = queue.Queue()

        def produce() -> None:
            asyncio.set_event_loop(loop)
            while not stop.is_set():
                if not credits.acquire(timeout=0.2):
                    continue
                try:
                    ready.put(loop.run_until_complete(one_batch()))
                except Exception as e:  # handed to the trainer, which raises it
                    ready.put(e)
                    return

        def next_batch() -> tuple[list[Rollout], float]:
            while True:
                with contextlib.suppress(queue.Empty):
                    item = ready.get(timeout=0.5)
                    if isinstance(item, Exception):
                        raise item
                    credits.release()
                    return item
                if not producer.is_alive():
                    raise RuntimeError("the rollout thread stopped")

        producer = threading.Thread(target=produce, name="rlserve-rollouts", daemon=True)
        producer.start()
        try:
            yield next_batch
        finally:
            stop.set()
            producer.join(timeout=self.config.sampling.timeout_s)
            if not producer.is_alive():
                loop.run_until_complete(client.close())
                loop.close()

    # -- train and sync -------------------------------------------------------------------

    def _train_and_sync(
        self, step: int, rollouts: list[Rollout], rollout_s: float, sample_s: float, phase
    ) -> StepRecord:
        policy, cfg = self.policy, self.config
        for r in rollouts:
            r.reward = self.task.reward(r.problem, r.text)
        group_advantages(rollouts)
        t0 = time.perf_counter()
        agreement = self.agreement(rollouts)
        # A rollout with no advantage (its group scored alike) adds nothing to the gradient.
        learning = [r for r in rollouts if r.advantage != 0.0]
        if learning and self.train_dtype is None:
            self.train_dtype, self.train_dtype_seconds = faster_train_dtype(policy, learning)
            phase(f"step {step}: training in {self.train_dtype} from now on")
        bf16 = self.train_dtype == "bfloat16"
        logprobs = completion_logprobs(policy.model, learning, policy.pad_id, bf16=bf16) if learning else []
        loss, stats = grpo_loss(
            logprobs, learning, current_version=policy.version, max_staleness=cfg.max_staleness, clip=cfg.clip
        )
        ages = [a for r in rollouts for v in r.versions if (a := staleness(policy.version, v)) != UNKNOWN]
        policy.step(loss, cfg.max_grad_norm)
        train_s = time.perf_counter() - t0
        phase(f"step {step}: syncing version {policy.version}")
        synced = self._sync(policy.model, str(policy.version))
        rewards = [r.reward for r in rollouts]
        mean = sum(rewards) / len(rewards)
        tokens = sum(r.num_tokens for r in rollouts)
        diffs = agreement.diffs
        return StepRecord(
            step=step,
            version=str(policy.version),
            reward_mean=mean,
            reward_std=(sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5,
            completion_tokens=tokens,
            rollout_s=rollout_s,
            train_s=train_s,
            sync_s=synced.pause_to_resume_s,
            transfer_s=synced.transfer_s,
            tokens_per_s=tokens / sample_s if sample_s > 0 else 0.0,
            token_versions=dict(Counter(v for r in rollouts for v in r.versions)),
            staleness_mean=sum(ages) / len(ages) if ages else 0.0,
            staleness_max_used=stats.max_staleness_used,
            tokens_used=stats.tokens_used,
            tokens_dropped=stats.tokens_dropped,
            logprob_diff_mean=sum(diffs) / len(diffs) if diffs else 0.0,
            logprob_diff_max=max(diffs, default=0.0),
            agreement_tokens=len(diffs),
            agreement=agreement.verdict(cfg.agreement_tolerance),
            mixed_sequences=agreement.mixed,
            mixed_diff_max=agreement.mixed_max,
            loss=stats.loss,
            clipped_fraction=stats.clipped_fraction,
            elapsed_s=0.0,
            train_dtype=self.train_dtype or "float32",
            sample=rollouts[0].text if rollouts else "",
        )

    def agreement(self, rollouts: Sequence[Rollout]) -> Agreement:
        """A spread sample of the rollouts, every token scored in float32 under the weights of
        the version that sampled it (the current weights, or kept ones of an older version;
        a token of a version no longer kept is skipped)."""
        policy, n = self.policy, self.config.agreement_sample
        sample = list(rollouts[:: max(1, len(rollouts) // n)])[:n] if n else []
        by_version: dict[str, list[Rollout]] = {}
        for r in sample:
            for v in set(r.versions):
                by_version.setdefault(v, []).append(r)
        scored: dict[tuple[int, str], torch.Tensor] = {}
        with torch.no_grad():
            for v, members in by_version.items():
                age = staleness(policy.version, v)
                weights = None if age == 0 else policy.weights_of(policy.version - age)
                if age != 0 and weights is None:  # not kept, or never published by this trainer
                    continue
                for r, lp in zip(members, completion_logprobs(policy.model, members, policy.pad_id, weights)):
                    scored[id(r), v] = lp
        agreement = Agreement()
        for r in sample:
            if all((id(r), v) in scored for v in set(r.versions)):
                agreement.add(torch.stack([scored[id(r), v][i] for i, v in enumerate(r.versions)]), r)
        return agreement
