"""Train/inference agreement: the trainer's logprobs of sampled tokens, each under the weights
of the version that sampled it, against the logprobs rlserve returned. A missed weight update,
a wrong version label or a repacking bug shows up here as a jump. Owns the comparison and its
verdict; the weights come from the `Policy`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rlserve.rl.grpo import completion_logprobs, staleness
from rlserve.rl.policy import Policy
from rlserve.rl.rollout import Rollout

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


def measure_agreement(
    policy: Policy, rollouts: Sequence[Rollout], sample_size: int, temperature: float = 1.0
) -> Agreement:
    """A spread sample of `sample_size` rollouts, every token scored in float32 under the
    weights of the version that sampled it (the current weights, or kept ones of an older
    version; a token of a version no longer kept is skipped)."""
    n = sample_size
    sample = list(rollouts[:: max(1, len(rollouts) // n)])[:n] if n else []
    scored = _scored_by_version(policy, sample, temperature)
    agreement = Agreement()
    for r in sample:
        if all((id(r), v) in scored for v in set(r.versions)):
            agreement.add(torch.stack([scored[id(r), v][i] for i, v in enumerate(r.versions)]), r)
    return agreement


def _scored_by_version(
    policy: Policy, sample: Sequence[Rollout], temperature: float
) -> dict[tuple[int, str], torch.Tensor]:
    """(id(rollout), version) -> the rollout's logprobs under that version's weights, for every
    version a rollout has tokens of whose weights are still at hand."""
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
            scores = completion_logprobs(policy.model, members, policy.pad_id, weights, temperature=temperature)
            for r, lp in zip(members, scores):
                scored[id(r), v] = lp
    return scored
