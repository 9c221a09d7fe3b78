"""Weight sync, side by side: how fast a trainer gets new weights into a running engine.

In one run, for each model (the tiny test model, and SmolLM2-135M unless --models says
otherwise), the same tensors move through these paths:
- floor:      a raw gloo broadcast of the same bytes between two processes, the faster of
              one message per 64 MiB bucket and one per tensor (`floor_bucketed_s`,
              `floor_per_tensor_s`; rlserve_gloo sends one per tensor);
- memcpy:     one single-threaded copy of the same bytes (the floor for shared memory);
- rlserve:    WeightSync.sync() against `rlserve serve --weight-transfer-backend rlserve_gloo`,
              staged (stage -> chunks -> prepare while generating, then pause -> finish ->
              resume; checksums verified), with a generation load running through it;
- rlserve_paused: the same with staged=False (pause -> start -> chunks -> finish -> resume);
- shm, shm_paused: the same two against `--weight-transfer-backend rlserve_shm`;
- in_place:   rlserve_gloo with `--weight-update-mode in-place` (no shadow copy);
- sparse_1pct, sparse_10pct: rlserve_gloo syncs with patch=True where 1% (10%) of every
              tensor's elements changed since the last sync (spread at random: every layer
              is touched, the worst case for the commit);
- checkpoint: the trainer saves safetensors, the engine reloads them through vLLM
              (`collective_rpc("reload_weights")`), as many RL frameworks do;
- per_tensor: rlserve's protocol with one UpdateWeights RPC and one broadcast per tensor.
Each path is warmed up once, then timed --repeats times (median); for the SDK paths the
servers' peak extra resident memory during those syncs is recorded too (shadows or not). The
last stdout line is one JSON object with seconds per path and the ratios the targets are
stated in. Each SDK leg says `staged`, `stage_s` (generating meanwhile) and
`pause_to_resume_s` (generation paused), of which `pause_s` is the pause taking effect (the
engine ends its step in flight first: under load, about one step); the staged legs also give
the load's tokens/s while idle and while a sync stages (trainer, server and load share this
machine's cores), and the longest time between two of its tokens, idle (`longest_token_gap_idle_s`)
and over a whole sync (`longest_token_gap_s`: staging, the pause, the recompute of the kept
requests on the new weights, and the read-back of the served digests after the resume), which
is how long generation stopped at worst. `sync_s` is a whole `WeightSync.sync` call, the
read-back included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PeakMemory, child_env, free_port, median, settle, stop_tree, tail  # noqa: E402

from rlserve.sdk.client import Client, generate_request  # noqa: E402
from rlserve.sdk.weight_sync import WeightSync  # noqa: E402
from rlserve.wire.gloo_group import GlooGroup  # noqa: E402
from rlserve.wire.protocol import TensorMeta, plan_buckets  # noqa: E402

BUCKET_BYTES = 64 * 2**20


def log(msg: str) -> None:
    print(f"[weight_sync] {msg}", file=sys.stderr, flush=True)


def model_dirs(names: list[str], work: Path) -> dict[str, Path]:
    out = {}
    if "tiny" in names:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_model import make_tiny_model

        tiny = work / "tiny"
        out["tiny"] = tiny if (tiny / "model.safetensors").exists() else make_tiny_model(tiny)
    if "smollm2" in names:
        from rlserve.model_cache import default_model_dir

        out["smollm2"] = default_model_dir()
    return out


def perturbed(model_dir: Path, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, moved a little, in the dtype the servers compute in: every
    path then moves the same bytes."""
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() + 0.01 * torch.randn(t.shape, generator=g)).to(dtype) for n, t in weights.items()}


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


# --- floor: a raw broadcast of the same bytes ------------------------------------------------


def _receiver(port: int, layouts: list[list[int]], rounds: int) -> None:
    group = GlooGroup.join("127.0.0.1", port, 1, 2, 60.0)
    for sizes in layouts:
        landing = torch.empty(sum(sizes), dtype=torch.uint8)
        for _ in range(rounds):
            works, at = [], 0
            for n in sizes:
                works.append(group.broadcast_async(landing[at : at + n]))
                at += n
            for w in works:
                w.wait()


def floor_seconds(weights: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """The same bytes, broadcast raw: one message per 64 MiB bucket (packed once, before the
    clock), and one per tensor from its own memory (as rlserve_gloo sends them)."""
    metas = [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), "") for n, t in weights.items()]
    buckets = [torch.ones(b.num_bytes, dtype=torch.uint8) for b in plan_buckets(metas, BUCKET_BYTES)]
    tensors = [t.reshape(-1).view(torch.uint8) for t in weights.values() if t.numel()]
    layouts = {"bucket": buckets, "tensor": tensors}
    store = GlooGroup.host_store("127.0.0.1", 0, 2, 60.0)
    sizes = [[m.numel() for m in messages] for messages in layouts.values()]
    proc = mp.get_context("spawn").Process(target=_receiver, args=(store.port, sizes, repeats + 1))
    proc.start()
    group = GlooGroup(store, 0, 2, 60.0)
    out = {}
    for name, messages in layouts.items():
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for w in [group.broadcast_async(m) for m in messages]:
                w.wait()
            times.append(time.perf_counter() - t0)
        out[name] = median(times[1:])
    proc.join()
    return out


