"""vllm-router 0.1.17 (Rust; it renders chat templates itself and talks to `grpc://` workers
over vllm.Inference) in front of a real rlserve server: completions and chat, plain and
streaming, equal to calling rlserve directly, and a client that goes away stops the work in
rlserve (the router cancels the gRPC call; it never calls Abort). The router lives in a venv
of its own (`make install` builds `.venv-router`)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import pytest_asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import inference_pb2 as pb
from rlserve.config import ServeConfig
from rlserve.sdk.launch import free_port

from helpers import KEEP, ProcessLog, eventually, models_listed, pause, serving

ROUTER = Path(__file__).resolve().parent.parent / ".venv-router" / "bin" / "vllm-router"
START_S = 60.0
PROMPT_IDS = [1, 2, 3, 4, 5]
MESSAGES = [{"role": "user", "content": "Say something about reinforcement learning."}]


@pytest.fixture(autouse=True)
def router_installed() -> None:
    # A failure, not a skip: `make test` installs vllm-router, and CI must run these.
    assert ROUTER.exists(), "vllm-router is not installed: run `make install`"


def post(port: int, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        assert response.status == 200, data[:2000]
        return json.loads(data)
    finally:
        conn.close()


def post_stream(port: int, path: str, body: dict) -> list[dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()[:2000]
        events = []
        for line in response:
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                events.append(json.loads(line[5:]))
        return events
    finally:
        conn.close()


@pytest_asyncio.fixture(scope="module")
async def routed(engine, engine_config):
    async with serving(engine, ServeConfig(engine=engine_config)) as s:
        port = free_port()
        # vllm-router loads the tokenizer named by the request's model: ask by the directory.
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        log = ProcessLog("router")
        proc = subprocess.Popen(
            [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", f"grpc://{s.target}"]
            + ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log.file,
        )
        try:
            deadline = time.monotonic() + START_S
            while True:
                assert proc.poll() is None, log.tail()
                if await asyncio.to_thread(models_listed, port):  # the server shares this loop
                    break
                assert time.monotonic() < deadline, "vllm-router did not start"
                await asyncio.sleep(0.3)
            yield s, port, engine_config.model
        finally:
            proc.terminate()
            proc.wait(10)
            log.close()


async def direct(s, ids: list[int], max_tokens: int) -> str:
    request = pb.GenerateRequest(request_id=f"direct-{time.monotonic_ns()}", token_ids=pb.TokenIds(ids=ids))
    request.temperature = 0.0
    request.stopping.max_new_tokens = max_tokens
    return (await s.inference.Generate(request)).outputs.text


async def test_completions_plain_and_streaming_equal_rlserve_directly(routed):
    s, port, model = routed
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0}
    plain = await asyncio.to_thread(post, port, "/v1/completions", body)
    events = await asyncio.to_thread(post_stream, port, "/v1/completions", body)
    expected = await direct(s, PROMPT_IDS, 12)
    assert plain["choices"][0]["text"] == expected
    assert "".join(c["text"] for e in events for c in e["choices"]) == expected
    assert plain["usage"]["prompt_tokens"] == len(PROMPT_IDS)


async def test_chat_plain_and_streaming_equal_rlserve_directly(routed, engine):
    s, port, model = routed
    rendered = engine.llm.get_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)  # transformers 5: a BatchEncoding
    body = {"model": model, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    plain = await asyncio.to_thread(post, port, "/v1/chat/completions", body)
    events = await asyncio.to_thread(post_stream, port, "/v1/chat/completions", body)
    expected = await direct(s, list(ids), 10)
    assert plain["choices"][0]["message"]["content"] == expected
    assert plain["usage"]["prompt_tokens"] == len(ids), "the router rendered the same chat template"
    streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert streamed == expected


async def running(s) -> int:
    report = await s.lifecycle.GetLoad(lpb.GetLoadRequest())
    return sum(e.num_running_requests for e in report.engines)


async def none_running(s) -> bool:
    return await running(s) == 0


async def test_a_client_that_goes_away_stops_the_work_in_rlserve(routed):
    s, port, model = routed
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"model": model, "prompt": PROMPT_IDS, "max_tokens": 400, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    response = await asyncio.to_thread(conn.getresponse)
    assert response.status == 200 and (await asyncio.to_thread(response.readline)).startswith(b"data:")
    # Kept in the engine by a pause, the request would run as long as the pause lasts.
    await pause(s.control, KEEP)
    try:
        assert await running(s) == 1
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        # The request must not run on after its client went away.
        await eventually(lambda: none_running(s), timeout_s=10, interval_s=0.1)
    finally:
        await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
    await asyncio.sleep(0.3)
    assert await running(s) == 0
