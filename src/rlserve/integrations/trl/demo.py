"""`rlserve demo --trainer trl`: Hugging Face TRL's own GRPOTrainer on the demo's task (one-digit
sums, `rl.tasks.Arithmetic`) and the default model, generating and syncing through rlserve
(`install()`): a server it starts with processed logprobs, or one `--server`. A line per step;
TRL's log of every step as JSON lines in `--out/trl-steps.jsonl`."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from rlserve.integrations.trl import install
from rlserve.rl.demo import misfit, prepared, started_server
from rlserve.rl.tasks import Arithmetic, Problem


def run(args: argparse.Namespace) -> int:
    """0 when the run trained its steps (or its minutes); 2 for arguments it cannot take."""
    problem = misfit(args) or _trl_misfit(args)
    if problem:
        print(f"rlserve demo --trainer trl: {problem}", file=sys.stderr)
        return 2
    model_dir, credentials = prepared(args)
    with contextlib.ExitStack() as stack:
        target = args.server[0] if args.server else stack.enter_context(
            started_server(model_dir, args.dtype, args.backend, args.out / "server.log",
                           "--logprobs-mode", "processed_logprobs")
        )  # fmt: skip
        stack.enter_context(install(credentials=credentials))
        trainer = _trainer(args, model_dir, target)
        print(f"TRL GRPOTrainer on {model_dir.name} via rlserve at {target}; log: {args.out / 'trl-steps.jsonl'}")
        trainer.train()
        client = trainer.vllm_generation.vllm_client
        print(f"{trainer.state.global_step} steps; the server serves version {client.step - 1}")
        client.close()
    return 0


def _trl_misfit(args: argparse.Namespace) -> str:
    if args.num_servers or len(args.server) > 1 or any("," in s for s in args.server):
        return "TRL's server mode drives one server: one --server, or none (one is started)"
    if args.asynchronous:
        return "--async is rlserve.rl's; TRL's GRPOTrainer generates then trains"
    return ""


def _trainer(args: argparse.Namespace, model_dir: Path, target: str) -> Any:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlserve.rl.config import GrpoConfig

    task = Arithmetic(seed=args.seed, max_operand=args.max_operand)
    problems = task.problems(args.prompts_per_step * args.steps)
    data = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "system", "content": p.system}, {"role": "user", "content": p.question}] for p in problems
            ],
            "answer": [p.answer for p in problems],
        }
    )

    def arithmetic(completions: list, answer: list, **kwargs: Any) -> list[float | None]:
        """The demo's reward, on the text of each completion's last turn."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(Problem("", a), t) for t, a in zip(texts, answer, strict=True)]

    config = GRPOConfig(
        output_dir=str(args.out / "trl"),
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts_per_step * args.group_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        learning_rate=args.lr if args.lr is not None else GrpoConfig().lr,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=args.seed,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=f"grpc://{target}",
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=model, reward_funcs=arithmetic, args=config, train_dataset=data, processing_class=tokenizer
    )
    trainer.add_callback(_StepLines(args.out / "trl-steps.jsonl", args.minutes))
    return trainer


class _StepLines(TrainerCallback):
    """A line per logged step (reward, TRL's sampling-vs-training gap) and its JSON record;
    stops the run after `minutes` (0: no limit)."""

    def __init__(self, path: Path, minutes: float) -> None:
        self._file = path.open("w")
        self._deadline = time.monotonic() + minutes * 60 if minutes else None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not logs or "reward" not in logs:
            return
        self._file.write(json.dumps({"step": state.global_step, **logs}) + "\n")
        self._file.flush()
        gap = logs.get("sampling/sampling_logp_difference/max", float("nan"))
        print(f"step {state.global_step}: reward {logs['reward']:.3f}, sampling/training logprob gap {gap:.1e}")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline:
            control.should_training_stop = True

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        self._file.close()
