"""What a run shows: a live status line (plain log lines without a terminal), a JSON-lines
log of every step, and a PNG plot of reward, sync time, staleness and logprob agreement."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from rlserve.rl.agreement import AGREEMENT_MISMATCH
from rlserve.rl.record import StepRecord


class Progress:
    """On a terminal: one status line rewritten in place, and a line per finished step.
    Elsewhere (a log file, CI): the step lines only, flushed as they come."""

    def __init__(self, out: TextIO = sys.stdout, *, live: bool | None = None) -> None:
        self._out = out
        self._live = out.isatty() if live is None else live
        self._t0 = time.perf_counter()

    def phase(self, text: str) -> None:
        if self._live:
            self._out.write(f"\r\x1b[K[{time.perf_counter() - self._t0:6.0f}s] {text}")
            self._out.flush()

    def step(self, r: StepRecord) -> None:
        agreement = (
            f"{r.logprob_diff_mean:.1e} (max {r.logprob_diff_max:.1e})"
            if r.agreement_tokens
            else "not checked (no token's version kept)"
        )
        line = (
            f"step {r.step:3d}  reward {r.reward_mean:5.2f} ± {r.reward_std:4.2f}  "
            f"sync {r.sync_s:5.2f}s  staleness {r.staleness_mean:4.2f} (max used {r.staleness_max_used})  "
            f"{r.tokens_per_s:6.0f} tok/s  |Δlogp| {agreement}  "
            f"{r.elapsed_s:5.0f}s"
        )
        if r.agreement == AGREEMENT_MISMATCH:
            line += "  <- trainer and server disagree: the served weights are not the version's"
        self._out.write(("\r\x1b[K" if self._live else "") + line + "\n")
        self._out.flush()

    def message(self, text: str) -> None:
        self._out.write(("\r\x1b[K" if self._live else "") + text + "\n")
        self._out.flush()


def cpu_description() -> str:
    """The CPU figures come from: its model, cores, and whether it does bf16 natively."""
    import os
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    bf16 = f"native bf16: {', '.join(native)}" if native else "no native bf16 (no avx512_bf16, no amx_bf16)"
    return f"{model}, {os.cpu_count()} cores, {bf16}"


def reward_rise(records: Sequence[StepRecord]) -> tuple[float, float, float, int]:
    """(mean reward of the first k steps, of the last k, their difference in standard errors
    of the step-to-step noise, k): k is a fifth of the steps, at least 1."""
    k = max(1, len(records) // 5)
    first, last = [r.reward_mean for r in records[:k]], [r.reward_mean for r in records[-k:]]

    def mean_and_se2(xs: list[float]) -> tuple[float, float]:
        m = sum(xs) / len(xs)
        var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
        return m, var / len(xs)

    (a, va), (b, vb) = mean_and_se2(first), mean_and_se2(last)
    se = (va + vb) ** 0.5
    return a, b, (b - a) / se if se > 0 else float("inf") if b != a else 0.0, k


class StepLog:
    """One JSON object per line and step, appended and flushed as each step ends."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w")

    def write(self, record: StepRecord) -> None:
        self._file.write(json.dumps(dataclasses.asdict(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot(records: Sequence[StepRecord | dict], path: Path, title: str = "rlserve demo") -> Path:
    """Four panels over the steps: reward (mean and spread), sync seconds, staleness, and
    the train/inference logprob difference (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [dataclasses.asdict(r) if isinstance(r, StepRecord) else r for r in records]
    steps = [r["step"] for r in rows]
    col = {k: [r[k] for r in rows] for k in rows[0]} if rows else {}
    fig, axes = plt.subplots(4, 1, figsize=(8, 10), sharex=True)
    if rows:
        mean, std = col["reward_mean"], col["reward_std"]
        axes[0].plot(steps, mean, marker="o", label="mean")
        axes[0].fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
        axes[0].set_ylabel("reward")
        axes[1].plot(steps, col["sync_s"], marker="o", label="pause → resume")
        axes[1].plot(steps, col["transfer_s"], marker=".", label="transfer")
        axes[1].set_ylabel("sync (s)")
        axes[1].legend()
        axes[2].plot(steps, col["staleness_mean"], marker="o", label="mean (all tokens)")
        axes[2].plot(steps, col["staleness_max_used"], marker=".", label="max used for a gradient")
        axes[2].set_ylabel("staleness (versions)")
        axes[2].legend()
        floor = 1e-9
        axes[3].semilogy(steps, [max(x, floor) for x in col["logprob_diff_mean"]], marker="o", label="mean")
        axes[3].semilogy(steps, [max(x, floor) for x in col["logprob_diff_max"]], marker=".", label="max")
        axes[3].set_ylabel("|logp trainer − server|")
        axes[3].legend()
    axes[-1].set_xlabel("step")
    axes[0].set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
