"""Helpers the test modules share: request builders, stream readers, weight files, a trainer
in another process, the reference engine, bounded waits, killing a server's process tree, and
bringing up a server over a shared engine."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http.client
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import cloudpickle
import grpc
import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.rlserve.v1 import lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import control_pb2_grpc, inference_pb2_grpc
from rlserve.api.vllm import inference_pb2 as pb
from rlserve.config import ServeConfig
from rlserve.sdk.client import Client, generate_request
from rlserve.wire.gloo_group import GlooGroup
from rlserve.wire.protocol import ChunkInfo, TensorMeta, tensor_checksum

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
TRAINER = Path(__file__).with_name("trainer_process.py")
ABORT, WAIT, KEEP = cpb.PAUSE_MODE_ABORT, cpb.PAUSE_MODE_WAIT, cpb.PAUSE_MODE_KEEP


@contextlib.contextmanager
def full_collections() -> Iterator[list[float]]:
    """The seconds each full garbage collection of this process took inside the block: a
    latency test's failure says whether one stopped the event loop it measures."""
    took: list[float] = []
    started: list[float] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                took.append(time.perf_counter() - started.pop())

    gc.callbacks.append(note)
    try:
        yield took
    finally:
        gc.callbacks.remove(note)


@contextlib.contextmanager
def short_temp_dir(prefix: str) -> Iterator[Path]:
    """A temp dir at a short path, removed afterwards: a Unix socket's path holds at most 107
    bytes, and one in a directory of pytest's (longer still under pytest-xdist) does not fit,
    so the engine's sockets would go to vLLM's default place instead."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def long_request(prompt: str = "Tell me a long story", max_new_tokens: int = 200, **kw) -> pb.GenerateRequest:
    return generate_request(prompt, max_new_tokens=max_new_tokens, ignore_eos=True, temperature=0.0, **kw)


async def read_rest(call) -> list[pb.GenerateResponse]:
    """The remaining messages of a stream already read with read() (the two styles can't mix)."""
    out = []
    while (r := await call.read()) != grpc.aio.EOF:
        out.append(r)
    return out


async def started_streams(inference, n: int, max_new_tokens: int = 200, prefix: str = "Story number"):
    """n streams, each of which has produced at least one token."""
    calls = [inference.GenerateStream(long_request(f"{prefix} {i}:", max_new_tokens)) for i in range(n)]
    firsts = await asyncio.gather(*(c.read() for c in calls))
    return calls, firsts


async def finish(call, first) -> tuple[list[int], pb.SequenceOutput]:
    """All token ids of a stream whose first message was read, and its final output."""
    out = [first, *await read_rest(call)]
    return [t for r in out for t in r.outputs.token_ids], out[-1].outputs


async def pause(control, mode, clear_cache: bool | None = None) -> None:
    req = cpb.PauseGenerationRequest(mode=mode)
    if clear_cache is not None:
        req.clear_cache = clear_cache
    await control.PauseGeneration(req)


async def begin_update(stubs, trainer) -> None:
    """A hand trainer's rendezvous, then the server paused (KEEP) with an update session open."""
    await trainer.init()
    await pause(stubs.control, cpb.PAUSE_MODE_KEEP)
    await stubs.control.StartWeightUpdate(cpb.StartWeightUpdateRequest())


async def wait_for_state(lifecycle, check, timeout_s: float = 30.0) -> lpb.LifecycleState:
    """The first streamed state for which `check(state)` holds."""
    watch = lifecycle.WatchState(lpb.WatchStateRequest())
    try:
        async with asyncio.timeout(timeout_s):
            while not check(state := await watch.read()):
                pass
        return state
    finally:
        watch.cancel()


@contextlib.asynccontextmanager
async def watched(lifecycle) -> AsyncIterator[list[lpb.LifecycleState]]:
    """Every state the server streams while the block runs (a slow reader may miss some:
    enough for an invariant that must hold in each one seen)."""
    seen: list[lpb.LifecycleState] = []
    call = lifecycle.WatchState(lpb.WatchStateRequest())

    async def read() -> None:
        async for state in call:
            seen.append(state)

    task = asyncio.ensure_future(read())
    await eventually(lambda: bool(seen))
    try:
        yield seen
    finally:
        await asyncio.sleep(0.2)  # the last change reaches the stream
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
            await task


def never_paused(states: list[lpb.LifecycleState]) -> None:
    assert states and all(st.pause_phase == lpb.PAUSE_PHASE_RUNNING for st in states), [st.pause_phase for st in states]


async def expect(code, awaitable) -> str:
    with pytest.raises(grpc.RpcError) as e:  # aio, or a blocking client's future
        await awaitable
    assert e.value.code() == code, e.value.details()
    return e.value.details()


async def greedy(inference, prompt: str = PROMPT, n: int = 24) -> list[int]:
    r = generate_request(prompt, max_new_tokens=n, ignore_eos=True, temperature=0.0)
    return list((await inference.Generate(r)).outputs.token_ids)


async def checksum(lifecycle) -> str:
    return (await lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())).overall


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


