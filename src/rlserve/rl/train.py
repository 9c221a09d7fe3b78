"""The train step: rewards, group advantages, the agreement check, the GRPO loss and one
optimizer step, in the training dtype it picks (timed on the first batch when asked to).
Owns that choice; not sampling, the sync or the step's record."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rlserve.rl.agreement import Agreement, measure_agreement
from rlserve.rl.config import GrpoConfig
from rlserve.rl.grpo import UNKNOWN, LossStats, completion_logprobs, group_advantages, grpo_loss, staleness
from rlserve.rl.policy import Policy
from rlserve.rl.rollout import Rollout
from rlserve.rl.tasks import Task

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


@dataclass(frozen=True)
class Trained:
    """What one train step did."""

    loss: LossStats
    agreement: Agreement  # measured before the step, under the weights that sampled
    ages: list[int]  # the staleness of every token of a version the trainer published
    train_s: float


class TrainStep:
    """`step(number, rollouts, phase)` trains `policy` once on a batch scored by `task`."""

    def __init__(self, policy: Policy, task: Task, config: GrpoConfig) -> None:
        self.policy, self.task, self.config = policy, task, config
        # Chosen on the first step's batch when "auto"; the seconds each took, then.
        self.dtype: str | None = None if config.train_dtype == "auto" else config.train_dtype
        self.dtype_seconds: dict[str, float] = {}

    def step(self, number: int, rollouts: list[Rollout], phase: Callable[[str], None]) -> Trained:
        policy, cfg = self.policy, self.config
        for r in rollouts:
            r.reward = self.task.reward(r.problem, r.text)
        group_advantages(rollouts)
        t0 = time.perf_counter()
        temperature = cfg.sampling.temperature
        agreement = measure_agreement(policy, rollouts, cfg.agreement_sample, temperature)
        # A rollout with no advantage (its group scored alike) adds nothing to the gradient.
        learning = [r for r in rollouts if r.advantage != 0.0]
        if learning and self.dtype is None:
            self.dtype, self.dtype_seconds = faster_train_dtype(policy, learning)
            phase(f"step {number}: training in {self.dtype} from now on")
        bf16 = self.dtype == "bfloat16"
        logprobs = (
            completion_logprobs(policy.model, learning, policy.pad_id, bf16=bf16, temperature=temperature)
            if learning
            else []
        )
        loss, stats = grpo_loss(
            logprobs, learning, current_version=policy.version, max_staleness=cfg.max_staleness, clip=cfg.clip
        )
        ages = [a for r in rollouts for v in r.versions if (a := staleness(policy.version, v)) != UNKNOWN]
        policy.step(loss, cfg.max_grad_norm)
        return Trained(stats, agreement, ages, time.perf_counter() - t0)
