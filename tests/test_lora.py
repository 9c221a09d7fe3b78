"""LoRA adapters from disk (upstream's LoadLora / UnloadLora / ListLoras) on a real vLLM CPU
engine started with LoRA, and random adapters for the tiny model: served outputs equal vLLM's
own with the same adapter, a name always means one set of weights, and an adapter in use is
not pulled from under its requests."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest_asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.sdk.client import generate_request

from helpers import PROMPT, expect, gloo_server, long_request
from tiny_model import make_tiny_lora

INVALID, ABORTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ABORTED
PRECONDITION, NOT_FOUND = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND
TOKENS = 16


@pytest_asyncio.fixture
async def s(lora_engine, engine_config):
    async with gloo_server(lora_engine, engine_config, transfer_timeout_s=20) as stubs:
        yield stubs


async def greedy(s, lora_name: str = "") -> list[int]:
    return (await greedy_with_version(s, lora_name))[0]


async def greedy_with_version(s, lora_name: str) -> tuple[list[int], str]:
    request = generate_request(PROMPT, max_new_tokens=TOKENS, ignore_eos=True)
    request.response.output_token_ids = True
    request.lora_name = lora_name
    out = (await s.inference.Generate(request)).outputs
    return list(out.token_ids), out.lora_version


async def vllm_greedy(engine, adapter_dir, lora_id: int) -> list[int]:
    """The same prompt through vLLM itself, loading the adapter from disk."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    ids = engine.llm.get_tokenizer().encode(PROMPT)
    sp = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    lora = LoRARequest(f"reference-{lora_id}", lora_id, str(adapter_dir))
    async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=ids), sp, f"ref-{lora_id}", lora_request=lora):
        last = out
    return list(last.outputs[0].token_ids)


async def load(s, name: str, path) -> cpb.LoraAdapter:
    return (await s.control.LoadLora(cpb.LoadLoraRequest(lora_name=name, source_path=str(path)))).adapter


async def test_an_adapter_loaded_from_disk_serves_what_vllm_serves(s, lora_engine, tmp_path):
    info = await s.control.GetServerInfo(cpb.GetServerInfoRequest())
    assert info.max_loras == 2 and (await s.control.GetModelInfo(cpb.GetModelInfoRequest())).supports_lora
    path = make_tiny_lora(tmp_path / "a", seed=1)
    adapter = await load(s, "a", path)
    assert adapter.lora_name == "a" and adapter.source_path == str(path) and adapter.lora_id > 0
    listed = (await s.control.ListLoras(cpb.ListLorasRequest())).adapters
    assert [(x.lora_name, x.lora_id) for x in listed] == [("a", adapter.lora_id)]
    base, with_a = await greedy(s), await greedy(s, "a")
    assert with_a != base and with_a == await greedy(s, "a")
    assert with_a == await vllm_greedy(lora_engine, path, 10_000)
    await s.control.UnloadLora(cpb.UnloadLoraRequest(lora_name="a"))


async def test_a_name_means_one_set_of_weights(s, tmp_path):
    first = make_tiny_lora(tmp_path / "first", seed=2)
    other = make_tiny_lora(tmp_path / "other", seed=3)
    adapter = await load(s, "policy", first)
    again = await load(s, "policy", first)  # the same files again: nothing changes
    assert again.lora_id == adapter.lora_id
    before = await greedy(s, "policy")
    details = await expect(ABORTED, s.control.LoadLora(cpb.LoadLoraRequest(lora_name="policy", source_path=str(other))))
    assert "other weights" in details
    make_tiny_lora(first, seed=4)  # new weights written over the same directory
    await expect(ABORTED, s.control.LoadLora(cpb.LoadLoraRequest(lora_name="policy", source_path=str(first))))
    assert await greedy(s, "policy") == before, "still the weights that were loaded under the name"
    # A new version goes under a new name, or after an unload.
    await s.control.UnloadLora(cpb.UnloadLoraRequest(lora_name="policy"))
    renewed = await load(s, "policy", first)
    assert renewed.lora_id != adapter.lora_id and await greedy(s, "policy") != before
    await s.control.UnloadLora(cpb.UnloadLoraRequest(lora_name="policy"))


