"""Fleet sync, side by side: one `Fleet.sync()` into 1, 2 and 3 servers, against syncing 2
servers one after the other with the single-server SDK, in one run, with the same weights.

Three `rlserve serve --weight-transfer-backend rlserve_gloo` servers run the whole time (the
same model and dtype). Legs:
- fleet_1, fleet_2, fleet_3: `Fleet(servers[:n]).sync(weights, version)`: one gloo group with
  the trainer and every server's workers, one broadcast per bucket, the prepare vote, the
  commit and the digest check on every server;
- sequential_2: `WeightSync(server).sync(...)` into the first server, then the second (each
  its own group, its own broadcast), as a trainer without a fleet does it.
Each server's worker is bound to a core of its own where the machine has one per server
(`VLLM_CPU_OMP_THREADS_BIND`, round robin; vLLM's automatic binding puts every server on the
same core, which no fleet of real hosts does); `--no-pin` leaves vLLM's binding.
Each leg is warmed up once (its rendezvous and first sync), then timed --repeats times; the
figure is the median wall time of the call(s) (pause of the first server to resume of the
last, digests verified). The last stdout line is one JSON object with the seconds and the
ratios the targets are stated in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, stop_tree  # noqa: E402
from weight_sync import model_dirs, nbytes, perturbed, serve  # noqa: E402

from rlserve.sdk.client import Client  # noqa: E402
from rlserve.sdk.fleet import Fleet  # noqa: E402
from rlserve.sdk.weight_sync import WeightSync  # noqa: E402

TARGETS = {"fleet_2_over_fleet_1": "<= 1.25", "fleet_2_over_sequential_2": "<= 0.65"}


def log(msg: str) -> None:
    print(f"[fleet_sync] {msg}", file=sys.stderr, flush=True)


def fleet_seconds(targets: list[str], weights: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    with Fleet(targets) as fleet:
        fleet.init(require_same_weights=False)
        fleet.sync(weights, "warm-up")
        walls, runs = [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            runs.append(fleet.sync(weights, f"fleet-{len(targets)}-{i}"))
            walls.append(time.perf_counter() - t0)
    return {
        "wall_s": median(walls),
        **{key: median([getattr(r, key) for r in runs]) for key in ("transfer_s", "prepare_s", "commit_s")},
    }


def sequential_seconds(targets: list[str], weights: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    clients = [Client(t) for t in targets]
    syncs = [WeightSync(c) for c in clients]
    try:
        for sync in syncs:
            sync.init()
            sync.sync(weights, "warm-up")
        walls = []
        for i in range(repeats):
            t0 = time.perf_counter()
            for sync in syncs:
                sync.sync(weights, f"sequential-{i}")
            walls.append(time.perf_counter() - t0)
    finally:
        for sync, client in zip(syncs, clients, strict=True):
            sync.close()
            client.close()
    return {"wall_s": median(walls)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2", choices=("tiny", "smollm2"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="what the servers compute in, and every leg moves")
    p.add_argument("--no-pin", action="store_true", help="leave vLLM's own CPU binding")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "rlserve-bench")
    args = p.parse_args()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    model_dir = model_dirs([args.model], work)[args.model]
    weights = perturbed(model_dir, seed=1, dtype=getattr(torch, args.dtype))
    log(f"{args.model}: {len(weights)} tensors, {nbytes(weights) / 1e6:.1f} MB; starting 3 servers")
    procs, targets = [], []
    try:
        cores = sorted(os.sched_getaffinity(0))
        pinned = [] if args.no_pin else [cores[i % len(cores)] for i in range(3)]
        for i in range(3):
            if pinned:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(pinned[i])
            proc, target = serve(model_dir, work, args.dtype)
            procs.append(proc)
            targets.append(target)
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        r: dict[str, object] = {
            "model": args.model,
            "num_tensors": len(weights),
            "num_bytes": nbytes(weights),
            "cpu_count": len(cores),
            "worker_cores": pinned or "vllm auto",
        }
        for n in (1, 2, 3):
            log(f"fleet of {n}")
            r[f"fleet_{n}"] = fleet_seconds(targets[:n], weights, args.repeats)
        log("two servers one after the other")
        r["sequential_2"] = sequential_seconds(targets[:2], weights, args.repeats)
    finally:
        for proc in procs:
            stop_tree(proc.pid)
    wall = {k: v["wall_s"] for k, v in r.items() if isinstance(v, dict)}  # type: ignore[index]
    r["ratios"] = {
        "fleet_2_over_fleet_1": wall["fleet_2"] / wall["fleet_1"],
        "fleet_3_over_fleet_1": wall["fleet_3"] / wall["fleet_1"],
        "fleet_2_over_sequential_2": wall["fleet_2"] / wall["sequential_2"],
    }
    r["targets"] = TARGETS
    print(json.dumps(r))


if __name__ == "__main__":
    main()
