"""Control-plane latency on an idle engine (or, for rlserve with --load-streams, under a
generation load): rlserve against vLLM's own frontends.

For each system in turn (one engine at a time: start, measure, stop), one client in this process
makes sequential calls, warms up, then times each call:
  rlserve    `rlserve serve`: vllm.Control/IsPaused, a PauseGeneration(ABORT) + ResumeGeneration
             pair, and grpc.health.v1.Health/Check on the same channel (the floor: an empty
             unary call that touches neither the controller nor the engine)
  vllm_rs    vLLM's Rust frontend (`vllm-rs serve --grpc-port`): the same calls, the same stubs
  vllm_http  vLLM's OpenAI server with VLLM_SERVER_DEV_MODE=1: GET /is_paused and a
             POST /pause?mode=abort + POST /resume pair, over one keep-alive aiohttp session
  engine_client  no server: vLLM's Python engine client (the one rlserve drives) in a child
             process, calling the engine core directly: pause_scheduler(abort, clear_cache)
             + resume_scheduler, and is_scheduler_paused. What the engine round trips cost
             before any frontend adds to them.
The last stdout line is one JSON object: p50/p99 in ms per system and call, and `ratios` of
rlserve's p50 to the floor and to the other systems (lower is better); `targets` states the goals.
`foreign_cpu_s`/`steal_cpu_s`: CPU used by anything else on the machine, or taken by the
hypervisor, while a system was measured; if large, that system's figures are noise.
A system that could not run holds `unavailable` with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

SYSTEMS = ("rlserve", "vllm_rs", "vllm_http", "engine_client")
ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "512", "--enforce-eager")
TARGETS = {
    "rlserve_is_paused_over_floor_p50": "<= 1.3",
    "rlserve_over_vllm_rs_pause_resume_p50": "< 1",
}

Call = Callable[[], Awaitable[None]]


async def timed(call: Call, num_warmup: int, num_samples: int, interval_s: float = 0.0) -> dict:
    """Sequential calls: `num_warmup` untimed, then `num_samples` timed one by one, each
    `interval_s` after the last one ended."""
    for _ in range(num_warmup):
        await call()
    samples_s = []
    for _ in range(num_samples):
        await asyncio.sleep(interval_s)
        start = time.perf_counter()
        await call()
        samples_s.append(time.perf_counter() - start)
    return {
        "p50_ms": round(common.percentile(samples_s, 50) * 1000, 3),
        "p99_ms": round(common.percentile(samples_s, 99) * 1000, 3),
    }


async def check_pause_cycle(is_paused: Callable[[], Awaitable[bool]], pause: Call, resume: Call) -> None:
    """The pair must really pause and resume, or the benchmark would time no-ops."""
    states = [await is_paused()]
    await pause()
    states.append(await is_paused())
    await resume()
    states.append(await is_paused())
    if states != [False, True, False]:
        raise RuntimeError(f"expected is_paused False, True, False around pause/resume; got {states}")


async def measure(
    is_paused: Callable[[], Awaitable[bool]], pause: Call, resume: Call, floor: Call | None, args: argparse.Namespace
) -> dict:
    await check_pause_cycle(is_paused, pause, resume)

    async def pause_resume() -> None:
        await pause()
        await resume()

    async def is_paused_call() -> None:
        await is_paused()

    out = {}
    if floor is not None:
        out["health_check"] = await timed(floor, args.num_warmup, args.num_samples)
    out["is_paused"] = await timed(is_paused_call, args.num_warmup, args.num_samples)
    # Under a load, each pause comes once the held requests are generating again (as a
    # trainer's pauses, seconds apart), not while the engine is still idle from the last one.
    interval_s = args.pair_interval_ms / 1000 if args.load_streams else 0.0
    out["pause_resume"] = await timed(pause_resume, args.num_warmup, args.num_pairs, interval_s)
    return out


async def with_foreign_cpu(pid: int, measuring: Awaitable[dict], load_pid: int | None = None) -> dict:
    """Adds the CPU that anything but the server tree, this client and its load child used
    meanwhile, and the hypervisor's steal: with sub-millisecond calls on 2 cores, either one
    skews the figures."""
    frontend = psutil.Process(pid)
    clients = [psutil.Process(), *([psutil.Process(load_pid)] if load_pid else [])]
    before, clients_before, (busy_before, steal_before) = (
        common.cpu_snapshot(frontend),
        sum(common.cpu_s(c) for c in clients),
        common.machine_cpu_s(),
    )
    result = await measuring
    cpu = common.cpu_snapshot(frontend).minus(before)
    ours = cpu.frontend_s + cpu.engine_s + cpu.helper_s + sum(common.cpu_s(c) for c in clients) - clients_before
    busy, steal = common.machine_cpu_s()
    return {
        **result,
        "foreign_cpu_s": round(busy - busy_before - ours, 3),
        "steal_cpu_s": round(steal - steal_before, 3),
    }


# --- systems -------------------------------------------------------------------------------


async def grpc_system(cmd: list[str], port: int, log_path: Path, args: argparse.Namespace) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rlserve.api.vllm import control_pb2 as pb
    from rlserve.api.vllm import control_pb2_grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    async with channel, common.server(cmd, log_path) as proc:
        await common.until_ready(common.grpc_serving(channel), proc, log_path)
        control = control_pb2_grpc.ControlStub(channel)
        health = health_pb2_grpc.HealthStub(channel)

        async def is_paused() -> bool:
            return (await control.IsPaused(pb.IsPausedRequest())).paused

        async def pause() -> None:
            await control.PauseGeneration(pb.PauseGenerationRequest(mode=pb.PAUSE_MODE_ABORT))

        async def resume() -> None:
            await control.ResumeGeneration(pb.ResumeGenerationRequest())

        async def floor() -> None:
            await health.Check(health_pb2.HealthCheckRequest(service=""))

        async with generation_load(port, args.load_streams, log_path.with_suffix(".load.log")) as load_pid:
            return await with_foreign_cpu(proc.pid, measure(is_paused, pause, resume, floor, args), load_pid)


@contextlib.asynccontextmanager
async def generation_load(port: int, streams: int, log_path: Path) -> AsyncIterator[int | None]:
    """`streams` clients generating all along, in a process of their own: in the measuring
    client's event loop their messages would queue ahead of the timed replies (that was the
    pause's 270 ms p99 tail here, not the server). Nothing when `streams` is 0."""
    if not streams:
        yield None
        return
    cmd = [sys.executable, __file__, "--load-child", str(port), "--load-streams", str(streams)]
    async with common.server(cmd, log_path) as proc:
        await asyncio.sleep(1.0)
        if proc.returncode is not None:
            raise RuntimeError(f"the load child exited with {proc.returncode}:\n{common.tail(log_path)}")
        yield proc.pid


