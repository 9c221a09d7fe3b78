"""`rlserve demo`: GRPO on the default model against a live rlserve, with a live display, a
JSON-lines log and a plot. A thin layer over `rlserve.rl`: arguments in, a server started
(unless --server names one), the loop run, the report written."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlserve.rl.loop import GrpoLoop
    from rlserve.rl.record import StepRecord
    from rlserve.rl.report import Progress, StepLog

TOKEN_ENV = "RLSERVE_TOKEN"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server",
        action="append",
        default=[],
        help="HOST:PORT of a running rlserve (default: start one); several (repeated, or comma-separated): "
        "a fleet, synced as one and its rollouts routed across it (each needs --weight-transfer-backend rlserve_gloo)",
    )
    p.add_argument(
        "--num-servers",
        type=int,
        default=0,
        help="start this many servers as Ray actors (needs rlserve[ray]; RAY_ADDRESS names a cluster, else a local "
        "one starts) and drive them as one fleet",
    )
    p.add_argument("--server-cpus", type=float, default=1, help="CPUs each Ray server holds")
    p.add_argument("--server-gpus", type=float, default=0, help="GPUs each Ray server holds")
    p.add_argument("--model", default="", help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--cache-dir", type=Path, default=None, help="where the default model is converted")
    p.add_argument("--dtype", default="float32", help="the started server's dtype (the trainer trains in float32)")
    p.add_argument(
        "--backend",
        default="rlserve_shm",
        choices=("rlserve_shm", "rlserve_gloo"),
        help="the started server's weight transport (it runs on this host: shared memory by default)",
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--minutes", type=float, default=10.0, help="stop after this long (0: no limit)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: the loop's)")
    p.add_argument(
        "--train-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="the training pass's dtype (bfloat16: autocast); auto: time both on step 1 and keep the faster",
    )
    p.add_argument("--async", dest="asynchronous", action="store_true", help="generate while training")
    p.add_argument("--max-staleness", type=int, default=None, help="versions (default: 1 with --async, else 0)")
    p.add_argument("--max-operand", type=int, default=9, help="sums of numbers up to this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("rlserve-demo"), help="log, plot and server log go here")
    p.add_argument(
        "--trainer",
        default="rlserve",
        choices=("rlserve", "trl"),
        help="whose loop trains: rlserve.rl's, or Hugging Face TRL's GRPOTrainer through rlserve.integrations.trl "
        "(needs rlserve[trl]; one server, started with processed logprobs)",
    )


def run(args: argparse.Namespace) -> int:
    """`--trainer rlserve`; `rlserve.cli` sends `--trainer trl` to `integrations.trl.demo`."""
    problem = misfit(args)
    if problem:
        print(f"rlserve demo: {problem}", file=sys.stderr)
        return 2
    model_dir, credentials = prepared(args)
    with contextlib.ExitStack() as stack:
        servers = [s.strip() for arg in args.server for s in arg.split(",") if s.strip()]
        if args.num_servers:
            return _train(args, model_dir, stack.enter_context(_ray_fleet(args, model_dir)), None)
        targets = servers or [
            stack.enter_context(started_server(model_dir, args.dtype, args.backend, args.out / "server.log"))
        ]
        return _train(args, model_dir, targets, credentials)


def prepared(args: argparse.Namespace) -> tuple[Path, Any]:
    """The model directory (converted on first use), `--out` made, and the admin token's
    credentials (from $RLSERVE_TOKEN), if any."""
    from rlserve.model_cache import default_model_dir
    from rlserve.sdk.client import ChannelCredentials

    model_dir = Path(args.model) if args.model else default_model_dir(args.cache_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    token = os.environ.get(TOKEN_ENV)
    return model_dir, ChannelCredentials(token=token) if token else None


def _ray_fleet(args: argparse.Namespace, model_dir: Path):
    from rlserve.sdk.ray import launch_fleet

    print(f"starting {args.num_servers} rlserve servers on Ray (logs: {args.out / 'servers'}) ...", flush=True)
    return launch_fleet(
        args.num_servers,
        model_dir,
        serve_args=("--dtype", args.dtype, "--max-model-len", "1024"),
        num_cpus=args.server_cpus,
        num_gpus=args.server_gpus,
        log_dir=args.out / "servers",
        init=False,  # the loop's first sync sends every tensor
    )


def _train(args: argparse.Namespace, model_dir: Path, targets: Any, credentials: Any) -> int:
    """`targets`: the servers' addresses, or a Fleet. The run's status: 0, or 1 when it stopped
    on an error or the trainer's and the server's logprobs did not agree."""
    import torch

    from rlserve.rl.report import Progress, StepLog, cpu_description, plot

    torch.manual_seed(args.seed)
    loop = _grpo_loop(args, model_dir, targets, credentials)
    progress, log = Progress(), StepLog(args.out / "steps.jsonl")
    mode = f"async, max staleness {loop.config.max_staleness}" if args.asynchronous else "synchronous"
    try:
        with _stop_on_interrupt(progress) as stop:
            servers = ", ".join(loop.fleet.servers if loop.fleet is not None else targets)
            progress.message(f"GRPO on {model_dir.name} via rlserve at {servers} ({mode}); log: {log.path}")
            progress.message(f"trainer CPU: {cpu_description()}")
            status = _run_steps(loop, args, progress, log, stop)
    finally:
        log.close()
        loop.close()
        picture = plot(loop.records, args.out / "demo.png", title=f"GRPO on {model_dir.name} via rlserve ({mode})")
        progress.message(_summary(loop.records) + f"\nplot: {picture}  log: {log.path}")
    disagreed = _disagreement(loop.records, loop.config.agreement_tolerance)
    if disagreed:
        progress.message(disagreed)
        status = status or 1
    return status


def _grpo_loop(args: argparse.Namespace, model_dir: Path, targets: Any, credentials: Any) -> GrpoLoop:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlserve.rl.config import GrpoConfig
    from rlserve.rl.loop import GrpoLoop
    from rlserve.rl.policy import Policy
    from rlserve.rl.rollout import SamplingConfig
    from rlserve.rl.tasks import Arithmetic

    staleness = args.max_staleness if args.max_staleness is not None else int(args.asynchronous)
    defaults = GrpoConfig()
    config = GrpoConfig(
        prompts_per_step=args.prompts_per_step,
        sampling=SamplingConfig(group_size=args.group_size, max_new_tokens=args.max_new_tokens),
        lr=args.lr if args.lr is not None else defaults.lr,
        asynchronous=args.asynchronous,
        max_staleness=staleness,
        seed=args.seed,
        train_dtype=args.train_dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = Policy(model, AutoTokenizer.from_pretrained(model_dir), lr=config.lr, keep_versions=staleness)
    task = Arithmetic(seed=args.seed, max_operand=args.max_operand)
    return GrpoLoop(policy, task, targets, config, credentials=credentials)


@contextlib.contextmanager
def _stop_on_interrupt(progress: Progress) -> Iterator[threading.Event]:
    """An event Ctrl-C sets (the run stops after its step); a second Ctrl-C stops it at once
    (KeyboardInterrupt). The previous handler is back on exit."""
    stop = threading.Event()

    def interrupted(*_: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        progress.message("stopping after this step (Ctrl-C again to stop now)")
        stop.set()

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_steps(
    loop: GrpoLoop, args: argparse.Namespace, progress: Progress, log: StepLog, stop: threading.Event
) -> int:
    """The loop run, each step logged and shown; 1 when it stopped on an error, else 0."""
    import grpc

    from rlserve.rl.loop import ServerNotServing
    from rlserve.sdk.weight_sync import WeightSyncError

    def on_step(record: StepRecord) -> None:
        log.write(record)
        if record.step == 1 and loop.train_dtype_seconds:
            timed = ", ".join(f"{d} {s:.2f} s" for d, s in loop.train_dtype_seconds.items())
            progress.message(f"training in {record.train_dtype}: the faster here on a slice of step 1 ({timed})")
        progress.step(record)

    try:
        loop.run(
            args.steps,
            max_seconds=args.minutes * 60 or None,
            on_step=on_step,
            on_phase=progress.phase,
            on_wait=progress.message,
            stop=stop,
        )
    except KeyboardInterrupt:
        progress.message("stopped")
    except ServerNotServing as e:
        progress.message(f"rlserve demo: {e}")
        return 1
    except (grpc.RpcError, WeightSyncError, RuntimeError) as e:
        reason = e.details() if isinstance(e, grpc.RpcError) else str(e)
        progress.message(f"rlserve demo: stopped at step {len(loop.records) + 1}: {reason}")
        return 1
    return 0


def _disagreement(records: Sequence[StepRecord], tolerance: float) -> str:
    """The steps at which the trainer's and the server's logprobs did not agree, in a line
    ("" when none)."""
    from rlserve.rl.agreement import AGREEMENT_OK

    unchecked = {r.step: r.agreement for r in records if r.agreement != AGREEMENT_OK}
    if not unchecked:
        return ""
    return (
        "rlserve demo: the trainer's and the server's logprobs did not agree at steps "
        + ", ".join(f"{step} ({how})" for step, how in unchecked.items())
        + f" (tolerance {tolerance:g}): the served weights were not the version's"
    )


def misfit(args: argparse.Namespace) -> str:
    empty = [arg for arg in args.server if not all(s.strip() for s in arg.split(","))]
    if empty:
        return f"--server needs HOST:PORT, comma-separated for several (got {empty[0]!r})"
    if args.group_size < 2:
        return "--group-size must be at least 2 (advantages compare completions of one prompt)"
    for flag in ("steps", "prompts_per_step", "max_new_tokens", "max_operand"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be at least 1"
    if args.num_servers < 0 or (args.num_servers and args.server):
        return "--num-servers must be positive, and cannot be given with --server"
    if args.minutes < 0 or (args.max_staleness is not None and args.max_staleness < 0):
        return "--minutes and --max-staleness cannot be negative"
    return ""


def _summary(records: Sequence[StepRecord]) -> str:
    from rlserve.rl.report import reward_rise

    if not records:
        return "no step finished"
    first, last, rise_se, k = reward_rise(records)
    minutes = records[-1].elapsed_s / 60
    sync = sorted(r.sync_s for r in records)[len(records) // 2]
    return (
        f"{len(records)} steps in {minutes:.1f} min ({len(records) / max(minutes, 1e-9):.1f}/min, "
        f"training in {records[-1].train_dtype}); reward {first:.2f} -> {last:.2f} (mean of the first and last "
        f"{k} steps: {rise_se:+.1f} standard errors of the step-to-step noise); sync p50 {sync:.2f} s; "
        f"|Δlogp| max {max(r.logprob_diff_max for r in records):.1e}"
    )


@contextlib.contextmanager
def started_server(model_dir: Path, dtype: str, backend: str, log_path: Path, *serve_args: str):
    """`rlserve serve` with weight-transfer `backend` (and `serve_args`) on a free loopback
    port; stopped on exit."""
    from rlserve.sdk.launch import ServerProcess

    server = ServerProcess(
        [
            "--model",
            str(model_dir),
            "--dtype",
            dtype,
            "--weight-transfer-backend",
            backend,
            "--max-model-len",
            "1024",
            *serve_args,
        ],  # fmt: skip
        log_path=log_path,
    )
    try:
        print(f"starting rlserve on {server.target} (log: {log_path}) ...", flush=True)
        yield server.wait_serving()
    finally:
        server.stop()
