"""Streaming generation throughput and frontend CPU: rlserve against vLLM's own frontends.

One workload (default 16 concurrent requests x 64 new tokens, greedy, ignore_eos, the same text
prompts, model, fp32 and engine settings) runs through each leg in turn, one engine at a time:
  asyncllm  vLLM's AsyncLLM in a child process driven by itself: the zero-overhead reference
  rlserve   `rlserve serve`, driven over gRPC GenerateStream from this process
  rlserve_nostats  the same with --disable-log-stats (no GetLoad figures, no vllm:* metrics)
  vllm_http vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`), streaming
            /v1/completions
  vllm_rs   vLLM's Rust frontend (`vllm-rs serve --grpc-port`), the same GenerateStream client
Each leg warms up, then repeats the measured run (--repeats).

The last stdout line is one JSON object. Per leg: `tokens_per_s` (generated tokens / wall time of
a run; the median run, all in `tokens_per_s_runs`), `latency_p50_s`/`latency_p99_s` (per request,
pooled over the runs), `frontend_cpu_s` (mean per run) and `frontend_cpu_ms_per_token` (over all
runs): user+system CPU of the frontend process alone, all its threads, from /proc. Reported but
not counted there: its EngineCore/Worker descendants (`engine_cpu_s`), other descendants such as
vllm-rs's Python launcher (`helper_cpu_s`), the client in this process (`client_cpu_ms_per_token`;
0 for asyncllm, whose frontend process also runs its own tiny driving loop), and everything else
on the machine (`foreign_cpu_s`) or taken by the hypervisor (`steal_cpu_s`): the machine is
shared, and large values, or a high `loadavg_start`, mean noisy figures. `messages_per_token`:
stream messages per token; below 1 the frontend fell behind and coalesced tokens, which also
lowers its CPU per token. `ratios` compares rlserve with
the others (throughput: higher is better; cpu_per_token: lower is better); a leg that could not
run holds `unavailable` with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

LEGS = ("asyncllm", "rlserve", "rlserve_nostats", "vllm_http", "vllm_rs")
MAX_MODEL_LEN = 512
ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager")
WARMUP_MAX_NEW_TOKENS = 16
TARGETS = {
    "rlserve_over_vllm_rs_throughput": ">= 0.97",
    "rlserve_over_asyncllm_throughput": ">= 0.95",
    "rlserve_over_http_throughput": "> 1",
    "rlserve_over_vllm_rs_cpu_per_token": "<= 2",
}

# One request: (prompt, max_new_tokens) -> (latency_s, generated tokens, streamed messages).
RequestFn = Callable[[str, int], Awaitable[tuple[float, int, int]]]


def prompts(num_requests: int) -> list[str]:
    return [f"Request {i}: tell me a short story about the number {i} and a lighthouse." for i in range(num_requests)]


@dataclass(frozen=True)
class Run:
    wall_s: float
    num_tokens: int
    num_messages: int
    latencies_s: list[float]
    frontend_cpu_s: float
    engine_cpu_s: float
    helper_cpu_s: float
    client_cpu_s: float
    foreign_cpu_s: float
    steal_cpu_s: float


async def run_workload(
    one: RequestFn, texts: list[str], max_new_tokens: int
) -> tuple[float, list[tuple[float, int, int]]]:
    """All requests at once; fails if any request produced a different number of tokens."""
    start = time.perf_counter()
    results = await asyncio.gather(*(one(t, max_new_tokens) for t in texts))
    wall_s = time.perf_counter() - start
    counts = {n for _, n, _ in results}
    if counts != {max_new_tokens}:
        raise RuntimeError(f"expected {max_new_tokens} tokens per request, got {sorted(counts)}")
    return wall_s, results


async def measure(
    one: RequestFn, args: argparse.Namespace, frontend: psutil.Process, client: psutil.Process | None
) -> list[Run]:
    """Warm up, then `args.repeats` measured runs. CPU is read from /proc around each run:
    the frontend, its descendants, the client (None: it is the frontend) and the whole machine."""
    texts = prompts(args.num_requests)
    await run_workload(one, texts, WARMUP_MAX_NEW_TOKENS)
    runs = []
    for _ in range(args.repeats):
        before, (busy_before, steal_before) = common.cpu_snapshot(frontend), common.machine_cpu_s()
        client_before = common.cpu_s(client) if client else 0.0
        wall_s, results = await run_workload(one, texts, args.max_new_tokens)
        cpu = common.cpu_snapshot(frontend).minus(before)
        client_cpu = common.cpu_s(client) - client_before if client else 0.0
        ours = cpu.frontend_s + cpu.engine_s + cpu.helper_s + client_cpu
        busy, steal = common.machine_cpu_s()
        latencies, num_tokens, num_messages = (list(column) for column in zip(*results))
        foreign, stolen = busy - busy_before - ours, steal - steal_before
        runs.append(
            Run(wall_s, sum(num_tokens), sum(num_messages), latencies, *cpu.as_tuple(), client_cpu, foreign, stolen)
        )
    return runs


def summarize(runs: list[Run]) -> dict:
    """Throughput: median run. CPU: totals over all runs (the /proc counters tick every 10 ms,
    ~10 us per token in one run), as seconds per run and milliseconds per generated token."""
    num_tokens = sum(r.num_tokens for r in runs)
    latencies = [x for r in runs for x in r.latencies_s]

    def per_run_s(field: str) -> float:
        return round(sum(getattr(r, field) for r in runs) / len(runs), 3)

    def ms_per_token(field: str) -> float:
        return round(sum(getattr(r, field) for r in runs) * 1000 / num_tokens, 4)

    return {
        "tokens_per_s": round(common.median([r.num_tokens / r.wall_s for r in runs]), 1),
        "tokens_per_s_runs": [round(r.num_tokens / r.wall_s, 1) for r in runs],
        "latency_p50_s": round(common.percentile(latencies, 50), 3),
        "latency_p99_s": round(common.percentile(latencies, 99), 3),
        "frontend_cpu_s": per_run_s("frontend_cpu_s"),
        "frontend_cpu_ms_per_token": ms_per_token("frontend_cpu_s"),
        "messages_per_token": round(sum(r.num_messages for r in runs) / num_tokens, 3),
        "client_cpu_ms_per_token": ms_per_token("client_cpu_s"),
        "engine_cpu_s": per_run_s("engine_cpu_s"),
        "helper_cpu_s": per_run_s("helper_cpu_s"),
        "foreign_cpu_s": per_run_s("foreign_cpu_s"),
        "steal_cpu_s": per_run_s("steal_cpu_s"),
    }


# --- clients -------------------------------------------------------------------------------


def grpc_request_fn(channel) -> RequestFn:
    from rlserve.api.vllm import inference_pb2_grpc
    from rlserve.client import generate_request

    stub = inference_pb2_grpc.InferenceStub(channel)

    async def one(prompt: str, max_new_tokens: int) -> tuple[float, int, int]:
        start, num_tokens, num_messages = time.perf_counter(), 0, 0
        request = generate_request(prompt, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        async for response in stub.GenerateStream(request):
            num_tokens += response.outputs.num_tokens
            num_messages += 1
        return time.perf_counter() - start, num_tokens, num_messages

    return one


def http_request_fn(session, base_url: str, model: str) -> RequestFn:
    async def one(prompt: str, max_new_tokens: int) -> tuple[float, int, int]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start, num_tokens, num_messages = time.perf_counter(), 0, 0
        async with session.post(f"{base_url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                num_messages += 1
                usage = json.loads(line[6:]).get("usage")
                if usage:  # the last event, with usage only (stream_options.include_usage)
                    num_tokens = usage["completion_tokens"]
        return time.perf_counter() - start, num_tokens, num_messages

    return one


# --- legs ----------------------------------------------------------------------------------


async def server_leg(
    cmd: list[str], log_path: Path, ready: Awaitable[None], one: RequestFn, args: argparse.Namespace
) -> tuple[list[Run], list[str]]:
    async with common.server(cmd, log_path) as proc:
        await common.until_ready(ready, proc, log_path)
        frontend = psutil.Process(proc.pid)
        runs = await measure(one, args, frontend, client=psutil.Process())
        return runs, common.describe_tree(frontend)


async def grpc_leg(cmd: list[str], port: int, args: argparse.Namespace, log_path: Path):
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await server_leg(cmd, log_path, common.grpc_serving(channel), grpc_request_fn(channel), args)


async def http_leg(cmd: list[str], port: int, model: str, args: argparse.Namespace, log_path: Path):
    import aiohttp

    base_url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)) as session:
        ready, one = common.http_healthy(session, base_url), http_request_fn(session, base_url, model)
        return await server_leg(cmd, log_path, ready, one, args)


async def asyncllm_leg(args: argparse.Namespace, log_path: Path):
    """The reference runs in a child process so its CPU is not mixed with this process's."""
    result_path = log_path.with_suffix(".json")
    workload = ["--num-requests", str(args.num_requests), "--max-new-tokens", str(args.max_new_tokens)]
    cmd = [sys.executable, __file__, "--asyncllm-child", str(result_path), "--model", args.model, *workload]
    cmd += ["--repeats", str(args.repeats)]
    async with common.server(cmd, log_path) as proc:
        if await proc.wait() != 0:
            raise RuntimeError(f"the AsyncLLM child failed; last log lines:\n{common.tail(log_path)}")
    result = json.loads(result_path.read_text())
    return [Run(**r) for r in result["runs"]], result["tree"]


