"""What a GRPO run is asked to do: the loop's one frozen configuration, read by the sampler,
the train step and the loop. Nothing here runs; `GrpoLoop` checks it when it starts."""

from __future__ import annotations

from dataclasses import dataclass

from rlserve.rl.rollout import SamplingConfig

TRAIN_DTYPES = ("auto", "float32", "bfloat16")


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