async def sync_checkpoint(target: str, model_dir: Path, timeout_s: float = 20.0) -> None:
    """Serve the checkpoint's weights: a module on a shared engine starts from them (an earlier
    module may have left its own weights served)."""
    from rlserve.sdk.weight_sync import WeightSync

    def sync() -> None:
        with Client(target) as client:
            ws = WeightSync(client, timeout_s=timeout_s)
            try:
                ws.sync(checkpoint(model_dir), "checkpoint")
            finally:
                ws.close()

    await asyncio.to_thread(sync)


def perturbed(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in checkpoint(model_dir).items()}


def changed_a_little(weights: dict, fraction: float, seed: int) -> dict:
    """`weights` with `fraction` of every tensor's elements moved (at least one each)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        flat = t.clone().view(-1)
        k = max(1, int(flat.numel() * fraction))
        at = torch.randperm(flat.numel(), generator=g)[:k]
        flat[at] += 0.5
        out[name] = flat.view(t.shape)
    return out


def save_weights(weights: dict[str, torch.Tensor], path: Path) -> Path:
    save_file({n: t.contiguous() for n, t in weights.items()}, str(path))
    return path


async def run_trainer(target: str, weights: Path, version: str, *extra: str) -> tuple[int, dict | None, str]:
    """tests/trainer_process.py: the SDK in its own process. Returns (exit code, stats, stderr)."""
    rc, stats, err = await run_trainer_syncs(target, weights, version, *extra)
    return rc, (stats[-1] if stats else None), err


async def run_trainer_syncs(
    target: str, weights: Path, version: str, *extra: str, timeout_s: float = 120
) -> tuple[int, list[dict], str]:
    """The same, with the stats of every sync it made (--repeat)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(TRAINER),
        "--target",
        target,
        "--weights",
        str(weights),
        "--version",
        version,
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
    lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return proc.returncode, lines, err.decode()[-2000:]


class Reference:
    """vLLM's own answer for a checkpoint: greedy tokens of an engine rlserve never updates
    (the session's plain engine), its weights reloaded from a checkpoint on disk by vLLM's
    loader (`reload_weights`, the loader that builds a fresh engine's model) before each
    comparison and its prefix cache emptied, so nothing of the last checkpoint's KV serves
    the next; the model's own checkpoint is reloaded after it, so that the engine serves that
    for everyone else. One engine for every comparison of the session, in place of a fresh
    engine per comparison; checked against a fresh engine once (test_weight_transfer).

    vLLM 0.32's reload leaves a tied lm_head computing with the old embedding on CPU: its
    loader never sees a tensor of its own, so vLLM never processes it again and its packed
    kernel keeps the weights it was first built from. The reference runs vLLM's own post-load
    step for that layer (`_reprocess_tied_head`)."""

    def __init__(self, engine: Any, model_dir: Path) -> None:
        self._llm = engine.llm
        self._model_dir = model_dir
        self._lock = asyncio.Lock()

    async def outputs(
        self, weights: dict[str, torch.Tensor], tmp: Path, prompt: str = PROMPT, n: int = 24
    ) -> list[int]:
        """Greedy tokens of the model loaded from a checkpoint of `weights`."""
        ckpt = tmp / "reference-checkpoint"
        shutil.copytree(self._model_dir, ckpt, dirs_exist_ok=True)
        save_weights(weights, ckpt / "model.safetensors")
        async with self._lock:
            await self._load(ckpt)
            try:
                return await engine_greedy(self._llm, prompt, n)
            finally:
                await self._load(self._model_dir)

    async def _load(self, checkpoint: Path) -> None:
        await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(checkpoint)})
        await self._llm.collective_rpc(_reprocess_tied_head)
        await self._llm.reset_prefix_cache()


def _reprocess_tied_head(worker: Any) -> None:
    """In a worker: vLLM's post-load processing of a tied lm_head, from the embedding weight
    it shares (see `Reference`)."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(model.config, "tie_word_embeddings", False):
        head.quant_method.process_weights_after_loading(head)


async def engine_greedy(llm: Any, prompt: str = PROMPT, n: int = 24) -> list[int]:
    """Greedy tokens straight from a vLLM AsyncLLM, past any rlserve server."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    async for out in llm.generate(prompt, sp, f"greedy-{time.monotonic_ns()}"):
        last = out
    return list(last.outputs[0].token_ids)


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0, interval_s: float = 0.05
) -> None:
    """Wait (bounded) for state another process or task changes asynchronously, e.g. an abort
    that reaches the engine core after the client's cancel returned."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a server started as a process group leader and every process under it (vLLM's
    engine core runs in a process group of its own and outlives a killed server), then reap it."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class Stubs:
    target: str
    control: control_pb2_grpc.ControlStub
    inference: inference_pb2_grpc.InferenceStub
    lifecycle: lifecycle_pb2_grpc.LifecycleStub
    server: Any = None  # the RlserveServer


@contextlib.asynccontextmanager
async def serving(engine, config: ServeConfig) -> AsyncIterator[Stubs]:
    """A real server on 127.0.0.1:0 over an engine started elsewhere, and stubs for it. The
    engine outlives it: leave generation running and no update open."""
    from rlserve.server.app import RlserveServer

    srv = RlserveServer(replace(config, port=0))
    await srv.start()
    await srv.attach_engine(engine)
    target = f"127.0.0.1:{srv.port}"
    try:
        async with grpc.aio.insecure_channel(target) as ch:
            yield Stubs(
                target,
                control_pb2_grpc.ControlStub(ch),
                inference_pb2_grpc.InferenceStub(ch),
                lifecycle_pb2_grpc.LifecycleStub(ch),
                srv,
            )
    finally:
        await srv.stop(0)


def gloo_config(engine_config, **serve: Any) -> ServeConfig:
    """A server's config with the rlserve_gloo weight-transfer backend (the session's gloo
    engine, `wt_engine`, has it); `serve`: ServeConfig's other fields."""
    return ServeConfig(engine=replace(engine_config, weight_transfer_backend="rlserve_gloo"), **serve)