async def asyncllm_child(args: argparse.Namespace) -> None:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=args.model, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True)
    )
    counter = iter(range(1 << 62))

    async def one(prompt: str, max_new_tokens: int) -> tuple[float, int, int]:
        params = SamplingParams(
            max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        start, num_tokens, num_messages = time.perf_counter(), 0, 0
        async for out in llm.generate(prompt, params, f"req-{next(counter)}"):
            num_tokens += len(out.outputs[0].token_ids)
            num_messages += 1
        return time.perf_counter() - start, num_tokens, num_messages

    try:
        me = psutil.Process()
        runs = await measure(one, args, me, client=None)
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
    elif name in ("rlserve", "rlserve_nostats"):
        port = common.free_port()
        cmd = [sys.executable, "-m", "rlserve", "serve", "--model", args.model, "--port", str(port), *ENGINE_FLAGS]
        if name == "rlserve_nostats":  # what vLLM's scheduler stats (GetLoad, vllm:* metrics) cost
            cmd.append("--disable-log-stats")
        runs, tree = await grpc_leg(cmd, port, args, log_path)
        info["frontend"] = "the `python -m rlserve serve` process"
    elif name == "vllm_http":
        port = common.free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--model", args.model, *ENGINE_FLAGS]
        runs, tree = await http_leg(cmd, port, args.model, args, log_path)
        info["frontend"] = "the api_server process (one API server)"
    else:
        binary = common.vllm_rs_binary(work_dir)
        if isinstance(binary, str):
            return {**info, "unavailable": binary}
        python = common.python_with_vllm_dist(work_dir)
        grpc_port, http_port = common.free_port(), common.free_port()
        cmd = [str(binary), "serve", args.model, "--port", str(http_port), "--grpc-port", str(grpc_port)]
        cmd += ["--python", str(python), *ENGINE_FLAGS]
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
        "rlserve_stats_over_nostats_cpu_per_token": div(get("rlserve", cpu), get("rlserve_nostats", cpu)),
    }


async def main(args: argparse.Namespace) -> dict:
    work_dir = await common.prepare_run(args)
    legs = await common.run_each("leg", args.legs, lambda name: run_leg(name, args, work_dir))
    return {
        "benchmark": "generate_throughput",
        "model": args.model,
        "num_requests": args.num_requests,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "cpu_count": os.cpu_count(),
        "legs": legs,
        "ratios": ratios(legs),
        "targets": TARGETS,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF model dir (default: a ~16M random Llama in --work-dir)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated subset of {','.join(LEGS)}")
    p.add_argument(
        "--work-dir",
        default=str(Path(tempfile.gettempdir()) / "rlserve-bench"),
        help="models, logs, the vllm-rs binary and the vllm shim venv go here",
    )
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
        try:
            result = asyncio.run(main(cli_args))
        except (KeyboardInterrupt, asyncio.CancelledError):
            sys.exit("[bench] interrupted; the servers it started were stopped")
        print(json.dumps(result))
