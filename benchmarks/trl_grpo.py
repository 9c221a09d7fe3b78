"""Hugging Face TRL's GRPOTrainer on SmolLM2-135M-Instruct, side by side in one run:
- rlserve:      server mode through rlserve (`rlserve.integrations.trl.install()`), a server it
                starts with `--weight-transfer-backend rlserve_shm --logprobs-mode
                processed_logprobs`;
- colocate:     TRL's `vllm_mode="colocate"` (vLLM inside the trainer), where TRL allows it
                on this machine (the leg reports the error where it does not);
- transformers: TRL without vLLM (transformers' `generate` in the trainer).
Each leg trains --steps steps (the first is a warm-up, left out), the same prompts, batch and
completion length; per step it records seconds in generation, in the weight sync and the rest
(training), timed around the trainer's own generation and sync calls (TRL's profiling metrics
go to wandb, mlflow or trackio only). The last stdout line is one JSON object with
steps per minute and the split for every leg, the ratios to the transformers leg and the CPU
the figures came from. Trainer, server and engine share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

PROMPTS = ["What is 2 + 3?", "Name a colour.", "Count to five.", "Say hello in French."]


def cpu() -> dict[str, Any]:
    """The CPU the figures came from: its model and whether it has native bf16."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return {
        "model": model or platform.processor(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
    }


def reward(completions, **kwargs) -> list[float]:
    """Longer answers score higher (up to 64 characters); completions are conversations."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [min(len(t), 64) / 64.0 for t in texts]


def timed(owner: Any, name: str, spent: list[float]) -> None:
    """`owner.name(...)` appends the seconds each call took to `spent`."""
    call = getattr(owner, name)

    def timing(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    setattr(owner, name, timing)


def leg(name: str, model_dir: Path, out: Path, args: argparse.Namespace, target: str | None) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    vllm = {"use_vllm": False}
    if name == "rlserve":
        vllm = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": f"grpc://{target}"}
    elif name == "colocate":
        vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}
    config = GRPOConfig(
        output_dir=str(out / name),
        use_cpu=True,
        bf16=False,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=3,
        **vllm,
    )
    step_s: list[float] = []

    class Steps(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_s.append(time.perf_counter() - self.t0)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS] * args.steps * 4})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer)
    trainer.add_callback(Steps())
    # One generation per step (steps_per_generation = 1); with vLLM it starts with the sync.
    generation_s: list[float] = []
    sync_s: list[float] = []
    timed(trainer, "_generate_single_turn", generation_s)
    if getattr(trainer, "vllm_generation", None) is not None:
        timed(trainer.vllm_generation, "sync_weights", sync_s)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "reward" in e][1:]
    steps, generations = step_s[1:], generation_s[1:]  # the first step warms up
    syncs = sync_s[1:] if sync_s else [0.0] * len(steps)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return {
        "steps_per_min": 60.0 / mean(steps) if steps else 0.0,
        "step_s": mean(steps),
        "generation_s": mean(generations) - mean(syncs),
        "sync_s": mean(syncs),
        "training_s": mean(steps) - mean(generations),
        "reward": mean([e["reward"] for e in logged]),
        "num_timed_steps": len(steps),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--legs", default="rlserve,colocate,transformers")
    args = parser.parse_args()

    from rlserve.integrations import trl as rlserve_trl
    from rlserve.model_cache import default_model_dir
    from rlserve.sdk.launch import ServerProcess

    model_dir = default_model_dir()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlserve-trl-bench-") as tmp:
        out = Path(tmp)
        for name in args.legs.split(","):
            try:
                if name == "rlserve":
                    server_args = ["--model", str(model_dir), "--dtype", "float32",
                                   "--weight-transfer-backend", "rlserve_shm", "--logprobs-mode", "processed_logprobs"]  # fmt: skip
                    server = ServerProcess(server_args, log_path=out / "server.log")
                    try:
                        server.wait_serving(timeout_s=600)
                        with rlserve_trl.install():
                            results[name] = leg(name, model_dir, out, args, server.target)
                    finally:
                        server.stop()
                else:
                    results[name] = leg(name, model_dir, out, args, None)
            except Exception as e:  # a leg TRL refuses on this machine is reported, not fatal
                traceback.print_exc(file=sys.stderr)
                results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    base = results.get("transformers", {}).get("steps_per_min")
    ratios = {
        f"{n}_steps_per_min_vs_transformers": round(r["steps_per_min"] / base, 3)
        for n, r in results.items()
        if base and "steps_per_min" in r
    }
    print(json.dumps({"bench": "trl_grpo", "cpu": cpu(), "args": vars(args), "legs": results, **ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
