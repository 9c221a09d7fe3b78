"""The RL loop as a library: rollouts with per-token versions (`rollout`), a verifiable task
(`tasks`), GRPO in plain PyTorch (`grpo`), the loop with its agreement check (`loop`), and the
report (`report`). `rlserve demo` is a thin layer over them. Needs torch and transformers."""