# --- rlserve and per-tensor: the SDK against a real server ----------------------------------


def serve(
    model_dir: Path, work: Path, dtype: str, backend: str = "rlserve_gloo", *extra: str
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "rlserve",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--kv-cache-gib",
        "0.5",
    ]
    if backend:
        cmd += ["--weight-transfer-backend", backend]
    cmd += extra
    log_file = (work / f"server-{port}.log").open("wb")
    # Its own process group, in our session: a new session would be a scheduler autogroup of its
    # own, and on a small machine compete with this process as a group rather than per thread.
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=log_file, env=child_env(), process_group=0)
    target = f"127.0.0.1:{port}"
    with Client(target) as c:
        try:
            c.wait_ready(timeout_s=600)
        except grpc.RpcError as e:
            raise RuntimeError(f"server did not start:\n{tail(work / f'server-{port}.log')}") from e
    return proc, target


def sdk_seconds(
    target: str,
    weights: dict[str, torch.Tensor],
    repeats: int,
    per_tensor: bool,
    server_pid: int,
    *,
    staged: bool | None = None,
    load: bool = False,
) -> dict[str, object]:
    with Client(target) as client:
        size = 1 if per_tensor else BUCKET_BYTES
        sync = WeightSync(client, bucket_bytes=size, chunk_bytes=size if per_tensor else 2**30)
        sync.init()
        sync.sync(weights, "warm-up", staged=staged)
        settle(server_pid)
        with GenerationLoad(target) if load else contextlib.nullcontext() as gen:
            idle_window = gen.idle_window(IDLE_S) if gen else None
            runs, spans = [], []
            with PeakMemory(server_pid) as memory:
                for i in range(repeats):
                    t0 = time.monotonic()
                    runs.append(sync.sync(weights, f"v{i}", staged=staged))
                    spans.append((t0, time.monotonic()))
            stamps = gen.stamps() if gen else []
        sync.close()
    out: dict[str, object] = {
        **medians(runs),
        "sync_s": median([b - a for a, b in spans]),
        "staged": runs[0].staged,
        "num_chunks": runs[0].num_chunks,
        "peak_extra_mb": round((memory.peak_bytes - memory.start_bytes) / 1e6, 1),
    }
    if idle_window is not None:
        out["tokens_per_s_idle"] = round(tokens_per_s(stamps, [idle_window]), 1)
        if runs[0].staged:
            staging = [(a, a + r.stage_s) for (a, _), r in zip(spans, runs)]
            out["tokens_per_s_while_staging"] = round(tokens_per_s(stamps, staging), 1)
        out["longest_token_gap_idle_s"] = longest_gap(stamps, *idle_window)
        out["longest_token_gap_s"] = median([longest_gap(stamps, a, b) for a, b in spans])
    return out


IDLE_S = 5.0