async def load_child(port: int, streams: int) -> None:
    """Generates on `streams` streams until killed; a request the pause aborts is followed by
    the next one."""
    import grpc

    from rlserve.api.vllm import inference_pb2_grpc
    from rlserve.sdk.client import generate_request

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)

        async def stream(i: int) -> None:
            n = 0
            while True:
                request = generate_request(f"Story {i}-{n}:", max_new_tokens=64, temperature=0.0, ignore_eos=True)
                with contextlib.suppress(grpc.RpcError):
                    async for _ in inference.GenerateStream(request):
                        pass
                n += 1

        await asyncio.gather(*(stream(i) for i in range(streams)))


async def http_system(cmd: list[str], port: int, log_path: Path, args: argparse.Namespace) -> dict:
    import aiohttp

    base_url = f"http://127.0.0.1:{port}"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    # One connection, kept alive, so no call pays for a TCP handshake.
    connector = aiohttp.TCPConnector(limit=1)
    session = aiohttp.ClientSession(timeout=timeout, connector=connector)
    async with session, common.server(cmd, log_path) as proc:
        await common.until_ready(common.http_healthy(session, base_url), proc, log_path)

        async def call(method: str, path: str) -> dict:
            async with session.request(method, f"{base_url}{path}") as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"{method} {path}: HTTP {resp.status} {body}")
                return body

        async def is_paused() -> bool:
            return (await call("GET", "/is_paused"))["is_paused"]

        async def pause() -> None:
            await call("POST", "/pause?mode=abort")

        async def resume() -> None:
            await call("POST", "/resume")

        return await with_foreign_cpu(proc.pid, measure(is_paused, pause, resume, None, args))


async def engine_client_system(args: argparse.Namespace, log_path: Path) -> dict:
    """The engine client runs in a child process, so its CPU is not this process's."""
    result_path = log_path.with_suffix(".json")
    cmd = [sys.executable, __file__, "--engine-client-child", str(result_path), "--model", args.model]
    cmd += ["--num-warmup", str(args.num_warmup), "--num-samples", str(args.num_samples)]
    cmd += ["--num-pairs", str(args.num_pairs)]
    async with common.server(cmd, log_path) as proc:
        if await proc.wait() != 0:
            raise RuntimeError(f"the engine client child failed; last log lines:\n{common.tail(log_path)}")
    return json.loads(result_path.read_text())


async def engine_client_child(args: argparse.Namespace) -> None:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=args.model, dtype="float32", max_model_len=512, enforce_eager=True)
    )
    core = llm.engine_core
    try:

        async def pause() -> None:
            await core.pause_scheduler_async(mode="abort", clear_cache=True)

        measuring = measure(core.is_scheduler_paused_async, pause, core.resume_scheduler_async, None, args)
        result = await with_foreign_cpu(os.getpid(), measuring)
        Path(args.engine_client_child).write_text(json.dumps(result))
    finally:
        llm.shutdown()


