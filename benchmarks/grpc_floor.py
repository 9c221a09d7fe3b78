"""The floor under any Python gRPC frontend: a grpc.aio server (uvloop, as `rlserve serve` runs)
with no engine behind it, serving `vllm.Inference` Generate and GenerateStream with messages
shaped like rlserve's. One clock stands in for the engine: every `--step-ms` each open stream
gets its next token (one message, as an engine step gives every running request one token);
a unary Generate answers once its tokens have been "generated", with a logprob per token.

`generate_throughput.py --legs ...,grpc_floor` runs it as a leg and drives it with the same
client and workload as rlserve; its frontend CPU per token is what grpc.aio itself costs, so
no Python frontend built on grpcio can go below it. Run alone:
    python benchmarks/grpc_floor.py --port 50999 --step-ms 6.5
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rlserve.api.vllm import inference_pb2, inference_pb2_grpc


class Clock:
    """Ticks every `step_s`; `await clock.step()` returns at the next tick."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._tick = asyncio.Event()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            tick, self._tick = self._tick, asyncio.Event()
            tick.set()

    async def step(self) -> None:
        await self._tick.wait()


class FloorInference(inference_pb2_grpc.InferenceServicer):
    def __init__(self, clock: Clock) -> None:
        self._clock = clock

    async def GenerateStream(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        text = not request.response.HasField("output_text") or request.response.output_text
        num_tokens = request.stopping.max_new_tokens
        for i in range(num_tokens):
            await self._clock.step()
            response = inference_pb2.GenerateResponse()
            if i == 0:
                response.prompt_info.num_prompt_tokens = 20
            out = response.outputs
            out.num_tokens = 1
            out.token_ids.append(1000 + i)
            if text:
                out.text = " word"
            if i == num_tokens - 1:
                out.finish_info.num_output_tokens = num_tokens
                out.finish_info.finish_reason = inference_pb2.FinishInfo.LENGTH
            yield response

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        num_tokens = request.stopping.max_new_tokens
        for _ in range(num_tokens):
            await self._clock.step()
        response = inference_pb2.GenerateResponse()
        response.prompt_info.num_prompt_tokens = 20
        out = response.outputs
        out.num_tokens = num_tokens
        out.token_ids.extend(range(1000, 1000 + num_tokens))
        if request.response.output_logprobs:
            out.logprobs.extend([-0.5] * num_tokens)
            out.ranks.extend([1] * num_tokens)
        out.finish_info.num_output_tokens = num_tokens
        out.finish_info.finish_reason = inference_pb2.FinishInfo.LENGTH
        return response


async def serve(port: int, step_s: float) -> None:
    clock = Clock(step_s)
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(FloorInference(clock), server)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ticking = asyncio.ensure_future(clock.run())
    try:
        await server.wait_for_termination()
    finally:
        ticking.cancel()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--step-ms", type=float, required=True, help="the stand-in engine's step time")
    args = p.parse_args()
    uvloop.run(serve(args.port, args.step_ms / 1000))