async def test_an_adapter_in_use_stays_until_its_requests_end(s, tmp_path):
    await load(s, "busy", make_tiny_lora(tmp_path / "busy", seed=5))
    request = long_request("story", max_new_tokens=200)
    request.lora_name = "busy"
    stream = s.inference.GenerateStream(request)
    await stream.read()
    assert "in use" in await expect(PRECONDITION, s.control.UnloadLora(cpb.UnloadLoraRequest(lora_name="busy")))
    while await stream.read() != grpc.aio.EOF:
        pass
    await s.control.UnloadLora(cpb.UnloadLoraRequest(lora_name="busy"))
    assert not (await s.control.ListLoras(cpb.ListLorasRequest())).adapters
    assert "no adapter" in await expect(INVALID, s.inference.Generate(_with_lora("busy")))
    await expect(NOT_FOUND, s.control.UnloadLora(cpb.UnloadLoraRequest(lora_name="busy")))


async def test_no_more_adapters_than_the_engine_keeps(s, tmp_path):
    for i in range(2):
        await load(s, f"keep-{i}", make_tiny_lora(tmp_path / f"k{i}", seed=10 + i))
    details = await expect(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        s.control.LoadLora(
            cpb.LoadLoraRequest(lora_name="third", source_path=str(make_tiny_lora(tmp_path / "k2", 12)))
        ),
    )
    assert "unload one first" in details
    for i in range(2):
        await s.control.UnloadLora(cpb.UnloadLoraRequest(lora_name=f"keep-{i}"))


async def test_bad_adapters_are_refused_and_change_nothing(s, tmp_path):
    await expect(INVALID, s.control.LoadLora(cpb.LoadLoraRequest(lora_name="", source_path=str(tmp_path))))
    await expect(INVALID, s.control.LoadLora(cpb.LoadLoraRequest(lora_name="x", source_path=str(tmp_path))))
    too_big = make_tiny_lora(tmp_path / "rank64", seed=6, rank=64)  # the engine allows rank 8
    garbled = make_tiny_lora(tmp_path / "garbled", seed=7)
    (garbled / "adapter_config.json").write_text("{not json")
    no_weights = make_tiny_lora(tmp_path / "no-weights", seed=8)
    (no_weights / "adapter_model.safetensors").unlink()
    misshapen = make_tiny_lora(tmp_path / "misshapen", seed=9)
    _reshape_b(misshapen / "adapter_model.safetensors")
    reasons = {too_big: "rank 64", garbled: "vLLM cannot load", no_weights: "no readable", misshapen: "the layer needs"}
    for bad, reason in reasons.items():
        request = cpb.LoadLoraRequest(lora_name="x", source_path=str(bad))
        assert reason in await expect(INVALID, s.control.LoadLora(request)), bad.name
    assert not (await s.control.ListLoras(cpb.ListLorasRequest())).adapters
    assert len(await greedy(s)) == TOKENS, "the engine lives on"


async def test_a_server_without_lora_fails_closed(control, inference, tmp_path):
    path = make_tiny_lora(tmp_path / "a", seed=1)
    details = await expect(PRECONDITION, control.LoadLora(cpb.LoadLoraRequest(lora_name="a", source_path=str(path))))
    assert "--enable-lora" in details
    assert not (await control.ListLoras(cpb.ListLorasRequest())).adapters
    assert (await control.GetServerInfo(cpb.GetServerInfoRequest())).max_loras == 0
    await expect(INVALID, inference.Generate(_with_lora("a")))