async def run_system(name: str, args: argparse.Namespace, work_dir: Path) -> dict:
    log_path = work_dir / f"control_{name}.log"
    info = {"loadavg_start": [round(x, 2) for x in os.getloadavg()], "log": str(log_path)}
    started = time.perf_counter()
    if name == "engine_client":
        result = await engine_client_system(args, log_path)
    elif name == "rlserve":
        port = common.free_port()
        cmd = [sys.executable, "-m", "rlserve", "serve", "--model", args.model, "--port", str(port), *ENGINE_FLAGS]
        result = await grpc_system(cmd, port, log_path, args)
    elif name == "vllm_rs":
        binary = common.vllm_rs_binary(work_dir)
        if isinstance(binary, str):
            return {**info, "unavailable": binary}
        python = common.python_with_vllm_dist(work_dir)
        grpc_port, http_port = common.free_port(), common.free_port()
        cmd = [
            str(binary),
            "serve",
            args.model,
            "--port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
            "--python",
            str(python),
            *ENGINE_FLAGS,
        ]
        result = await grpc_system(cmd, grpc_port, log_path, args)
    else:
        port = common.free_port()
        # The dev routes (/pause, /resume, /is_paused) exist only with VLLM_SERVER_DEV_MODE=1.
        cmd = [
            "env",
            "VLLM_SERVER_DEV_MODE=1",
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            args.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *ENGINE_FLAGS,
        ]
        result = await http_system(cmd, port, log_path, args)
    info["elapsed_s"] = round(time.perf_counter() - started, 1)
    return {**result, **info}


# --- driver --------------------------------------------------------------------------------


def ratios(systems: dict) -> dict:
    def p50(system: str, call: str) -> float | None:
        return systems.get(system, {}).get(call, {}).get("p50_ms")

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {
        "rlserve_is_paused_over_floor_p50": div(p50("rlserve", "is_paused"), p50("rlserve", "health_check")),
        "rlserve_over_vllm_rs_pause_resume_p50": div(p50("rlserve", "pause_resume"), p50("vllm_rs", "pause_resume")),
        "rlserve_over_vllm_rs_is_paused_p50": div(p50("rlserve", "is_paused"), p50("vllm_rs", "is_paused")),
        "rlserve_over_http_pause_resume_p50": div(p50("rlserve", "pause_resume"), p50("vllm_http", "pause_resume")),
        "rlserve_over_http_is_paused_p50": div(p50("rlserve", "is_paused"), p50("vllm_http", "is_paused")),
        # What the engine round trips alone take, against each frontend's whole pair.
        "engine_client_over_rlserve_pause_resume_p50": div(
            p50("engine_client", "pause_resume"), p50("rlserve", "pause_resume")
        ),
        "engine_client_over_vllm_rs_pause_resume_p50": div(
            p50("engine_client", "pause_resume"), p50("vllm_rs", "pause_resume")
        ),
    }


async def main(args: argparse.Namespace) -> dict:
    work_dir = await common.prepare_run(args)
    systems = await common.run_each("system", args.systems, lambda name: run_system(name, args, work_dir))
    return {
        "benchmark": "control_latency",
        "model": args.model,
        "num_warmup": args.num_warmup,
        "num_samples": args.num_samples,
        "num_pairs": args.num_pairs,
        "cpu_count": os.cpu_count(),
        "systems": systems,
        "ratios": ratios(systems),
        "targets": TARGETS,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF model dir (default: a ~16M random Llama in --work-dir)")
    p.add_argument("--num-warmup", type=int, default=50, help="untimed calls before each measured call kind")
    p.add_argument("--num-samples", type=int, default=300, help="timed IsPaused and health calls")
    p.add_argument("--num-pairs", type=int, default=100, help="timed pause+resume pairs")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument(
        "--work-dir",
        default=str(Path(tempfile.gettempdir()) / "rlserve-bench"),
        help="models, logs, the vllm-rs binary and the vllm shim venv go here",
    )
    p.add_argument(
        "--load-streams",
        type=int,
        default=0,
        help="rlserve only: this many streams generate throughout the measurement (the pause aborts them)",
    )
    p.add_argument(
        "--pair-interval-ms",
        type=float,
        default=200.0,
        help="with --load-streams: the time between one pause+resume pair and the next (the load generates)",
    )
    p.add_argument("--engine-client-child", default="", help=argparse.SUPPRESS)
    p.add_argument("--load-child", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if args.num_warmup < 0 or args.num_samples < 1 or args.num_pairs < 1:
        p.error("--num-samples and --num-pairs must be >= 1, --num-warmup >= 0")
    return args


if __name__ == "__main__":
    cli_args = parse_args()
    if cli_args.load_child:
        asyncio.run(load_child(cli_args.load_child, cli_args.load_streams))
        sys.exit()
    if cli_args.engine_client_child:
        import uvloop  # as `rlserve serve` runs its loop

        uvloop.run(engine_client_child(cli_args))
        sys.exit()
    try:
        result = asyncio.run(main(cli_args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        sys.exit("[bench] interrupted; the servers it started were stopped")
    print(json.dumps(result))
