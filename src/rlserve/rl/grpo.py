"""GRPO in plain PyTorch: group-normalized advantages, the trainer's own logprobs of the
sampled tokens, and a clipped policy-gradient loss weighted against the sampling policy.

The sampling policy's logprobs are the server's (what rlserve returned for each token), so
the ratio exp(logp_trainer - logp_sampler) is the importance weight of a stale token and is
~1 for a fresh one; clipping bounds it. Tokens older than the staleness bound get no
gradient at all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlserve.rl.rollout import Rollout

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The staleness of a token whose version the trainer never published (not a step number, or
# ahead of the trainer): older than any bound, so it never reaches a gradient.
UNKNOWN = 1 << 30


def staleness(current_version: int, version: str) -> int:
    """How many versions before the trainer's current one `version` is."""
    try:
        v = int(version)
    except ValueError:
        return UNKNOWN
    return current_version - v if 0 <= v <= current_version else UNKNOWN


def group_advantages(rollouts: Sequence[Rollout], eps: float = 1e-4) -> None:
    """Set each rollout's advantage to its reward standardized within its group; a group
    whose rewards are all equal teaches nothing and gets zeros."""
    groups: dict[int, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group, []).append(r)
    for members in groups.values():
        rewards = [r.reward for r in members]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
        for r in members:
            r.advantage = 0.0 if std < eps else (r.reward - mean) / (std + eps)


def completion_logprobs(
    model: PreTrainedModel,
    rollouts: Sequence[Rollout],
    pad_id: int,
    params: Mapping[str, torch.Tensor] | None = None,
    *,
    bf16: bool = False,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """log p(token | prefix) of every completion token, one tensor per rollout, under the
    model's weights or under `params` (a state dict, e.g. the weights of an older version),
    of the distribution sampled at `temperature` (log softmax(logits / temperature): what a
    server with processed logprobs returns). Only completion positions go through the
    output head; the softmax is in float32.
    `bf16` runs the matmuls in bfloat16 (autocast): ~2.4x faster for training on a CPU
    with AVX512-BF16, too coarse to check agreement with."""
    scorer = _Scorer(model, pad_id, temperature)
    with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=bf16):
        if params is None:
            return scorer(rollouts)
        weights = {f"model.{k}": v for k, v in params.items()}
        # Tied tensors arrive under both names already; tying again would see them twice.
        return torch.func.functional_call(scorer, weights, (rollouts,), tie_weights=False)


def _logprobs(
    model: PreTrainedModel, rollouts: Sequence[Rollout], pad_id: int, temperature: float
) -> list[torch.Tensor]:
    sequences = [r.prompt_ids + r.completion_ids for r in rollouts]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    # The logit at position p predicts token p + 1.
    rows: list[int] = []
    cols: list[int] = []
    targets: list[int] = []
    for i, r in enumerate(rollouts):
        start = len(r.prompt_ids) - 1
        rows += [i] * r.num_tokens
        cols += range(start, start + r.num_tokens)
        targets += r.completion_ids
    logits = model.get_output_embeddings()(hidden[rows, cols]).float() / temperature
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1)
    return list(picked.split([r.num_tokens for r in rollouts]))


class _Scorer(torch.nn.Module):
    """The scoring pass as a module, so that functional_call can run it on other weights."""

    def __init__(self, model: PreTrainedModel, pad_id: int, temperature: float) -> None:
        super().__init__()
        self.model, self.pad_id, self.temperature = model, pad_id, temperature

    def forward(self, rollouts: Sequence[Rollout]) -> list[torch.Tensor]:
        return _logprobs(self.model, rollouts, self.pad_id, self.temperature)


@dataclass
class LossStats:
    loss: float
    tokens_used: int
    tokens_dropped: int  # older than the staleness bound
    max_staleness_used: int
    clipped_fraction: float


def grpo_loss(
    logprobs: Sequence[torch.Tensor],
    rollouts: Sequence[Rollout],
    *,
    current_version: int,
    max_staleness: int,
    clip: float = 0.2,
) -> tuple[torch.Tensor, LossStats]:
    """The clipped surrogate over every token no older than `max_staleness` versions
    (token-level mean), and what it used. A token of a version the trainer never published
    is dropped."""
    terms, used, dropped, oldest, clipped = [], 0, 0, 0, 0
    for lp, r in zip(logprobs, rollouts, strict=True):
        age = torch.tensor([staleness(current_version, v) for v in r.versions])
        keep = age <= max_staleness
        dropped += int((~keep).sum())
        if not keep.any():
            continue
        ratio = torch.exp(lp[keep] - torch.tensor(r.logprobs)[keep])
        a = r.advantage
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
        terms.append(-surrogate)
        used += int(keep.sum())
        oldest = max(oldest, int(age[keep].max()))
        clipped += int(((ratio < 1 - clip) | (ratio > 1 + clip)).sum())
    if not terms:  # nothing to learn from: a loss without a gradient
        return torch.zeros(()), LossStats(0.0, 0, dropped, 0, 0.0)
    loss = torch.cat(terms).mean()
    return loss, LossStats(float(loss.detach()), used, dropped, oldest, clipped / used)
