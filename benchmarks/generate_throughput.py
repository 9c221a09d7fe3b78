"""Streaming generation throughput and frontend CPU: rlserve against vLLM's own frontends.

One workload (default 16 concurrent requests x 64 new tokens, greedy, ignore_eos, the same text
prompts, model, fp32 and engine settings) runs through each leg in turn, one engine at a time:
  asyncllm  vLLM's AsyncLLM in a child process driven by itself: the zero-overhead reference
  rlserve   `rlserve serve`, driven over gRPC GenerateStream from this process
  vllm_http vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`), streaming
            /v1/completions
  vllm_rs   vLLM's Rust frontend (`vllm-rs serve --grpc-port`), the same GenerateStream client
Each leg warms up, then repeats the measured run (--repeats) and reports medians.

The last stdout line is one JSON object: per leg `tokens_per_s` (generated tokens / wall time of
the run), `latency_p50_s`/`latency_p99_s` (per request, pooled over the runs), `frontend_cpu_s`
and `frontend_cpu_ms_per_token`: user+system CPU of the frontend process alone during a run,
excluding its EngineCore/Worker descendants (`engine_cpu_s`) and other descendants such as
vllm-rs's Python launcher (`helper_cpu_s`, reported, not counted). For asyncllm the frontend is
the child process itself, so its figure also holds the (tiny) driving loop; for the servers the
client runs here and its CPU is `client_cpu_ms_per_token`. `ratios` compares rlserve with the
others (throughput: higher is better; cpu_per_token: lower is better). A leg that could not run
holds `unavailable` with the reason. `loadavg_start` is os.getloadavg() as the leg began: the
machine is shared, so a high one means noisy figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

LEGS = ("asyncllm", "rlserve", "vllm_http", "vllm_rs")
ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "512", "--enforce-eager")
READY_TIMEOUT_S = 600.0
WARMUP_MAX_NEW_TOKENS = 16
TARGETS = {
    "rlserve_over_vllm_rs_throughput": ">= 0.97",
    "rlserve_over_asyncllm_throughput": ">= 0.95",
    "rlserve_over_http_throughput": "> 1",
    "rlserve_over_vllm_rs_cpu_per_token": "<= 2",
}

# One request: (prompt, max_new_tokens) -> (latency_s, num_generated_tokens).
RequestFn = Callable[[str, int], Awaitable[tuple[float, int]]]


def prompts(num_requests: int) -> list[str]:
    return [f"Request {i}: tell me a short story about the number {i} and a lighthouse." for i in range(num_requests)]


@dataclass(frozen=True)
class Run:
    wall_s: float
    num_tokens: int
    latencies_s: list[float]
    frontend_cpu_s: float
    engine_cpu_s: float
    helper_cpu_s: float
    client_cpu_s: float | None


async def run_workload(one: RequestFn, texts: list[str], max_new_tokens: int) -> tuple[float, list[float], int]:
    """All requests at once; fails if any request produced a different number of tokens."""
    start = time.perf_counter()
    results = await asyncio.gather(*(one(t, max_new_tokens) for t in texts))
    wall_s = time.perf_counter() - start
    counts = {n for _, n in results}
    if counts != {max_new_tokens}:
        raise RuntimeError(f"expected {max_new_tokens} tokens per request, got {sorted(counts)}")
    return wall_s, [lat for lat, _ in results], sum(n for _, n in results)


async def measure(one: RequestFn, args: argparse.Namespace, frontend: psutil.Process, client: psutil.Process | None) -> list[Run]:
    texts = prompts(args.num_requests)
    await run_workload(one, texts, WARMUP_MAX_NEW_TOKENS)
    runs = []
    for _ in range(args.repeats):
        before = common.cpu_snapshot(frontend)
        client_before = common.cpu_s(client) if client else 0.0
        wall_s, latencies, num_tokens = await run_workload(one, texts, args.max_new_tokens)
        cpu = common.cpu_snapshot(frontend).minus(before)
        client_cpu = common.cpu_s(client) - client_before if client else None
        runs.append(Run(wall_s, num_tokens, latencies, cpu.frontend_s, cpu.engine_s, cpu.helper_s, client_cpu))
    return runs


def summarize(runs: list[Run]) -> dict:
    per_token = [r.frontend_cpu_s * 1000 / r.num_tokens for r in runs]
    latencies = [x for r in runs for x in r.latencies_s]
    out = {
        "tokens_per_s": round(common.median([r.num_tokens / r.wall_s for r in runs]), 1),
        "tokens_per_s_runs": [round(r.num_tokens / r.wall_s, 1) for r in runs],
        "latency_p50_s": round(common.percentile(latencies, 50), 3),
        "latency_p99_s": round(common.percentile(latencies, 99), 3),
        "frontend_cpu_s": round(common.median([r.frontend_cpu_s for r in runs]), 3),
        "frontend_cpu_ms_per_token": round(common.median(per_token), 3),
        "engine_cpu_s": round(common.median([r.engine_cpu_s for r in runs]), 3),
        "helper_cpu_s": round(common.median([r.helper_cpu_s for r in runs]), 3),
    }
    if runs[0].client_cpu_s is not None:
        out["client_cpu_ms_per_token"] = round(common.median([r.client_cpu_s * 1000 / r.num_tokens for r in runs]), 3)
    return out


# --- clients -------------------------------------------------------------------------------

def grpc_request_fn(channel) -> RequestFn:
    from rlserve.api.vllm import inference_pb2_grpc
    from rlserve.client import generate_request

    stub = inference_pb2_grpc.InferenceStub(channel)

    async def one(prompt: str, max_new_tokens: int) -> tuple[float, int]:
        start, num_tokens = time.perf_counter(), 0
        request = generate_request(prompt, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        async for response in stub.GenerateStream(request):
            num_tokens += response.outputs.num_tokens
        return time.perf_counter() - start, num_tokens

    return one


def http_request_fn(session, base_url: str, model: str) -> RequestFn:
    async def one(prompt: str, max_new_tokens: int) -> tuple[float, int]:
        body = {
            "model": model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }
        start, num_tokens = time.perf_counter(), 0
        async with session.post(f"{base_url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    num_tokens = usage["completion_tokens"]
        return time.perf_counter() - start, num_tokens

    return one


# --- servers -------------------------------------------------------------------------------

@asynccontextmanager
async def server(cmd: list[str], log_path: Path):
    """Start a server process (own session, output to `log_path`); stop its whole tree on exit."""
    print(f"[bench] $ {' '.join(cmd)}", file=sys.stderr)
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=log, stderr=log, env=common.child_env(), start_new_session=True
        )
    try:
        yield proc
    finally:
        await asyncio.to_thread(common.stop_tree, proc.pid)


async def until_ready(ready: Awaitable[None], proc, log_path: Path) -> None:
    """Wait for `ready`, failing fast (with the log's tail) if the server exits first."""
    ready_task, exit_task = asyncio.ensure_future(ready), asyncio.ensure_future(proc.wait())
    done, _ = await asyncio.wait({ready_task, exit_task}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
    for task in (ready_task, exit_task):
        if task not in done:
            task.cancel()
    if ready_task not in done:
        why = f"exited with {proc.returncode}" if exit_task in done else f"not ready in {READY_TIMEOUT_S} s"
        raise RuntimeError(f"server {why}; last log lines:\n{common.tail(log_path)}")
    ready_task.result()


async def grpc_serving(channel) -> None:
    """Health Watch streams status changes; wait_for_ready covers the time before the bind."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True)
    async for update in watch:
        if update.status == health_pb2.HealthCheckResponse.SERVING:
            watch.cancel()
            return


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


async def grpc_leg(cmd: list[str], port: int, args: argparse.Namespace, log_path: Path) -> tuple[list[Run], list[str]]:
    import grpc

    async with server(cmd, log_path) as proc, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await until_ready(grpc_serving(channel), proc, log_path)
        frontend = psutil.Process(proc.pid)
        runs = await measure(grpc_request_fn(channel), args, frontend, psutil.Process())
        return runs, common.describe_tree(frontend)


async def http_leg(cmd: list[str], port: int, model: str, args: argparse.Namespace, log_path: Path):
    import aiohttp

    base_url = f"http://127.0.0.1:{port}"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with server(cmd, log_path) as proc, aiohttp.ClientSession(timeout=timeout) as session:
        await until_ready(http_healthy(session, base_url), proc, log_path)
        frontend = psutil.Process(proc.pid)
        runs = await measure(http_request_fn(session, base_url, model), args, frontend, psutil.Process())
        return runs, common.describe_tree(frontend)


async def asyncllm_leg(args: argparse.Namespace, log_path: Path):
    """The reference runs in a child process so its CPU is not mixed with this process's."""
    result_path = log_path.with_suffix(".json")
    cmd = [sys.executable, __file__, "--asyncllm-child", str(result_path), "--model", args.model,
           "--num-requests", str(args.num_requests), "--max-new-tokens", str(args.max_new_tokens),
           "--repeats", str(args.repeats)]
    async with server(cmd, log_path) as proc:
        if await proc.wait() != 0:
            raise RuntimeError(f"the AsyncLLM child failed; last log lines:\n{common.tail(log_path)}")
    result = json.loads(result_path.read_text())
    return [Run(**r) for r in result["runs"]], result["tree"]


async def asyncllm_child(args: argparse.Namespace) -> None:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs(model=args.model, dtype="float32", max_model_len=512, enforce_eager=True)
    llm = AsyncLLM.from_engine_args(engine_args)
    counter = iter(range(1 << 62))

    async def one(prompt: str, max_new_tokens: int) -> tuple[float, int]:
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        start, num_tokens = time.perf_counter(), 0
        async for out in llm.generate(prompt, params, f"req-{next(counter)}"):
            num_tokens += len(out.outputs[0].token_ids)
        return time.perf_counter() - start, num_tokens

    try:
        me = psutil.Process()
        runs = await measure(one, args, me, None)
        result = {"runs": [asdict(r) for r in runs], "tree": common.describe_tree(me)}
        Path(args.asyncllm_child).write_text(json.dumps(result))
    finally:
        llm.shutdown()


# --- driver --------------------------------------------------------------------------------

async def run_leg(name: str, args: argparse.Namespace, work_dir: Path) -> dict:
    log_path = work_dir / f"{name}.log"
    info: dict = {"loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    started = time.perf_counter()
    if name == "asyncllm":
        runs, tree = await asyncllm_leg(args, log_path)
        info["frontend"] = "the AsyncLLM child process (includes its driving loop)"
    elif name == "rlserve":
        port = common.free_port()
        cmd = [sys.executable, "-m", "rlserve", "serve", "--model", args.model, "--port", str(port), *ENGINE_FLAGS]
        runs, tree = await grpc_leg(cmd, port, args, log_path)
        info["frontend"] = "the `python -m rlserve serve` process"
    elif name == "vllm_http":
        port = common.free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
               "--host", "127.0.0.1", "--port", str(port), *ENGINE_FLAGS]
        runs, tree = await http_leg(cmd, port, args.model, args, log_path)
        info["frontend"] = "the api_server process (one API server)"
    else:
        binary = common.vllm_rs_binary(work_dir)
        if isinstance(binary, str):
            return {**info, "unavailable": binary}
        python = common.python_with_vllm_dist(work_dir)
        grpc_port, http_port = common.free_port(), common.free_port()
        cmd = [str(binary), "serve", args.model, "--port", str(http_port), "--grpc-port", str(grpc_port),
               "--python", str(python), *ENGINE_FLAGS]
        runs, tree = await grpc_leg(cmd, grpc_port, args, log_path)
        info["frontend"] = "the vllm-rs (Rust) process only; its Python launcher is helper_cpu_s"
    info["elapsed_s"] = round(time.perf_counter() - started, 1)
    return {**summarize(runs), **info, "descendants": tree, "log": str(log_path)}


def ratios(legs: dict) -> dict:
    def get(leg: str, key: str) -> float | None:
        return legs.get(leg, {}).get(key)

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    tps, cpu = "tokens_per_s", "frontend_cpu_ms_per_token"
    return {
        "rlserve_over_vllm_rs_throughput": div(get("rlserve", tps), get("vllm_rs", tps)),
        "rlserve_over_asyncllm_throughput": div(get("rlserve", tps), get("asyncllm", tps)),
        "rlserve_over_http_throughput": div(get("rlserve", tps), get("vllm_http", tps)),
        "rlserve_over_vllm_rs_cpu_per_token": div(get("rlserve", cpu), get("vllm_rs", cpu)),
    }


async def main(args: argparse.Namespace) -> dict:
    # SIGTERM cancels like Ctrl-C does, so every started server is stopped on the way out.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    if not args.model:
        args.model = str(common.make_bench_model(work_dir / "models" / "llama-h256-l4"))
    legs: dict = {}
    for name in args.legs:
        print(f"[bench] leg {name} ...", file=sys.stderr)
        try:
            legs[name] = await run_leg(name, args, work_dir)
        except Exception as e:  # noqa: BLE001 - one failed leg must not hide the others
            legs[name] = {"unavailable": f"failed: {type(e).__name__}: {e}"[:2000]}
        print(f"[bench] {name}: {json.dumps(legs[name])}", file=sys.stderr)
    return {
        "benchmark": "generate_throughput", "model": args.model, "num_requests": args.num_requests,
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "cpu_count": os.cpu_count(),
        "legs": legs, "ratios": ratios(legs), "targets": TARGETS,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF model directory (default: a ~16M random Llama made in --work-dir)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated subset of {','.join(LEGS)}")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "rlserve-bench"),
                   help="models, logs, the vllm-rs binary and the vllm shim venv go here")
    p.add_argument("--asyncllm-child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.legs = [leg.strip() for leg in args.legs.split(",") if leg.strip()]
    unknown = set(args.legs) - set(LEGS)
    if unknown:
        p.error(f"unknown legs {sorted(unknown)}; choose from {LEGS}")
    if args.num_requests < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        p.error("--num-requests, --max-new-tokens and --repeats must be >= 1")
    return args


if __name__ == "__main__":
    cli_args = parse_args()
    if cli_args.asyncllm_child:
        asyncio.run(asyncllm_child(cli_args))
    else:
        print(json.dumps(asyncio.run(main(cli_args))))
