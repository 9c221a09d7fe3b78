"""What a step leaves behind: `StepRecord`, the figures of one rollout -> train -> sync step
(one line of the JSON log), made from what sampling, the train step and the sync measured."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlserve.rl.agreement import AGREEMENT_OK
from rlserve.rl.rollout import Rollout
from rlserve.rl.train import Trained
from rlserve.sdk.fleet import FleetSyncStats
from rlserve.sdk.weight_sync import SyncStats


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
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def agreement_ok(self) -> bool:
        return self.agreement == AGREEMENT_OK


def step_record(
    step: int,
    version: str,
    rollouts: Sequence[Rollout],
    trained: Trained,
    synced: SyncStats | FleetSyncStats,
    *,
    rollout_s: float,
    sample_s: float,
    tolerance: float,
    train_dtype: str,
) -> StepRecord:
    """The record of step `step`, which published `version`: `rollout_s` waiting for its
    rollouts, `sample_s` sampling them. `elapsed_s` is left to the loop."""
    rewards = [r.reward for r in rollouts]
    mean = sum(rewards) / len(rewards)
    tokens = sum(r.num_tokens for r in rollouts)
    agreement, stats, ages = trained.agreement, trained.loss, trained.ages
    diffs = agreement.diffs
    return StepRecord(
        step=step,
        version=version,
        reward_mean=mean,
        reward_std=(sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5,
        completion_tokens=tokens,
        rollout_s=rollout_s,
        train_s=trained.train_s,
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
        agreement=agreement.verdict(tolerance),
        mixed_sequences=agreement.mixed,
        mixed_diff_max=agreement.mixed_max,
        loss=stats.loss,
        clipped_fraction=stats.clipped_fraction,
        elapsed_s=0.0,
        train_dtype=train_dtype,
        sample=rollouts[0].text if rollouts else "",
    )
