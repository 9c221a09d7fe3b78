"""The RL loop as a library: rollouts with per-token versions (`rollout`), a verifiable task
(`tasks`), GRPO in plain PyTorch (`grpo`), the trainer's model (`policy`), batches sampled on
demand or ahead (`sampler`), the train step (`train`), the agreement check (`agreement`), the
loop over one server or a fleet (`loop`, configured by `config.GrpoConfig`), each step's record
(`record`) and the report (`report`). `rlserve demo` is a thin layer over them. Needs torch and
transformers."""