def gloo_server(engine, engine_config, **serve: Any) -> contextlib.AbstractAsyncContextManager[Stubs]:
    """`serving` over a gloo engine, configured by `gloo_config`."""
    return serving(engine, gloo_config(engine_config, **serve))


class HandTrainer:
    """A trainer that speaks the rlserve_gloo protocol by hand (to misbehave on purpose): its
    own store and gloo group, and blocking calls in threads so the test's event loop keeps
    serving."""

    def __init__(self, target: str, timeout_s: float = 5.0) -> None:
        self.client = Client(target)
        self.timeout_s = timeout_s
        self.group: GlooGroup | None = None
        self.pool = ThreadPoolExecutor(4)

    def init_info(self, port: int, world_size: int = 2) -> dict:
        return {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": world_size,
            "timeout_s": self.timeout_s,
        }

    async def init(self, world_size: int = 2) -> None:
        store = GlooGroup.host_store("127.0.0.1", 0, world_size, self.timeout_s)
        request = cpb.InitWeightTransferEngineRequest(
            init_info_json=json.dumps(self.init_info(store.port, world_size)).encode()
        )
        loop = asyncio.get_running_loop()
        rpc = loop.run_in_executor(self.pool, self.client.control.InitWeightTransferEngine, request)
        self.group = await loop.run_in_executor(self.pool, GlooGroup, store, 0, world_size, self.timeout_s)
        await rpc

    async def send(
        self,
        chunk: dict,
        tensors: list[torch.Tensor] | None,
        vote: bool = True,
        broadcast: bool = True,
        raw_vote: torch.Tensor | None = None,
        delay_s: float = 0.0,
    ):
        """UpdateWeights with `chunk`, voting and sending `tensors` (one bucket) alongside;
        `broadcast=False` votes yes and then sends nothing, as a trainer that hangs;
        `raw_vote` is all-reduced in place of a well-formed vote; `delay_s` between the vote
        and the bytes, as a slow trainer on a slow link."""
        loop = asyncio.get_running_loop()
        request = cpb.UpdateWeightsRequest(update_info_json=json.dumps(chunk).encode())
        rpc = loop.run_in_executor(self.pool, self.client.control.UpdateWeights, request)
        if raw_vote is not None:
            group = self.group
            assert group is not None
            with contextlib.suppress(RuntimeError):  # the server's side of the group is gone
                await loop.run_in_executor(self.pool, group.allreduce_min, raw_vote)
        elif tensors is not None:
            group = self.group
            assert group is not None
            go = await loop.run_in_executor(self.pool, group.vote, vote)
            await asyncio.sleep(delay_s)
            if go and broadcast:
                flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
                with contextlib.suppress(RuntimeError):  # a server that dropped a malformed send
                    await loop.run_in_executor(self.pool, lambda: group.broadcast_async(flat).wait())
        return await rpc

    def close(self) -> None:
        self.client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def chunk_of(pairs: list[tuple[str, torch.Tensor]], **override) -> dict:
    """The update_info of one chunk carrying `pairs`, with fields overridden."""
    info = ChunkInfo(
        tuple(TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), tensor_checksum(t)) for n, t in pairs)
    )
    return {**info.to_json(), **override}


class ProcessLog:
    """Where a test's subprocess writes its stderr: a file, never a pipe left unread while it
    runs (a pipe fills at 64 KiB and blocks the process at its next write: a hang that looks
    like the process's own). Appended to by the process, read by path."""

    def __init__(self, name: str) -> None:
        fd, path = tempfile.mkstemp(prefix=f"rlserve-test-{name}-", suffix=".log")
        os.close(fd)
        self.path = Path(path)
        self.file = self.path.open("ab")

    def text(self) -> str:
        return self.path.read_text(errors="replace")

    def tail(self, num_chars: int = 3000) -> str:
        return self.text()[-num_chars:]

    def close(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


def models_listed(port: int) -> bool:
    with contextlib.suppress(OSError, http.client.HTTPException):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/v1/models")
        return conn.getresponse().status == 200
    return False


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# `_reprocess_tied_head` runs in the engine's workers, which cannot import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
