"""The contract as upstream has it now, against the real server: both readings of
GenerateRequest field 16, the service aliases (one implementation, one rule per method),
the ServerInfo/ModelInfo fields routers read, Control/Shutdown, and the list form of
update_info."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import aliases_pb2_grpc, control_pb2_grpc
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import inference_pb2 as pb
from rlserve.config import SecurityConfig, ServeConfig
from rlserve.sdk.client import ChannelCredentials, generate_request, open_aio_channel
from rlserve.server.auth import canonical, rule_for

from helpers import KEEP, expect, gloo_server, pause, serving

INVALID = grpc.StatusCode.INVALID_ARGUMENT
ADMIN_TOKEN, READ_TOKEN = "admin-" + "a" * 24, "read-" + "r" * 24


def with_dynamo_field_16(request: pb.GenerateRequest, payload: bytes) -> pb.GenerateRequest:
    """The request as a client built on Dynamo's vendored proto encodes it: bytes at 16."""
    tag, length = bytes([0x82, 0x01]), _varint(len(payload))
    decoded = pb.GenerateRequest()
    decoded.ParseFromString(request.SerializeToString() + tag + length + payload)
    return decoded


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


async def test_field_16_as_dynamo_sends_it_is_the_native_json(inference):
    request = with_dynamo_field_16(generate_request("hi", max_new_tokens=16), json.dumps({"max_tokens": 3}).encode())
    assert not request.HasField("watermarking")
    out = await inference.Generate(request)
    assert out.outputs.finish_info.num_output_tokens == 3
    bad = with_dynamo_field_16(generate_request("hi"), b"{nope")
    assert "native_sampling_params_json" in await expect(INVALID, inference.Generate(bad))
    both = with_dynamo_field_16(generate_request("hi"), b"{}")
    both.native_sampling_params_json = b"{}"
    assert "both" in await expect(INVALID, inference.Generate(both))


async def test_field_16_as_upstream_sends_it_is_watermarking(inference):
    for value in (False, True):
        request = generate_request("hi", max_new_tokens=3)
        request.watermarking = value
        # No watermark is configured on this engine: the request runs as upstream runs it.
        assert (await inference.Generate(request)).outputs.finish_info.num_output_tokens == 3
    request = generate_request("hi", max_new_tokens=16)
    request.native_sampling_params_json = json.dumps({"max_tokens": 2}).encode()
    assert (await inference.Generate(request)).outputs.finish_info.num_output_tokens == 2


async def test_the_old_and_proposed_service_names_share_one_implementation(server, channel, control, lifecycle):
    generate, rl = aliases_pb2_grpc.GenerateStub(channel), aliases_pb2_grpc.RlControlStub(channel)
    assert (await generate.Generate(generate_request("hi", max_new_tokens=2))).outputs.num_tokens == 2
    chunks = [r async for r in generate.GenerateStream(generate_request("hi", max_new_tokens=3))]
    assert sum(c.outputs.num_tokens for c in chunks) == 3
    await rl.PauseGeneration(cpb.PauseGenerationRequest(mode=KEEP))
    assert (await control.IsPaused(cpb.IsPausedRequest())).paused  # the same state
    await rl.ResumeGeneration(cpb.ResumeGenerationRequest())
    assert not (await rl.IsPaused(cpb.IsPausedRequest())).paused
    before = (await rl.GetWeightVersion(cpb.GetWeightVersionRequest())).weight_version
    await rl.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version="via-alias"))
    assert (await lifecycle.GetState(lpb.GetStateRequest())).weight_version == "via-alias"
    await rl.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version=before))
    for alias, real in (
        ("/vllm.Generate/Generate", "/vllm.Inference/Generate"),
        ("/vllm.RlControl/UpdateWeights", "/vllm.Control/UpdateWeights"),
    ):
        assert canonical(alias) == real and rule_for(alias) == rule_for(real)


