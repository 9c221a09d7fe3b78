"""What a careless or hostile inference client sends, against a real engine: wrongly typed
native sampling params (which used to kill the engine's input thread), every size limit, a
huge prompt (which used to stall the event loop), and the held / draining requests of a pause
(aborting them, racing a pause, a cap by bytes, a client that never reads)."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
import pytest_asyncio

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.api.vllm import inference_pb2 as pb
from rlserve.api.vllm import inference_pb2_grpc
from rlserve.config import RequestLimits, ServeConfig
from rlserve.sdk.client import generate_request

from helpers import (
    ABORT,
    KEEP,
    WAIT,
    eventually,
    expect,
    full_collections,
    long_request,
    pause,
    read_rest,
    serving,
    wait_for_state,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
LIMITS = RequestLimits()


@pytest_asyncio.fixture(autouse=True)
async def running_afterwards(control, engine):
    yield
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    await eventually(lambda: engine.num_unfinished_requests() == 0)


async def still_serving(inference, control) -> None:
    """The engine takes work and the control plane answers: the bad request broke nothing."""
    r = await inference.Generate(generate_request("hi", max_new_tokens=4, ignore_eos=True), timeout=20)
    assert r.outputs.finish_info.num_output_tokens == 4
    await control.PauseGeneration(cpb.PauseGenerationRequest(mode=ABORT), timeout=10)
    await control.ResumeGeneration(cpb.ResumeGenerationRequest(), timeout=10)


NATIVE_TYPE_ERRORS = {
    "seed is a string": ({"seed": "x"}, "seed"),
    "ignore_eos is a string": ({"ignore_eos": "yes"}, "ignore_eos"),
    "max_tokens is a float": ({"max_tokens": 4.0}, "max_tokens"),
    "repetition_detection is a number": ({"repetition_detection": 5}, "repetition_detection"),
    "repetition_detection has a string size": ({"repetition_detection": {"max_pattern_size": "x"}}, "max_pattern_size"),
    "repetition_detection has an unknown field": ({"repetition_detection": {"bogus": 1}}, "bogus"),
    "repetition_detection is inconsistent": ({"repetition_detection": {"max_pattern_size": -3}}, "pattern_size"),
    "logit_bias key is not a token id": ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    "seed beyond 64 bits": ({"seed": 2**70}, "native_sampling_params_json"),
    "stop is a number": ({"stop": 5}, "stop"),
    "unknown key": ({"bogus": 1}, "bogus"),
    # vLLM's own bookkeeping (the first killed the engine's worker: found by the schema fuzzer).
    "private bad words ids": ({"_bad_words_token_ids": [[10**8]]}, "_bad_words_token_ids"),
    "private stop ids": ({"_all_stop_token_ids": [1]}, "_all_stop_token_ids"),
    "internal skip_clone": ({"skip_clone": True}, "skip_clone"),
    "n beyond the limit": ({"n": 10_000}, "max_num_sequences"),
    # vLLM's own request validation (SamplingParams.verify, the input processor) raises plain
    # ValueErrors as well as its VLLMValidationError: each names the parameter.
    "trace_decode_token_ids is empty": ({"trace_decode_token_ids": []}, "trace_decode_token_ids"),
    "trace_decode_token_ids is negative": ({"trace_decode_token_ids": [-1]}, "trace_decode_token_ids"),
    "trace replay is off": ({"trace_decode_token_ids": [1, 2]}, "trace_decode_token_ids"),
    "thinking_token_budget without a reasoning parser": ({"thinking_token_budget": 4}, "thinking_token_budget"),
    "more logprobs than allowed": ({"logprobs": 10**6}, "logprobs"),
    "allowed_token_ids outside the vocabulary": ({"allowed_token_ids": [10**8]}, "allowed_token_ids"),
    "stop_token_ids outside the vocabulary": ({"stop_token_ids": [10**8]}, "stop_token_ids"),
    "logit_bias outside the vocabulary": ({"logit_bias": {"100000000": 1.0}}, "logit_bias"),
}


@pytest.mark.parametrize("case", list(NATIVE_TYPE_ERRORS))
async def test_wrongly_typed_native_params_are_refused_and_the_engine_lives_on(case, inference, control):
    native, named = NATIVE_TYPE_ERRORS[case]
    request = generate_request("hi", max_new_tokens=4)
    request.native_sampling_params_json = json.dumps(native).encode()
    details = await expect(INVALID, inference.Generate(request, timeout=20))
    assert named in details
    await still_serving(inference, control)


async def seeded(inference, prompt: list[int], seed: int) -> list[int]:
    request = generate_request(prompt, max_new_tokens=8, temperature=1.0, sampling=pb.RandomSampling(seed=seed))
    return list((await inference.Generate(request, timeout=120)).outputs.token_ids)


async def test_seeded_requests_whose_prefill_is_split_keep_the_engine_alive(inference, control):
    """Concurrent seeded prompts overflow one step's token budget, so some prefills are split
    across steps. vLLM then rewinds the seeded generator of a request whose sampled token it
    throws away, and a CPU generator has no offset: upstream's rewind raised and killed the
    engine (found by `rlserve demo`). A seed still means the same tokens, split or not."""
    prompts = [[100 + (7 * i + j) % 4000 for j in range(450)] for i in range(12)]
    together = await asyncio.gather(*(seeded(inference, p, seed=i) for i, p in enumerate(prompts)))
    assert all(len(t) == 8 for t in together)
    alone = [await seeded(inference, p, seed=i) for i, p in enumerate(prompts[:3])]
    assert alone == together[:3]
    await still_serving(inference, control)


async def test_a_repetition_finish_is_a_stop(inference):
    """vLLM's repetition detection ends a request with its own finish reason; it is a
    legitimate stop, not an engine failure."""
    request = generate_request("hi", max_new_tokens=64, temperature=0.0)
    request.decoding.logit_bias[1234] = 100.0
    native = {"repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 1, "min_count": 4}}
    request.native_sampling_params_json = json.dumps(native).encode()
    out = (await inference.Generate(request, timeout=20)).outputs
    assert out.finish_info.finish_reason == pb.FinishInfo.STOP
    assert out.finish_info.num_output_tokens < 64
    assert not out.finish_info.HasField("eos_token_id")


def _over(field: str, value) -> pb.GenerateRequest:
    """A small valid request with `field` (a dotted path) set to `value`."""
    r = generate_request("hi", max_new_tokens=4)
    if field == "token_ids":
        r.token_ids.ids.extend(value)
        return r
    *path, name = field.split(".")
    msg = r
    for part in path:
        msg = getattr(msg, part)
    if isinstance(value, dict):
        getattr(msg, name).update(value)
    elif isinstance(value, list):
        getattr(msg, name).extend(value)
    else:
        setattr(msg, name, value)
    return r


OVER_LIMITS = {
    "max_id_bytes": ("request_id", "r" * (LIMITS.max_id_bytes + 1)),
    "max_prompt_text_bytes": ("text", "x" * (LIMITS.max_prompt_text_bytes + 1)),
    "max_prompt_token_ids": ("token_ids", [7] * (LIMITS.max_prompt_token_ids + 1)),
    "max_stop_strings": ("stopping.stop_strings", ["s"] * (LIMITS.max_stop_strings + 1)),
    "max_stop_string_bytes": ("stopping.stop_strings", ["s" * (LIMITS.max_stop_string_bytes + 1)]),
    "max_token_id_list": ("stopping.stop_token_ids", [1] * (LIMITS.max_token_id_list + 1)),
    "max_logit_bias_entries": ("decoding.logit_bias", {i: 1.0 for i in range(LIMITS.max_logit_bias_entries + 1)}),
    "max_choices": ("decoding.choice.choices", ["c"] * (LIMITS.max_choices + 1)),
    "max_structured_spec_bytes": ("decoding.regex", "a" * (LIMITS.max_structured_spec_bytes + 1)),
    "max_native_json_bytes": (
        "native_sampling_params_json",
        b'{"pad": "' + b"x" * LIMITS.max_native_json_bytes + b'"}',
    ),
    "max_num_sequences": ("sampling.num_sequences", LIMITS.max_num_sequences + 1),
}


@pytest.mark.parametrize("limit", list(OVER_LIMITS))
async def test_every_request_limit_is_refused_naming_it(limit, inference, control):
    field, value = OVER_LIMITS[limit]
    details = await expect(INVALID, inference.GenerateStream(_over(field, value)).read())
    assert limit in details
    await still_serving(inference, control)


async def test_a_huge_weight_version_label_is_refused_and_nothing_changes(control, lifecycle):
    before = (await lifecycle.GetState(lpb.GetStateRequest())).weight_version
    details = await expect(
        INVALID, control.UpdateWeightVersion(cpb.UpdateWeightVersionRequest(weight_version="v" * 257))
    )
    assert "max_weight_version_bytes" in details
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert state.weight_version == before
    assert all(len(a.detail) < 1024 for a in state.recent_mutations), "the audit ring keeps no huge labels"


async def test_abort_ids_are_bounded(control):
    details = await expect(INVALID, control.Abort(cpb.AbortRequest(request_ids=["x"] * (LIMITS.max_abort_ids + 1))))
    assert "max_abort_ids" in details


async def test_is_paused_stays_fast_while_huge_prompts_are_tokenized(inference, control):
    """Three near-limit text prompts (about 0.4 s of tokenizing each) while IsPaused is asked
    300 times: tokenizing happens off the event loop, so no answer waits for it."""
    text = "hello world, this is a fairly long prompt with words. " * (LIMITS.max_prompt_text_bytes // 56)
    huge = [asyncio.ensure_future(inference.Generate(generate_request(text, max_new_tokens=2))) for _ in range(3)]
    latencies = []
    with full_collections() as collections:
        while not all(h.done() for h in huge):  # only while they are being processed
            t0 = time.perf_counter()
            await control.IsPaused(cpb.IsPausedRequest())
            latencies.append(time.perf_counter() - t0)
    assert len(latencies) >= 20
    for h in huge:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await h
        assert e.value.code() == INVALID and "prompt" in e.value.details(), "longer than the 512-token context"
    latencies.sort()
    assert latencies[int(len(latencies) * 0.99)] < 0.1, f"slowest {latencies[-5:]}, full collections {collections}"


# Held and draining requests --------------------------------------------------------------


async def test_abort_ends_held_requests_at_once_and_they_never_run(control, inference, lifecycle, engine):
    await pause(control, ABORT)
    calls = {
        i: asyncio.ensure_future(inference.Generate(long_request(max_new_tokens=8, request_id=f"held-{i}")))
        for i in range(3)
    }
    await wait_for_state(lifecycle, lambda s: s.num_held_requests == 3)
    await control.Abort(cpb.AbortRequest(request_ids=["held-0", "held-1"]))
    for i in (0, 1):
        out = (await asyncio.wait_for(calls[i], 10)).outputs
        assert out.finish_info.finish_reason == pb.FinishInfo.ABORTED and out.finish_info.num_output_tokens == 0
    assert not calls[2].done() and engine.num_unfinished_requests() == 0, "the engine never saw them"
    assert (await lifecycle.GetState(lpb.GetStateRequest())).num_held_requests == 1
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    assert (await calls[2]).outputs.finish_info.num_output_tokens == 8


async def test_no_request_slips_into_a_paused_engine(control, inference, lifecycle):
    """Requests arriving while an ABORT pause starts either run and end ABORTED, or are held;
    none sits in the paused engine, neither aborted nor held. All end after resume."""
    n = 48
    calls = [inference.GenerateStream(long_request(f"race {i}", max_new_tokens=64)) for i in range(n)]
    readers = [asyncio.ensure_future(_read_all(c)) for c in calls]
    await asyncio.sleep(0)  # let some of them reach the server before the pause does
    await pause(control, ABORT)
    # Every request is settled once it has either ended or is counted as held.
    await eventually(lambda: _settled(readers, lifecycle), timeout_s=20)
    await control.ResumeGeneration(cpb.ResumeGenerationRequest())
    finals = await asyncio.wait_for(asyncio.gather(*readers), 60)
    reasons = [f.finish_info.finish_reason for f in finals]
    assert len(finals) == n and all(r in (pb.FinishInfo.ABORTED, pb.FinishInfo.LENGTH) for r in reasons)


async def _settled(readers, lifecycle) -> bool:
    held = (await lifecycle.GetState(lpb.GetStateRequest())).num_held_requests
    return sum(not r.done() for r in readers) == held


async def _read_all(call) -> pb.SequenceOutput:
    last = None
    async for r in call:
        last = r
    return last.outputs


async def test_held_requests_are_capped_by_bytes(engine, engine_config, tiny_model_dir):
    prompt = [100 + i for i in range(500)]  # about 20 kB held each
    async with serving(engine, ServeConfig(engine=engine_config, max_held_bytes=50_000)) as s:
        await pause(s.control, ABORT)
        held = [
            asyncio.ensure_future(s.inference.Generate(generate_request(prompt, max_new_tokens=2))) for _ in range(2)
        ]
        await wait_for_state(s.lifecycle, lambda st: st.num_held_requests == 2)
        details = await expect(
            grpc.StatusCode.RESOURCE_EXHAUSTED, s.inference.Generate(generate_request(prompt, max_new_tokens=2))
        )
        assert "max_held_bytes" in details
        await s.control.ResumeGeneration(cpb.ResumeGenerationRequest())
        assert all(r.outputs.finish_info.num_output_tokens == 2 for r in await asyncio.gather(*held))


async def test_a_client_that_never_reads_does_not_block_a_wait_pause(server, control):
    """The drain waits for the engine to finish the request, not for its client to read the
    responses (20 candidates per token), which back up in a flow-control window held small."""
    options = [("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options) as ch:
        request = long_request("never read", max_new_tokens=480)
        request.response.output_candidates.top_n = 20
        call = inference_pb2_grpc.InferenceStub(ch).GenerateStream(request)
        await call.initial_metadata()
        await asyncio.wait_for(pause(control, WAIT), 60)
        await control.ResumeGeneration(cpb.ResumeGenerationRequest())
        messages = await read_rest(call)
    assert messages[-1].outputs.finish_info.num_output_tokens == 480
    assert sum(m.outputs.num_tokens for m in messages) == 480


async def test_keep_then_wait_lets_the_kept_requests_finish(control, inference, lifecycle):
    calls = [inference.GenerateStream(long_request(f"kept {i}", max_new_tokens=60)) for i in range(3)]
    firsts = await asyncio.gather(*(c.read() for c in calls))
    await pause(control, KEEP)
    await asyncio.wait_for(pause(control, WAIT), 60)
    state = await lifecycle.GetState(lpb.GetStateRequest())
    assert state.pause_phase == lpb.PAUSE_PHASE_PAUSED and state.pause_mode == WAIT
    for call, first in zip(calls, firsts):
        rest = await asyncio.wait_for(read_rest(call), 10)  # finished before the pause returned
        assert [first, *rest][-1].outputs.finish_info.num_output_tokens == 60
