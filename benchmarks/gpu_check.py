"""GPU check for sleep/wake (run it on a machine with a CUDA GPU and the CUDA `vllm` build:
`make install TARGET=gpu`, then `.venv/bin/python benchmarks/gpu_check.py`).

Starts `rlserve serve --enable-sleep-mode` on the default model and runs, through gRPC:
Sleep(1) → WakeUp(weights) → WakeUp(kv_cache) → generate; Sleep(2) → WakeUp() → resume
(must be refused: the weights are gone) → IsSleeping. It records the GPU memory in use
(`torch.cuda.mem_get_info` from this process: the server's usage shows as used memory) after
each step and the wall time of each call, and prints one JSON line. Not run in CI: the CPU
platform has no sleep mode (the same rules are unit-tested with a test double there).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import child_env, free_port, stop_tree  # noqa: E402

from rlserve.api.vllm import control_pb2 as cpb  # noqa: E402
from rlserve.sdk.client import Client  # noqa: E402


def used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 3)


def timed(results: dict, name: str, call) -> object:
    t0 = time.perf_counter()
    try:
        out = call()
        code = "OK"
    except grpc.RpcError as e:
        out, code = None, e.code().name
    results[name] = {"s": round(time.perf_counter() - t0, 4), "code": code, "gpu_used_gib": used_gib()}
    return out


def main() -> None:
    port = free_port()
    log = open("gpu_check_server.log", "wb")
    cmd = [sys.executable, "-m", "rlserve", "serve", "--port", str(port), "--enable-sleep-mode", "--dtype", "bfloat16"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=child_env(), start_new_session=True)
    results: dict = {"before_start_gpu_used_gib": used_gib()}
    try:
        with Client(f"127.0.0.1:{port}") as c:
            c.wait_ready(600)
            results["serving_gpu_used_gib"] = used_gib()
            caps = c.server_info().rl_capabilities
            results["sleep_mode_enabled"] = caps.sleep_mode_enabled
            ctl = c.control
            timed(results, "sleep_1", lambda: ctl.Sleep(cpb.SleepRequest(level=1)))
            timed(results, "is_sleeping_1", lambda: ctl.IsSleeping(cpb.IsSleepingRequest()))
            timed(results, "wake_weights", lambda: ctl.WakeUp(cpb.WakeUpRequest(tags=["weights"])))
            timed(results, "wake_kv_cache", lambda: ctl.WakeUp(cpb.WakeUpRequest(tags=["kv_cache"])))
            text = timed(
                results, "generate_after_level_1", lambda: c.generate("The capital of France is", max_new_tokens=8)
            )
            results["text_after_level_1"] = text.outputs.text if text else None
            timed(results, "sleep_2", lambda: ctl.Sleep(cpb.SleepRequest(level=2)))
            timed(results, "wake_all", lambda: ctl.WakeUp(cpb.WakeUpRequest()))
            timed(results, "resume_after_level_2", lambda: ctl.ResumeGeneration(cpb.ResumeGenerationRequest()))
            timed(results, "is_sleeping_end", lambda: ctl.IsSleeping(cpb.IsSleepingRequest()))
    finally:
        stop_tree(proc.pid)
    ok = results.get("resume_after_level_2", {}).get("code") == "FAILED_PRECONDITION"
    print(json.dumps({"benchmark": "gpu_check", "resume_refused_after_level_2": ok, **results}))


if __name__ == "__main__":
    main()