async def test_an_alias_needs_the_role_its_method_needs(engine, engine_config, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"admin {ADMIN_TOKEN} trainer\nread {READ_TOKEN} router\n")
    config = ServeConfig(engine=engine_config, security=SecurityConfig(auth_tokens_file=tokens))
    async with serving(engine, config) as s:
        async with open_aio_channel(s.target, ChannelCredentials(token=READ_TOKEN)) as ch:
            rl = aliases_pb2_grpc.RlControlStub(ch)
            assert not (await rl.IsPaused(cpb.IsPausedRequest())).paused
            await expect(grpc.StatusCode.PERMISSION_DENIED, rl.PauseGeneration(cpb.PauseGenerationRequest()))
            generate = aliases_pb2_grpc.GenerateStub(ch)
            assert (await generate.Generate(generate_request("hi", max_new_tokens=1))).outputs.num_tokens == 1
        async with open_aio_channel(s.target) as ch:
            await expect(
                grpc.StatusCode.UNAUTHENTICATED, aliases_pb2_grpc.GenerateStub(ch).Generate(generate_request("hi"))
            )


async def test_server_and_model_info_carry_what_routers_read(control):
    info = await control.GetServerInfo(cpb.GetServerInfoRequest())
    assert info.api_version == "vllm"
    assert info.HasField("effective_attention_block_size") and info.effective_attention_block_size == info.kv_block_size
    assert info.max_loras == 0
    assert not (await control.GetModelInfo(cpb.GetModelInfoRequest())).supports_lora


async def test_shutdown_is_an_admin_call_that_stops_the_server(engine, engine_config, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"admin {ADMIN_TOKEN} trainer\nread {READ_TOKEN} router\n")
    config = ServeConfig(engine=engine_config, security=SecurityConfig(auth_tokens_file=tokens))
    async with serving(engine, config) as s:
        async with open_aio_channel(s.target, ChannelCredentials(token=READ_TOKEN)) as ch:
            await expect(
                grpc.StatusCode.PERMISSION_DENIED, control_pb2_grpc.ControlStub(ch).Shutdown(cpb.ShutdownRequest())
            )
        assert not s.server.shutdown_requested.is_set()
        async with open_aio_channel(s.target, ChannelCredentials(token=ADMIN_TOKEN)) as ch:
            await control_pb2_grpc.ControlStub(ch).Shutdown(cpb.ShutdownRequest())
        await asyncio.wait_for(s.server.shutdown_requested.wait(), 5)


@pytest.mark.parametrize("shape", ["object", "list"])
async def test_update_info_in_the_object_and_the_list_form(wt_engine, engine_config, tiny_model_dir, shape):
    from helpers import HandTrainer, checkpoint, chunk_of

    async with gloo_server(wt_engine, engine_config, transfer_timeout_s=20) as s:
        trainer = HandTrainer(s.target)
        await trainer.init()
        try:
            name = "model.norm.weight"
            pairs = [(name, checkpoint(tiny_model_dir)[name])]
            info = chunk_of(pairs)
            await pause(s.control, KEEP)
            await s.control.StartWeightUpdate(cpb.StartWeightUpdateRequest())
            if shape == "list":
                uneven = [info, info]  # this server has one worker
                assert "one entry per worker" in await expect(INVALID, trainer.send(uneven, None))
                await s.control.StartWeightUpdate(cpb.StartWeightUpdateRequest())
            await trainer.send([info] if shape == "list" else info, [pairs[0][1]])
            await s.control.FinishWeightUpdate(cpb.FinishWeightUpdateRequest(weight_version=f"form-{shape}"))
            await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
            assert (await s.lifecycle.GetState(lpb.GetStateRequest())).weight_version == f"form-{shape}"
        finally:
            trainer.close()


async def test_bytes_that_are_no_valid_request_are_invalid_argument(channel, inference):
    """grpcio answers a request it cannot decode with UNKNOWN; rlserve says INVALID_ARGUMENT."""
    corrupt = bytes([0x82, 0x01, 0x7F, 0x01])  # field 16, a length past the end
    # A string field holding bad UTF-8: GenerateRequest.lora_name (15), LoadLoraRequest.lora_name (1).
    cases = {
        "/vllm.Inference/Generate": bytes([0x7A, 0x02, 0xFF, 0xFE]),
        "/vllm.Generate/Generate": bytes([0x7A, 0x02, 0xFF, 0xFE]),
        "/vllm.Control/LoadLora": bytes([0x0A, 0x02, 0xFF, 0xFE]),
    }
    for method, bad_utf8 in cases.items():
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        for raw in (bad_utf8, corrupt):
            assert "not a valid request" in await expect(INVALID, call(raw)), (method, raw)
    assert (await inference.Generate(generate_request("still fine", max_new_tokens=2))).outputs.num_tokens == 2
