"""Generation throughput and frontend CPU per token: rlserve against vLLM's own frontends.

Each leg starts one engine (the same tiny Llama, fp32, engine settings) and runs each workload
(default 16 concurrent requests x 64 new tokens, greedy, ignore_eos, the same text prompts):
  stream_ids      GenerateStream, token ids only (output_text=false): what RL clients ask for
  stream_text     GenerateStream, token ids and text (the detokenizer runs)
  unary_logprobs  unary Generate, token ids and each token's logprob, no text
The legs, one engine at a time:
  asyncllm  vLLM's AsyncLLM in a child process driven by itself: the zero-overhead reference
            (the same three workloads as SamplingParams: detokenize off, on, FINAL_ONLY+logprobs)
  rlserve   `rlserve serve`, driven over gRPC from this process
  rlserve_nostats  the same with --disable-log-stats (no GetLoad figures, no vllm:* metrics)
  rlserve_frontends_N  `rlserve serve --frontends N` (N = 1, 2), a connection per request (the
            kernel spreads them over the processes); their CPU counted together, capacity by the
            busiest process
  vllm_http vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`), streaming
            /v1/completions (stream_text only: that API always returns text)
  vllm_rs   vLLM's Rust frontend (`vllm-rs serve --grpc-port`), the same gRPC client
  grpc_floor  a bare grpc.aio server with no engine (`grpc_floor.py`), streaming the same messages
            at the step time rlserve's leg had (or --floor-step-ms): what grpcio alone costs
Each workload warms up, then repeats the measured run (--repeats); --rounds N runs the legs in
turn N times and pools each leg's runs, so slow drift on the machine hits every leg alike.

The last stdout line is one JSON object. Per leg and workload: `tokens_per_s` (generated tokens
/ wall time of a run; the median run, all in `tokens_per_s_runs`), `latency_p50_s`/`latency_p99_s`
(per request, pooled over the runs), `frontend_cpu_s` (mean per run) and
`frontend_cpu_ms_per_token` (over all runs): user+system CPU of the frontend process alone, all
its threads, from /proc; `frontend_capacity_tokens_per_s` is 1000 / that figure, the tokens per
second one core of frontend CPU would carry at this cost per token (the ceiling before the
frontend itself is the limit). Reported but not counted there: its EngineCore/Worker descendants
(`engine_cpu_s`), other descendants such as vllm-rs's Python launcher (`helper_cpu_s`), the client
in this process (`client_cpu_ms_per_token`; 0 for asyncllm, whose frontend process also runs its
own tiny driving loop), and everything else on the machine (`foreign_cpu_s`) or taken by the
hypervisor (`steal_cpu_s`): the machine is shared, and large values, or a high `loadavg_start`,
mean noisy figures. `messages_per_token`: messages per token; below 1 in a stream the frontend
fell behind and coalesced tokens, which also lowers its CPU per token. `ratios` compares rlserve
with the others per workload (throughput: higher is better; cpu_per_token: lower is better); a
leg or workload that could not run holds `unavailable` with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
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

FRONTEND_LEGS = ("rlserve_frontends_1", "rlserve_frontends_2")
LEGS = ("asyncllm", "rlserve", "rlserve_nostats", *FRONTEND_LEGS, "vllm_http", "vllm_rs", "grpc_floor")
WORKLOADS = ("stream_ids", "stream_text", "unary_logprobs")
MAX_MODEL_LEN = 512
ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager")
TARGETS = {
    "stream_ids": {"rlserve_over_vllm_rs_cpu_per_token": "<= 2", "rlserve_over_vllm_rs_throughput": ">= 0.97"},
    "stream_text": {"rlserve_over_vllm_rs_cpu_per_token": "<= 3", "rlserve_over_http_throughput": "> 1"},
    "unary_logprobs": {"rlserve_over_vllm_rs_cpu_per_token": "<= 2"},
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
    # Of frontend_cpu_s, the frontend process that used the most (the only one, but for
    # rlserve_frontends_N): the first to run out of its core.
    busiest_frontend_cpu_s: float = 0.0


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


# A leg's workloads: name -> its request function, or why the leg cannot run it.
Workloads = dict[str, "RequestFn | str"]


async def measure(
    one: RequestFn, args: argparse.Namespace, frontend: psutil.Process, client: psutil.Process | None
) -> list[Run]:
    """One untimed run to warm up, then `args.repeats` measured runs. CPU is read from /proc
    around each run: the frontend, its descendants, the client (None: it is the frontend) and
    the whole machine."""
    texts = prompts(args.num_requests)
    await run_workload(one, texts, args.max_new_tokens)
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
            Run(
                wall_s, sum(num_tokens), sum(num_messages), latencies, *cpu.as_tuple(), client_cpu, foreign, stolen,
                cpu.busiest_frontend_s,
            )
        )  # fmt: skip
    return runs


async def measure_workloads(
    workloads: Workloads, args: argparse.Namespace, frontend: psutil.Process, client: psutil.Process | None
) -> dict[str, list[Run] | str]:
    """Each workload asked for in turn on the same engine: its runs, or why it cannot run."""
    results: dict[str, list[Run] | str] = {}
    for name in args.workloads:
        one = workloads.get(name, "not offered by this frontend")
        results[name] = one if isinstance(one, str) else await measure(one, args, frontend, client)
    return results


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
        "frontend_capacity_tokens_per_s": capacity(ms_per_token("busiest_frontend_cpu_s")),
        "messages_per_token": round(sum(r.num_messages for r in runs) / num_tokens, 3),
        "client_cpu_ms_per_token": ms_per_token("client_cpu_s"),
        "engine_cpu_s": per_run_s("engine_cpu_s"),
        "helper_cpu_s": per_run_s("helper_cpu_s"),
        "foreign_cpu_s": per_run_s("foreign_cpu_s"),
        "steal_cpu_s": per_run_s("steal_cpu_s"),
    }


def capacity(cpu_ms_per_token: float) -> float | None:
    """Tokens per second the frontend carries before its busiest process has used a whole core
    (one process: 1000 / its CPU ms per token; N processes share the tokens)."""
    return round(1000 / cpu_ms_per_token) if cpu_ms_per_token > 0 else None


# --- clients -------------------------------------------------------------------------------


def grpc_workloads(*channels) -> Workloads:
    """The three workloads as vllm.Inference calls; the same client for rlserve and vllm-rs.
    Requests take the channels (connections) in turn. A response without what was asked for
    (text, a logprob per token) fails the run."""
    from rlserve.api.vllm import inference_pb2_grpc
    from rlserve.sdk.client import generate_request

    stubs = itertools.cycle([inference_pb2_grpc.InferenceStub(channel) for channel in channels])

    def request(prompt: str, max_new_tokens: int, *, text: bool, logprobs: bool = False):
        req = generate_request(
            prompt, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, output_logprobs=logprobs
        )
        req.response.output_text = text
        return req

    def streaming(text: bool) -> RequestFn:
        async def one(prompt: str, max_new_tokens: int) -> tuple[float, int, int]:
            start, num_tokens, num_messages, got_text = time.perf_counter(), 0, 0, False
            async for response in next(stubs).GenerateStream(request(prompt, max_new_tokens, text=text)):
                num_tokens += response.outputs.num_tokens
                num_messages += 1
                got_text = got_text or bool(response.outputs.text)
            if got_text != text:
                raise RuntimeError(f"asked for text={text}, the stream {'had' if got_text else 'had no'} text")
            return time.perf_counter() - start, num_tokens, num_messages

        return one

    async def unary_logprobs(prompt: str, max_new_tokens: int) -> tuple[float, int, int]:
        start = time.perf_counter()
        response = await next(stubs).Generate(request(prompt, max_new_tokens, text=False, logprobs=True))
        out = response.outputs
        if len(out.logprobs) != len(out.token_ids) or out.text:
            raise RuntimeError(f"{len(out.token_ids)} tokens with {len(out.logprobs)} logprobs, text {out.text!r}")
        return time.perf_counter() - start, len(out.token_ids), 1

    return {"stream_ids": streaming(False), "stream_text": streaming(True), "unary_logprobs": unary_logprobs}


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
    cmd: list[str], log_path: Path, ready: Awaitable[None], workloads: Workloads, args: argparse.Namespace
) -> tuple[dict[str, list[Run] | str], list[str]]:
    async with common.server(cmd, log_path) as proc:
        await common.until_ready(ready, proc, log_path)
        frontend = psutil.Process(proc.pid)
        runs = await measure_workloads(workloads, args, frontend, client=psutil.Process())
        return runs, common.describe_tree(frontend)


async def grpc_leg(cmd: list[str], port: int, args: argparse.Namespace, log_path: Path):
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await server_leg(cmd, log_path, common.grpc_serving(channel), grpc_workloads(channel), args)


async def frontends_leg(
    cmd: list[str], port: int, control_port: int, num_frontends: int, args: argparse.Namespace, log_path: Path
):
    """rlserve with several frontend processes on one port: a connection per request, so the
    kernel spreads the requests over the processes as it would a router's connections."""
    import grpc

    from rlserve.api.rlserve.v1 import lifecycle_pb2, lifecycle_pb2_grpc

    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(args.num_requests)]
    control = grpc.aio.insecure_channel(f"127.0.0.1:{control_port}")

    async def all_joined() -> None:
        await common.grpc_serving(control)
        state = lifecycle_pb2_grpc.LifecycleStub(control)
        # No stream says when a frontend joined; bounded by until_ready's timeout.
        while len((await state.GetState(lifecycle_pb2.GetStateRequest())).frontends) < num_frontends:
            await asyncio.sleep(0.5)

    try:
        return await server_leg(cmd, log_path, all_joined(), grpc_workloads(*channels), args)
    finally:
        for channel in (*channels, control):
            await channel.close()


