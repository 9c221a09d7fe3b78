"""NVIDIA Dynamo 1.6.1 drives rlserve unchanged: its native vLLM sidecar
(`python -m dynamo.vllm.sidecar`) in front of a real rlserve server with rlserve_gloo, and its
frontend (`python -m dynamo.frontend`), with file-based discovery (no etcd, no NATS), checked
the way a Dynamo user would: discovery, completions and chat, the RL routes (pause in every
mode with a request in flight, versions, sleep failing closed on CPU), and a whole weight
update whose control calls all go through Dynamo while the trainer sends the tensors with
rlserve's SDK. Dynamo lives in a venv of its own (`make install` builds `.venv-dynamo`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.config import ServeConfig
from rlserve.sdk.client import generate_request
from rlserve.sdk.launch import free_port
from rlserve.sdk.plan import plan_sync
from rlserve.sdk.senders import TensorSender

from helpers import PROMPT, gloo_server, greedy, perturbed, serving, sync_checkpoint
from tiny_model import make_tiny_lora

DYNAMO_PYTHON = Path(__file__).resolve().parent.parent / ".venv-dynamo" / "bin" / "python"
START_S = 120.0
# How long a completion waits for Dynamo's frontend to route to a worker that was paused.
ROUTED_AGAIN_S = 10.0


@pytest.fixture(autouse=True)
def dynamo_installed() -> None:
    # A failure, not a skip: `make test` installs Dynamo, and CI must run these.
    assert DYNAMO_PYTHON.exists(), "Dynamo is not installed: run `make install`"


def low_free_port() -> int:
    """Dynamo's system port must lie below 32768."""
    while True:
        port = random.randint(20000, 32000)
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("0.0.0.0", port))
            return port