class GenerationLoad:
    """A steady generation load on the server (a few streams at a time, each a short greedy
    answer), its tokens stamped (`time.monotonic()`, one clock for every process) as they
    arrived. The streams run in a process of their own, so that a stamp is not late because
    the trainer held its GIL (it digests and plans the sync's 269 MB before the first RPC):
    the longest gap between tokens is what the server did. (The sync's own timings came out
    the same either way: pause_s 31-32 ms in six A/B syncs each.)"""

    def __init__(self, target: str, streams: int = 4, max_new_tokens: int = 32) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_load_child, args=(target, streams, max_new_tokens, child), daemon=True)

    def __enter__(self) -> GenerationLoad:
        self._proc.start()
        if not self._conn.poll(120) or self._conn.recv() != "generating":
            raise RuntimeError("the generation load did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()

    def stamps(self) -> list[float]:
        self._conn.send("stamps")
        return self._conn.recv()

    def idle_window(self, seconds: float) -> tuple[float, float]:
        """Wait `seconds` while the load runs alone; the window waited."""
        t0 = time.monotonic()
        time.sleep(seconds)
        return t0, time.monotonic()


def tokens_per_s(stamps: list[float], windows: list[tuple[float, float]]) -> float:
    tokens = sum(1 for t in stamps for a, b in windows if a <= t < b)
    return tokens / sum(b - a for a, b in windows)


def longest_gap(stamps: list[float], start: float, end: float) -> float:
    """The longest time between two tokens arriving (of any stream) in [start, end], the
    window's edges counting as arrivals: how long generation stopped at worst."""
    inside = sorted(t for t in stamps if start <= t <= end)
    edges = [start, *inside, end]
    return max(b - a for a, b in zip(edges, edges[1:]))


def _load_child(target: str, streams: int, max_new_tokens: int, conn) -> None:
    stamps: list[float] = []
    lock = threading.Lock()
    stop = threading.Event()

    def run(index: int) -> None:
        with Client(target) as client:
            n = 0
            while not stop.is_set():
                request = generate_request(
                    f"Story {index}-{n}:", max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True
                )
                for chunk in client.inference.GenerateStream(request, timeout=120):
                    now = time.monotonic()
                    with lock:
                        stamps.extend([now] * chunk.outputs.num_tokens)
                n += 1

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every stream under way
    conn.send("generating")
    while (ask := conn.recv()) != "stop":
        assert ask == "stamps", ask
        with lock:
            conn.send(list(stamps))
    stop.set()
    for t in threads:
        t.join(timeout=60)


def medians(runs: list) -> dict[str, float]:
    """The median seconds of SyncStats runs."""
    return {
        key: median([getattr(r, key) for r in runs])
        for key in ("transfer_s", "pause_to_resume_s", "pause_s", "prepare_s", "commit_s", "stage_s")
    }


def moved(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """`weights` with `fraction` of every tensor's elements changed, at random places."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        flat = t.clone().view(-1)
        at = torch.randperm(flat.numel(), generator=g)[: max(1, int(flat.numel() * fraction))]
        flat[at] += 0.01
        out[name] = flat.view(t.shape)
    return out


def sparse_seconds(
    target: str, weights: dict[str, torch.Tensor], fraction: float, repeats: int, server_pid: int
) -> dict[str, float]:
    with Client(target) as client:
        sync = WeightSync(client, bucket_bytes=BUCKET_BYTES)
        sync.init()
        sync.sync(weights, "sparse-base", patch=True)  # whole: the copy later patches diff against
        steps = [moved(weights, fraction, seed=100 + i) for i in range(repeats + 1)]
        settle(server_pid)
        runs = [sync.sync(w, f"sparse-{i}", patch=True) for i, w in enumerate(steps)][1:]
        sync.close()
    return {**medians(runs), "num_bytes": runs[0].num_bytes}


def memcpy_seconds(weights: dict[str, torch.Tensor], repeats: int) -> float:
    """One thread copying the weights' bytes into a buffer of their size, as a trainer
    writing them into shared memory does."""
    src = torch.cat([t.reshape(-1).view(torch.uint8) for t in weights.values()])
    dst = torch.empty_like(src)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return median(times[1:])


# --- checkpoint: save safetensors, vLLM reloads them ----------------------------------------


def _checkpoint_engine(model_dir: str, dtype: str, conn) -> None:
    import asyncio

    from rlserve.config import EngineConfig
    from rlserve.engine.adapter import EngineAdapter

    async def main() -> None:
        cfg = EngineConfig(model=model_dir, dtype=dtype, max_model_len=512, enforce_eager=True, kv_cache_gib=0.5)
        engine = EngineAdapter.start(cfg)
        conn.send("ready")
        while (path := conn.recv()) is not None:
            t0 = time.perf_counter()
            await engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            conn.send(time.perf_counter() - t0)
        engine.shutdown()

    asyncio.run(main())


def checkpoint_seconds(
    model_dir: Path, weights: dict[str, torch.Tensor], repeats: int, work: Path, dtype: str
) -> dict[str, float]:
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_checkpoint_engine, args=(str(model_dir), dtype, child))
    proc.start()
    assert parent.recv() == "ready"
    totals, saves = [], []
    for _ in range(repeats + 1):
        ckpt = Path(tempfile.mkdtemp(dir=work, prefix="ckpt-"))
        for f in model_dir.iterdir():  # config and tokenizer travel with the weights
            if f.suffix != ".safetensors":
                (ckpt / f.name).write_bytes(f.read_bytes())
        t0 = time.perf_counter()
        save_file({n: t.contiguous() for n, t in weights.items()}, str(ckpt / "model.safetensors"))
        saves.append(time.perf_counter() - t0)
        parent.send(str(ckpt))
        parent.recv()
        totals.append(time.perf_counter() - t0)
    parent.send(None)
    proc.join()
    return {"total_s": median(totals[1:]), "save_s": median(saves[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="what the servers compute in, and every path moves")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlserve-bench")
    args = p.parse_args()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, dict] = {}
    for name, model_dir in model_dirs(args.models.split(","), work).items():
        weights = perturbed(model_dir, seed=1, dtype=getattr(torch, args.dtype))
        r: dict[str, object] = {"num_tensors": len(weights), "num_bytes": nbytes(weights)}
        log(f"{name}: {len(weights)} tensors, {nbytes(weights) / 1e6:.1f} MB")
        floors = floor_seconds(weights, args.repeats)
        # The faster of the two raw layouts: rlserve's choice of layout cannot lower its bar.
        r["floor_s"] = min(floors.values())
        r["floor_bucketed_s"], r["floor_per_tensor_s"] = floors["bucket"], floors["tensor"]
        r["memcpy_s"] = memcpy_seconds(weights, args.repeats)
        proc, target = serve(model_dir, work, args.dtype)
        try:
            r["rlserve"] = sdk_seconds(target, weights, args.repeats, False, proc.pid, load=True)
            r["rlserve_paused"] = sdk_seconds(target, weights, args.repeats, False, proc.pid, staged=False)
            r["per_tensor"] = sdk_seconds(target, weights, max(1, args.repeats // 3), True, proc.pid)
            r["sparse_1pct"] = sparse_seconds(target, weights, 0.01, args.repeats, proc.pid)
            r["sparse_10pct"] = sparse_seconds(target, weights, 0.10, args.repeats, proc.pid)
        finally:
            stop_tree(proc.pid)
        proc, target = serve(model_dir, work, args.dtype, "rlserve_gloo", "--weight-update-mode", "in-place")
        try:
            r["in_place"] = sdk_seconds(target, weights, args.repeats, False, proc.pid)
        finally:
            stop_tree(proc.pid)
        proc, target = serve(model_dir, work, args.dtype, backend="rlserve_shm")
        try:
            r["shm"] = sdk_seconds(target, weights, args.repeats, False, proc.pid, load=True)
            r["shm_paused"] = sdk_seconds(target, weights, args.repeats, False, proc.pid, staged=False)
        finally:
            stop_tree(proc.pid)
        r["checkpoint"] = checkpoint_seconds(model_dir, weights, args.repeats, work, args.dtype)
        # The transfer against its floor without the generation load the staged legs share
        # the cores with.
        rl = r["rlserve_paused"]["transfer_s"]  # type: ignore[index]
        r["ratios"] = {
            "rlserve_over_floor": rl / r["floor_s"],  # target <= 1.25
            # End to end: the checkpoint path's save + reload against rlserve's whole window.
            "checkpoint_over_rlserve": r["checkpoint"]["total_s"] / r["rlserve"]["pause_to_resume_s"],  # type: ignore[index]  target >= 3
            "per_tensor_over_rlserve": r["per_tensor"]["transfer_s"] / rl,  # type: ignore[index]  target >= 5
            "pause_to_resume_over_transfer": r["rlserve"]["pause_to_resume_s"] / rl,  # type: ignore[index]  <= 1.15
            # rlserve_shm: end to end (pause -> resume) against rlserve_gloo, target >= 2; its
            # transfer's bandwidth against one thread's memcpy of the same bytes, target >= 0.4.
            "gloo_over_shm_pause_to_resume": r["rlserve"]["pause_to_resume_s"] / r["shm"]["pause_to_resume_s"],  # type: ignore[index]
            "shm_bandwidth_over_memcpy": r["memcpy_s"] / r["shm_paused"]["transfer_s"],  # type: ignore[index,operator]
            # A sync of 1% changed elements against a whole one, end to end; target >= 10.
            "dense_over_sparse_1pct": r["rlserve"]["pause_to_resume_s"] / r["sparse_1pct"]["pause_to_resume_s"],  # type: ignore[index]
            "dense_over_sparse_10pct": r["rlserve"]["pause_to_resume_s"] / r["sparse_10pct"]["pause_to_resume_s"],  # type: ignore[index]
            # Staged against paused for the whole sync: how much shorter generation stops.
            "gloo_paused_over_staged_pause": r["rlserve_paused"]["pause_to_resume_s"]
            / r["rlserve"]["pause_to_resume_s"],  # type: ignore[index]
            "shm_paused_over_staged_pause": r["shm_paused"]["pause_to_resume_s"] / r["shm"]["pause_to_resume_s"],  # type: ignore[index]
            "checkpoint_over_shm_staged_pause": r["checkpoint"]["total_s"] / r["shm"]["pause_to_resume_s"],  # type: ignore[index]
            "staging_over_idle_tokens_per_s": r["shm"]["tokens_per_s_while_staging"] / r["shm"]["tokens_per_s_idle"],  # type: ignore[index]
        }
        result[name] = r
        log(json.dumps({name: r}))
    print(json.dumps({"benchmark": "weight_sync", "bucket_bytes": BUCKET_BYTES, "models": result}))


if __name__ == "__main__":
    main()