def _reshape_b(weights_file) -> None:
    """Give every lora_B a wrong output size: vLLM must refuse it, not serve it."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights_file))
    save_file({k: (v[:-3] if "lora_B" in k else v).contiguous() for k, v in tensors.items()}, str(weights_file))


def _with_lora(name: str):
    request = generate_request("hi", max_new_tokens=2)
    request.lora_name = name
    return request


def adapter_in_memory(path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors")), json.loads((path / "adapter_config.json").read_text())


def push(target: str, tensors: dict, name: str, config: dict, version: str, new_version: bool = False):
    from rlserve.sdk.client import Client
    from rlserve.sdk.weight_sync import WeightSync

    with Client(target) as client:
        sync = WeightSync(client, timeout_s=20)
        try:
            return sync.sync_lora(tensors, name, config=config, version=version, new_version=new_version)
        finally:
            sync.close()


async def test_an_adapter_pushed_in_memory_serves_what_vllm_serves_from_disk(s, lora_engine, tmp_path):
    from rlserve.sdk.weight_sync import WeightSyncError

    first, second = make_tiny_lora(tmp_path / "first", seed=20), make_tiny_lora(tmp_path / "second", seed=21)
    tensors, config = adapter_in_memory(first)
    stats = await asyncio.to_thread(push, s.target, tensors, "policy", config, "step-1")
    assert stats.version == "step-1" and stats.num_tensors == len(tensors)
    tokens, version = await greedy_with_version(s, "policy")
    assert version == "step-1" and tokens == await vllm_greedy(lora_engine, first, 20_000)
    assert tokens != await greedy(s)
    # The same name with other weights, not asked as a new version: refused, v1 keeps serving.
    other, _ = adapter_in_memory(second)
    try:
        await asyncio.to_thread(push, s.target, other, "policy", config, "step-2")
        raise AssertionError("a name took other weights without new_version")
    except WeightSyncError as e:
        assert "a name means one set of weights" in str(e)
    assert await greedy_with_version(s, "policy") == (tokens, "step-1")
    # A request that started on v1 keeps it through the swap; new requests get v2.
    request = long_request("story", max_new_tokens=120)
    request.lora_name = "policy"
    running = s.inference.GenerateStream(request)
    await running.read()
    await asyncio.to_thread(push, s.target, other, "policy", config, "step-2", True)
    new_tokens, new_version = await greedy_with_version(s, "policy")
    assert new_version == "step-2" and new_tokens == await vllm_greedy(lora_engine, second, 20_001)
    last = None
    while (message := await running.read()) != grpc.aio.EOF:
        last = message
    assert last.outputs.lora_version == "step-1", "a running request keeps the version it started with"
    for _ in range(50):  # the old version leaves the engine after its last request
        if stats.lora_id not in await lora_engine.llm.list_loras():
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the replaced version is still loaded")
    listed = (await s.control.ListLoras(cpb.ListLorasRequest())).adapters
    assert [a.lora_name for a in listed] == ["policy"]
    registry = s.server.metrics.registry
    assert registry.get_sample_value("rlserve_weight_updates_total", {"outcome": "committed"}) == 2
    refused = {"operation": "start_lora_update", "reason": "NameTaken"}
    assert registry.get_sample_value("rlserve_weight_update_failures_total", refused) == 1
    await s.control.UnloadLora(cpb.UnloadLoraRequest(lora_name="policy"))


async def test_a_bad_push_is_refused_before_any_byte_moves(s, tmp_path):
    from rlserve.sdk.weight_sync import WeightSyncError

    path = make_tiny_lora(tmp_path / "bad", seed=22)
    tensors, config = adapter_in_memory(path)
    bad = {name: (t[:-3] if "lora_B" in name else t) for name, t in tensors.items()}
    try:
        await asyncio.to_thread(push, s.target, bad, "bad", config, "v1")
        raise AssertionError("a misshapen adapter was accepted")
    except WeightSyncError as e:
        assert "the layer needs" in str(e)
    assert not (await s.control.ListLoras(cpb.ListLorasRequest())).adapters
    state = await s.lifecycle.GetState(lpb.GetStateRequest())
    assert not state.HasField("update_session") and state.pause_phase == lpb.PAUSE_PHASE_RUNNING


async def test_a_lora_session_is_no_weight_session_and_an_empty_one_changes_nothing(s):
    from helpers import HandTrainer

    trainer = HandTrainer(s.target)
    await trainer.init()
    try:
        start = lpb.StartLoraUpdateRequest(lora_name="empty", version="v1", adapter_config_json=b'{"r": 8}')
        await s.lifecycle.StartLoraUpdate(start)
        state = await s.lifecycle.GetState(lpb.GetStateRequest())
        assert state.update_session.lora_name == "empty"
        finish = cpb.FinishWeightUpdateRequest(weight_version="x")
        assert "LoRA adapter" in await expect(PRECONDITION, s.control.FinishWeightUpdate(finish))
        assert "no LoRA weights" in await expect(INVALID, s.lifecycle.FinishLoraUpdate(lpb.FinishLoraUpdateRequest()))
        state = await s.lifecycle.GetState(lpb.GetStateRequest())
        assert not state.HasField("update_session") and state.weight_version != "x"
        assert not (await s.control.ListLoras(cpb.ListLorasRequest())).adapters
        await expect(PRECONDITION, s.lifecycle.FinishLoraUpdate(lpb.FinishLoraUpdateRequest()))
    finally:
        trainer.close()


async def test_hostile_pushes_are_refused_clearly_and_change_nothing(s, tmp_path):
    """A rank beyond the engine's, an absurd one, a config whose rank the tensors do not have,
    two pushes at once, a push while a base-weight update is open: each is a clear refusal
    (or, for the race, one push lands and the other is refused), and the engine serves on.
    (Tensors in another dtype are converted by the SDK; raw ones are refused, as for base
    weights in test_transfer_faults.)"""
    from rlserve.sdk.weight_sync import WeightSyncError

    from helpers import HandTrainer

    path = make_tiny_lora(tmp_path / "hostile", seed=23)
    tensors, config = adapter_in_memory(path)
    wide, wide_config = adapter_in_memory(make_tiny_lora(tmp_path / "wide", seed=24, rank=16))
    base = await greedy(s)
    refusals = {}
    for case, (t, c) in {
        "rank beyond --max-lora-rank": (wide, wide_config),
        "absurd rank": (tensors, {**config, "r": 10**9}),
        "a rank the tensors do not have": (tensors, {**config, "r": 4}),
    }.items():
        try:
            await asyncio.to_thread(push, s.target, t, "hostile", c, "v1")
            refusals[case] = "accepted"
        except WeightSyncError as e:
            refusals[case] = str(e)
    assert all(r != "accepted" for r in refusals.values()), refusals
    assert "max" in refusals["rank beyond --max-lora-rank"], refusals
    assert not (await s.control.ListLoras(cpb.ListLorasRequest())).adapters
    # Two pushes at once, under two names: the server holds one session at a time.
    outcomes = await asyncio.gather(
        asyncio.to_thread(push, s.target, tensors, "first", config, "v1"),
        asyncio.to_thread(push, s.target, tensors, "second", config, "v1"),
        return_exceptions=True,
    )
    landed = [o for o in outcomes if not isinstance(o, BaseException)]
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert landed and all(isinstance(e, WeightSyncError) for e in failed), outcomes
    listed = {a.lora_name for a in (await s.control.ListLoras(cpb.ListLorasRequest())).adapters}
    assert listed == {o.lora_name for o in landed}
    for name in listed:
        await s.control.UnloadLora(cpb.UnloadLoraRequest(lora_name=name))
    # No push can meet a base-weight update here: a server with --enable-lora refuses those
    # (vLLM wraps its layers for LoRA), clearly, and is left as it was.
    trainer = HandTrainer(s.target)
    await trainer.init()
    try:
        await s.control.PauseGeneration(cpb.PauseGenerationRequest(mode=cpb.PAUSE_MODE_KEEP))
        refused = await expect(PRECONDITION, s.control.StartWeightUpdate(cpb.StartWeightUpdateRequest()))
        assert "--enable-lora" in refused
        state = await s.lifecycle.GetState(lpb.GetStateRequest())
        assert not state.HasField("update_session") and state.weights_consistent
        await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
    finally:
        trainer.close()
    assert await greedy(s) == base