def call(url: str, body: dict | None = None, timeout_s: float = 60.0, method: str | None = None) -> dict:
    """One HTTP JSON call (POST with a body, GET without, or `method`); Dynamo's errors come
    back as JSON too."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        return {"http_status": e.code, **json.loads(e.read() or b"{}")}


@dataclass
class Dynamo:
    frontend: str  # http://127.0.0.1:PORT, OpenAI-style
    rl_discovery: str  # http://127.0.0.1:PORT/v1/rl/workers
    system: str  # the sidecar's http://127.0.0.1:PORT, where /engine/<route> lives
    model: str

    async def route(self, route: str, body: dict | None = None) -> dict:
        return await asyncio.to_thread(call, f"{self.system}/engine/{route}", body or {})

    async def openai(self, path: str, body: dict) -> dict:
        return await asyncio.to_thread(call, f"{self.frontend}{path}", body)


@contextlib.asynccontextmanager
async def dynamo(grpc_target: str, model: str, tmp: Path, **extra_env: str) -> AsyncIterator[Dynamo]:
    system_port, http_port, rl_port = low_free_port(), free_port(), free_port()
    env = {**os.environ, "DYN_FILE_KV": str(tmp / "discovery"), "HF_HUB_OFFLINE": "1", **extra_env}
    # Dynamo writes a logging config per process into the temp dir and never removes it (ten
    # files a run): the test's own directory, not /tmp.
    env["TMPDIR"] = str(tmp)
    # No grace before the drain at SIGTERM (Dynamo's default, 5 s, is for a load balancer to
    # see the worker withdrawn; here nothing routes to it by then): each stop took 5.1 s.
    sidecar_env = {**env, "DYN_SYSTEM_PORT": str(system_port), "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0"}
    frontend_env = {**env, "DYN_ENABLE_RL": "true", "DYN_RL_PORT": str(rl_port)}
    logs = tmp / "sidecar.log", tmp / "frontend.log"
    with logs[0].open("wb") as sidecar_log, logs[1].open("wb") as frontend_log:
        sidecar = subprocess.Popen(
            [str(DYNAMO_PYTHON), "-m", "dynamo.vllm.sidecar", "--discovery-backend", "file", "--enable-rl"]
            + ["--grpc-endpoint", grpc_target],
            env=sidecar_env,
            stdout=sidecar_log,
            stderr=subprocess.STDOUT,
        )
        frontend = subprocess.Popen(
            [str(DYNAMO_PYTHON), "-m", "dynamo.frontend", "--discovery-backend", "file"]
            + ["--http-port", str(http_port)],
            env=frontend_env,
            stdout=frontend_log,
            stderr=subprocess.STDOUT,
        )
        d = Dynamo(
            f"http://127.0.0.1:{http_port}",
            f"http://127.0.0.1:{rl_port}/v1/rl/workers",
            f"http://127.0.0.1:{system_port}",
            model,
        )
        try:
            deadline = time.monotonic() + START_S
            while True:
                for proc, log in zip((sidecar, frontend), logs):
                    assert proc.poll() is None, log.read_text()[-4000:]
                with contextlib.suppress(OSError, ValueError):
                    models = await asyncio.to_thread(call, f"{d.frontend}/v1/models", None, 2)
                    workers = await asyncio.to_thread(call, d.rl_discovery, None, 2)
                    if models.get("data") and workers.get("workers"):
                        break
                assert time.monotonic() < deadline, logs[0].read_text()[-4000:]
                await asyncio.sleep(0.5)
            yield d
        finally:
            for proc in (frontend, sidecar):
                proc.terminate()
            for proc in (frontend, sidecar):
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
async def stack(wt_engine, engine_config, tmp_path, tiny_model_dir):
    async with gloo_server(wt_engine, engine_config, transfer_timeout_s=20) as s:
        # The shared engine may serve what an earlier module synced (the weights this module
        # syncs among them: test_fleet's): the checkpoint first, before Dynamo watches the
        # server (the sync's pause takes it out of Dynamo's routing pool for a while).
        await sync_checkpoint(s.target, tiny_model_dir)
        async with dynamo(s.target, engine_config.served_names[0], tmp_path) as d:
            yield s, d


async def test_dynamo_discovers_rlserve_and_serves_completions_and_chat(stack):
    s, d = stack
    workers = (await asyncio.to_thread(call, d.rl_discovery)).get("workers")
    assert len(workers) == 1 and workers[0]["model"] == d.model and workers[0]["world_size"] == 1
    routes = set(workers[0]["routes"])
    assert {"control/pause_generation", "control/resume_generation", "control/is_paused"} <= routes
    assert {"update/init_weight_transfer_engine", "update/update_weights", "update/finish_weight_update"} <= routes
    out = await d.openai("/v1/completions", {"model": d.model, "prompt": "Hello there", "max_tokens": 5})
    assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length", out
    chat = {"model": d.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out = await d.openai("/v1/chat/completions", chat)
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["message"]["role"] == "assistant", out


def stream_completion(url: str, body: dict, events: list[dict], started: threading.Event) -> None:
    """A streaming completion through Dynamo's frontend: every SSE event into `events`.

    Dynamo's sidecar takes a paused worker out of its routing pool and puts it back when it
    resumes; its frontend sees it back a few milliseconds later and answers 503 meanwhile
    (seen under load: a request 3 ms after the worker was back). Such a 503, before anything
    streamed, is asked again for up to ROUTED_AGAIN_S."""
    request = urllib.request.Request(
        url, data=json.dumps({**body, "stream": True}).encode(), headers={"content-type": "application/json"}
    )
    deadline = time.monotonic() + ROUTED_AGAIN_S
    while True:
        try:
            response = urllib.request.urlopen(request, timeout=120)
            break
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with response:
        for line in response:
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                events.append(json.loads(line[5:]))
                started.set()
    started.set()


async def test_dynamo_pauses_in_every_mode_with_a_request_in_flight(stack):
    s, d = stack
    for mode in ("abort", "wait", "keep"):
        events: list[dict] = []
        started = threading.Event()
        body = {"model": d.model, "prompt": f"in flight {mode}", "max_tokens": 120, "ignore_eos": True}
        body["stream_options"] = {"include_usage": True}
        client = asyncio.ensure_future(
            asyncio.to_thread(stream_completion, f"{d.frontend}/v1/completions", body, events, started)
        )
        await asyncio.to_thread(started.wait, 30)
        assert (await d.route("control/pause_generation", {"mode": mode})) == {"status": "paused"}
        assert (await d.route("control/is_paused"))["is_paused"] is True
        state = await s.lifecycle.GetState(lpb.GetStateRequest())
        assert cpb.PauseMode.Name(state.pause_mode) == f"PAUSE_MODE_{mode.upper()}", state
        assert state.pause_phase == lpb.PAUSE_PHASE_PAUSED
        assert (await d.route("control/resume_generation")) == {"status": "resumed"}
        assert (await d.route("control/is_paused"))["is_paused"] is False
        await asyncio.wait_for(client, 60)
        reasons = [c["finish_reason"] for e in events for c in e.get("choices", ()) if c.get("finish_reason")]
        tokens = [e["usage"]["completion_tokens"] for e in events if e.get("usage")]
        if mode == "abort":
            # rlserve ends it with FinishInfo.ABORTED, as upstream does; Dynamo 1.6.1 renders
            # that as "stop" (docs/compatibility.md): cut short is what tells it apart.
            assert reasons == ["stop"] and tokens[-1] < 120, (reasons, tokens)
        else:
            assert reasons == ["length"] and tokens[-1] == 120, (mode, reasons, tokens)
    refused = await d.route("control/pause_generation", {"mode": "later"})
    assert refused["status"] == "error" and not (await d.route("control/is_paused"))["is_paused"]


async def test_dynamo_versions_and_sleep_failing_closed(stack):
    s, d = stack
    before = (await d.route("control/get_weight_version"))["weight_version"]
    await d.route("update/update_weight_version", {"new_version": "dyn-label"})
    assert (await d.route("control/get_weight_version"))["weight_version"] == "dyn-label"
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert state.weight_version == "dyn-label" and before != "dyn-label"
    # No sleep mode on CPU: rlserve says so in its capabilities, and Dynamo offers no route.
    assert (await d.route("control/is_sleeping"))["is_sleeping"] is False
    for route in ("control/sleep", "control/wake_up"):
        assert "not found" in (await d.route(route, {"level": 1})).get("message", ""), route


async def test_a_weight_update_driven_through_dynamos_routes(stack, tiny_model_dir):
    s, d = stack
    workers = (await asyncio.to_thread(call, d.rl_discovery))["workers"]
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    before = await greedy(s.inference)
    weights = perturbed(tiny_model_dir, seed=21)
    tensors, chunks = plan_sync(weights, getattr(torch, state.weight_dtype), chunk_bytes=2**20, bucket_bytes=2**18)
    assert len(chunks) > 1
    sender = TensorSender(workers[0]["world_size"], timeout_s=20)
    init = asyncio.ensure_future(d.route("update/init_weight_transfer_engine", {"init_info": sender.init_info()}))
    await asyncio.to_thread(sender.join)
    assert "error" not in await init
    assert (await d.route("control/pause_generation", {"mode": "keep"}))["status"] == "paused"
    assert "error" not in await d.route("update/start_weight_update")
    for chunk in chunks:
        update = asyncio.ensure_future(d.route("update/update_weights", {"update_info": chunk.to_json()}))
        assert await asyncio.to_thread(sender.send, chunk, tensors)
        assert "error" not in await update
    assert "error" not in await d.route("update/finish_weight_update", {"weight_version": "dyn-1"})
    assert (await d.route("control/resume_generation"))["status"] == "resumed"
    assert (await d.route("control/get_weight_version"))["weight_version"] == "dyn-1"
    served = await s.lifecycle.GetWeightChecksum(lpb.GetWeightChecksumRequest())
    mine = {t.name: t.checksum for c in chunks for t in c.tensors}
    assert {n: served.per_tensor[n] for n in mine} == mine
    assert await greedy(s.inference) != before
    final = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert final.weights_consistent and final.pause_phase == lpb.PAUSE_PHASE_RUNNING


async def test_dynamos_lora_routes_load_serve_and_unload_adapters(lora_engine, engine_config, tmp_path):
    """With DYN_LORA_ENABLED Dynamo drives Control/LoadLora and UnloadLora, and its frontend
    serves the adapter as a model of its own, with rlserve's outputs for that adapter."""
    adapter_dir = make_tiny_lora(tmp_path / "adapter", seed=31)
    name = engine_config.served_names[0]
    async with (
        serving(lora_engine, ServeConfig(engine=replace(engine_config, enable_lora=True))) as s,
        dynamo(s.target, name, tmp_path, DYN_LORA_ENABLED="true") as d,
    ):
        loaded = await asyncio.to_thread(
            call, f"{d.system}/v1/loras", {"lora_name": "dyn-a", "source": {"uri": f"file://{adapter_dir}"}}
        )
        assert loaded.get("status") == "success", loaded
        listed = (await s.control.ListLoras(cpb.ListLorasRequest())).adapters
        assert [(a.lora_name, a.lora_id) for a in listed] == [("dyn-a", loaded["lora_id"])]
        deadline = time.monotonic() + 30
        while "dyn-a" not in {
            m["id"] for m in (await asyncio.to_thread(call, f"{d.frontend}/v1/models")).get("data", [])
        }:
            assert time.monotonic() < deadline, "the adapter never appeared as a model"
            await asyncio.sleep(0.3)
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        via_dynamo = await d.openai("/v1/completions", {**body, "model": "dyn-a"})
        request = generate_request(PROMPT, max_new_tokens=8)
        request.lora_name = "dyn-a"
        direct = (await s.inference.Generate(request)).outputs.text
        base = await d.openai("/v1/completions", {**body, "model": name})
        assert via_dynamo["choices"][0]["text"] == direct != base["choices"][0]["text"]
        unloaded = await asyncio.to_thread(call, f"{d.system}/v1/loras/dyn-a", None, 60.0, "DELETE")
        assert unloaded.get("status") == "success", unloaded
        assert not (await s.control.ListLoras(cpb.ListLorasRequest())).adapters