async def http_leg(cmd: list[str], port: int, model: str, args: argparse.Namespace, log_path: Path):
    import aiohttp

    base_url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)) as session:
        ready = common.http_healthy(session, base_url)
        workloads: Workloads = {"stream_text": http_request_fn(session, base_url, model)}
        return await server_leg(cmd, log_path, ready, workloads, args)


async def asyncllm_leg(args: argparse.Namespace, log_path: Path):
    """The reference runs in a child process so its CPU is not mixed with this process's."""
    result_path = log_path.with_suffix(".json")
    workload = ["--num-requests", str(args.num_requests), "--max-new-tokens", str(args.max_new_tokens)]
    cmd = [sys.executable, __file__, "--asyncllm-child", str(result_path), "--model", args.model, *workload]
    cmd += ["--repeats", str(args.repeats), "--workloads", ",".join(args.workloads)]
    async with common.server(cmd, log_path) as proc:
        if await proc.wait() != 0:
            raise RuntimeError(f"the AsyncLLM child failed; last log lines:\n{common.tail(log_path)}")
    result = json.loads(result_path.read_text())
    runs = {name: r if isinstance(r, str) else [Run(**run) for run in r] for name, r in result["runs"].items()}
    return runs, result["tree"]


async def asyncllm_child(args: argparse.Namespace) -> None:
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=args.model, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True)
    )
    counter = iter(range(1 << 62))

    def streaming(detokenize: bool) -> RequestFn:
        async def one(prompt: str, max_new_tokens: int) -> tuple[float, int, int]:
            params = SamplingParams(
                max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, detokenize=detokenize,
                output_kind=RequestOutputKind.DELTA,
            )  # fmt: skip
            start, num_tokens, num_messages = time.perf_counter(), 0, 0
            async for out in llm.generate(prompt, params, f"req-{next(counter)}"):
                num_tokens += len(out.outputs[0].token_ids)
                num_messages += 1
            return time.perf_counter() - start, num_tokens, num_messages

        return one

    async def unary_logprobs(prompt: str, max_new_tokens: int) -> tuple[float, int, int]:
        params = SamplingParams(
            max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip
        start = time.perf_counter()
        outs = [out async for out in llm.generate(prompt, params, f"req-{next(counter)}")]
        return time.perf_counter() - start, len(outs[-1].outputs[0].token_ids), len(outs)

    workloads: Workloads = {
        "stream_ids": streaming(False), "stream_text": streaming(True), "unary_logprobs": unary_logprobs,
    }  # fmt: skip

    try:
        me = psutil.Process()
        runs = await measure_workloads(workloads, args, me, client=None)
        encoded = {name: r if isinstance(r, str) else [asdict(run) for run in r] for name, r in runs.items()}
        result = {"runs": encoded, "tree": common.describe_tree(me)}
        Path(args.asyncllm_child).write_text(json.dumps(result))
    finally:
        llm.shutdown()


# --- driver --------------------------------------------------------------------------------


def floor_step_ms(args: argparse.Namespace, done: dict) -> float:
    """The engine's step time in the rlserve leg of this run (wall time of a stream_ids run over
    its tokens per request), so the floor streams at the same pace; else --floor-step-ms."""
    measured = done.get("rlserve", {}).get("workloads", {}).get("stream_ids", {}).get("tokens_per_s")
    if not measured:
        return args.floor_step_ms
    return 1000 * args.num_requests / measured


async def run_leg(name: str, args: argparse.Namespace, work_dir: Path, done: dict, pooled: dict) -> dict:
    """One leg once: its summary (what this round measured). Its runs also go to
    `pooled[name][workload]`, where the rounds add up."""
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
    elif name.startswith("rlserve_frontends_"):
        num = int(name.rsplit("_", 1)[1])
        port, control_port = common.free_port(), common.free_port()
        cmd = [sys.executable, "-m", "rlserve", "serve", "--model", args.model, "--port", str(port), *ENGINE_FLAGS]
        cmd += ["--frontends", str(num), "--control-address", f"127.0.0.1:{control_port}"]
        runs, tree = await frontends_leg(cmd, port, control_port, num, args, log_path)
        info["frontend"] = f"the {num} rlserve frontend processes together (one connection per request)"
    elif name == "vllm_http":
        port = common.free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--model", args.model, *ENGINE_FLAGS]
        runs, tree = await http_leg(cmd, port, args.model, args, log_path)
        info["frontend"] = "the api_server process (one API server)"
    elif name == "grpc_floor":
        port, step_ms = common.free_port(), floor_step_ms(args, done)
        cmd = [sys.executable, str(Path(__file__).with_name("grpc_floor.py")), "--port", str(port)]
        cmd += ["--step-ms", f"{step_ms:.3f}"]
        runs, tree = await grpc_leg(cmd, port, args, log_path)
        info["frontend"] = f"a grpc.aio server with no engine, one token per stream every {step_ms:.2f} ms"
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
    for workload, r in runs.items():
        pooled.setdefault(name, {}).setdefault(workload, []).append(r)
    workloads = {w: {"unavailable": r} if isinstance(r, str) else summarize(r) for w, r in runs.items()}
    return {**info, "workloads": workloads, "descendants": tree, "log": str(log_path)}


def pool(rounds: list[dict], runs: dict[str, list[list[Run] | str]]) -> dict:
    """A leg over every round: the first round's description, each round's start load and
    time, and per workload the summary of all its runs (unavailable if any round was)."""
    failed = next((r for r in rounds if "unavailable" in r), None)
    if failed is not None:
        return failed
    workloads = {}
    for workload, per_round in runs.items():
        why = next((r for r in per_round if isinstance(r, str)), None)
        workloads[workload] = {"unavailable": why} if why else summarize([run for r in per_round for run in r])
    first = rounds[0]
    return {
        **first,
        "loadavg_start": [r["loadavg_start"] for r in rounds] if len(rounds) > 1 else first["loadavg_start"],
        "elapsed_s": round(sum(r["elapsed_s"] for r in rounds), 1),
        "workloads": workloads,
    }


def ratios(legs: dict, workload: str) -> dict:
    def get(leg: str, key: str) -> float | None:
        return legs.get(leg, {}).get("workloads", {}).get(workload, {}).get(key)

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    tps, cpu, cap = "tokens_per_s", "frontend_cpu_ms_per_token", "frontend_capacity_tokens_per_s"
    return {
        "rlserve_over_vllm_rs_throughput": div(get("rlserve", tps), get("vllm_rs", tps)),
        "rlserve_over_asyncllm_throughput": div(get("rlserve", tps), get("asyncllm", tps)),
        "rlserve_over_http_throughput": div(get("rlserve", tps), get("vllm_http", tps)),
        "rlserve_over_vllm_rs_cpu_per_token": div(get("rlserve", cpu), get("vllm_rs", cpu)),
        "rlserve_over_asyncllm_cpu_per_token": div(get("rlserve", cpu), get("asyncllm", cpu)),
        "rlserve_stats_over_nostats_cpu_per_token": div(get("rlserve", cpu), get("rlserve_nostats", cpu)),
        "rlserve_over_grpc_floor_cpu_per_token": div(get("rlserve", cpu), get("grpc_floor", cpu)),
        "grpc_floor_over_vllm_rs_cpu_per_token": div(get("grpc_floor", cpu), get("vllm_rs", cpu)),
        # What a second frontend process buys, with the same client (a connection per request):
        # capacity (higher is better) and CPU per token in all (lower is better).
        "frontends_2_over_1_capacity": div(get("rlserve_frontends_2", cap), get("rlserve_frontends_1", cap)),
        "frontends_2_over_1_cpu_per_token": div(get("rlserve_frontends_2", cpu), get("rlserve_frontends_1", cpu)),
        "frontends_2_over_1_throughput": div(get("rlserve_frontends_2", tps), get("rlserve_frontends_1", tps)),
    }


async def main(args: argparse.Namespace) -> dict:
    work_dir = await common.prepare_run(args)
    rounds: list[dict] = []
    pooled: dict = {}
    for i in range(args.rounds):
        done: dict = {}
        kind = f"round {i + 1}/{args.rounds}, leg" if args.rounds > 1 else "leg"
        await common.run_each(
            kind, args.legs, functools.partial(run_leg, args=args, work_dir=work_dir, done=done, pooled=pooled), done
        )
        rounds.append(done)
    legs = {name: pool([r[name] for r in rounds], pooled.get(name, {})) for name in args.legs}
    return {
        "benchmark": "generate_throughput",
        "model": args.model,
        "num_requests": args.num_requests,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
        "legs": legs,
        "ratios": {workload: ratios(legs, workload) for workload in args.workloads},
        "targets": TARGETS,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF model dir (default: a ~16M random Llama in --work-dir)")
    # 4096 tokens a run: /proc's CPU counters tick every 10 ms, under 1 us per token over 3 runs.
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per workload in each round")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the legs in turn this many times (A B A B): drift hits every leg alike",
    )
    p.add_argument("--legs", default=",".join(LEGS), help=f"comma-separated subset of {','.join(LEGS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument(
        "--work-dir",
        default=str(Path(tempfile.gettempdir()) / "rlserve-bench"),
        help="models, logs, the vllm-rs binary and the vllm shim venv go here",
    )
    p.add_argument(
        "--floor-step-ms", type=float, default=10.0, help="grpc_floor's step time when no rlserve leg ran before it"
    )
    p.add_argument("--asyncllm-child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.legs = [leg.strip() for leg in args.legs.split(",") if leg.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for kind, names, known in (("legs", args.legs, LEGS), ("workloads", args.workloads, WORKLOADS)):
        if unknown := set(names) - set(known):
            p.error(f"unknown {kind} {sorted(unknown)}; choose from {known}")
    if min(args.num_requests, args.max_new_tokens, args.repeats, args.rounds) < 1:
        p.error("--num-requests, --max-new-tokens, --repeats and --rounds must be >= 1")
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
