"""Generation through a real gRPC server and a real vLLM CPU engine: equivalence with AsyncLLM,
streaming framing, every request option, and the refusals."""

from __future__ import annotations

import json
import re

import grpc
import pytest
from vllm import SamplingParams

from rlserve.api.vllm import inference_pb2 as pb
from rlserve.sdk.client import generate_request

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def req(prompt=PROMPT, *, max_new_tokens: int = 16, **kw) -> pb.GenerateRequest:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return generate_request(prompt, max_new_tokens=max_new_tokens, **kw)


async def gen(inference, request: pb.GenerateRequest) -> pb.SequenceOutput:
    return (await inference.Generate(request)).outputs


async def stream(inference, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return [r async for r in inference.GenerateStream(request)]


async def expect_invalid(inference, request: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await inference.Generate(request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details()


async def test_greedy_matches_asyncllm_in_process(engine, inference):
    out = await gen(inference, req(max_new_tokens=24))
    direct = None
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    async for o in engine.llm.generate(PROMPT, sp, "direct-reference"):
        direct = o
    assert list(out.token_ids) == list(direct.outputs[0].token_ids)
    assert out.text == direct.outputs[0].text
    assert len(set(out.token_ids)) > 1, "the tiny model should not collapse to one token"
    assert out.finish_info.finish_reason == pb.FinishInfo.LENGTH
    assert out.finish_info.num_output_tokens == 24


async def test_token_id_prompt_equals_text_prompt(engine, inference):
    ids = engine.llm.get_tokenizer().encode(PROMPT)
    assert list((await gen(inference, req(ids))).token_ids) == list((await gen(inference, req())).token_ids)


async def test_stream_sends_increments_that_add_up_to_the_unary_output(inference):
    whole = await gen(inference, req(max_new_tokens=20))
    chunks = await stream(inference, req(max_new_tokens=20))
    assert chunks[0].HasField("prompt_info") and not any(c.HasField("prompt_info") for c in chunks[1:])
    ids = [t for c in chunks for t in c.outputs.token_ids]
    assert ids == list(whole.token_ids)
    assert sum(c.outputs.num_tokens for c in chunks) == 20
    assert "".join(c.outputs.text for c in chunks) == whole.text
    finals = [c for c in chunks if c.outputs.HasField("finish_info")]
    assert finals == [chunks[-1]]
    assert finals[0].outputs.finish_info.num_output_tokens == 20


async def test_seeded_sampling_is_reproducible_and_seed_matters(inference):
    def seeded(seed):
        r = req(temperature=1.0, max_new_tokens=24)
        r.sampling.seed = seed
        return r

    a, b, c = [list((await gen(inference, seeded(s))).token_ids) for s in (1, 1, 2)]
    greedy = list((await gen(inference, req(max_new_tokens=24))).token_ids)
    assert a == b
    assert a != c
    assert a != greedy, "temperature 1.0 must not be greedy"


@pytest.mark.parametrize(
    "field,value", [("top_k", 1), ("top_p", 1e-6), ("min_p", 1.0)], ids=["top_k", "top_p", "min_p"]
)
async def test_truncation_samplers_reduce_to_greedy(inference, field, value):
    r = req(temperature=1.0, max_new_tokens=24)
    r.sampling.seed = 7
    unrestricted = list((await gen(inference, r)).token_ids)
    setattr(r.sampling, field, value)
    restricted = list((await gen(inference, r)).token_ids)
    greedy = list((await gen(inference, req(max_new_tokens=24))).token_ids)
    assert restricted == greedy
    assert unrestricted != greedy


async def test_num_sequences_streams_every_sequence_to_its_end(inference):
    r = req(temperature=1.0, max_new_tokens=8)
    r.sampling.num_sequences = 3
    r.sampling.seed = 3
    chunks = await stream(inference, r)
    finished = {
        c.outputs.index: c.outputs.finish_info.num_output_tokens for c in chunks if c.outputs.HasField("finish_info")
    }
    assert finished == {0: 8, 1: 8, 2: 8}
    per_seq = {i: [t for c in chunks if c.outputs.index == i for t in c.outputs.token_ids] for i in range(3)}
    assert len({tuple(v) for v in per_seq.values()}) > 1


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty", "repetition_penalty"])
async def test_penalties_change_greedy_output(inference, field):
    base = list((await gen(inference, req(max_new_tokens=48))).token_ids)
    r = req(max_new_tokens=48)
    setattr(r.decoding, field, 2.0 if field != "repetition_penalty" else 5.0)
    penalized = list((await gen(inference, r)).token_ids)
    assert penalized != base
    assert len(set(penalized)) >= len(set(base))


async def test_logit_bias_forces_a_token(inference):
    r = req(max_new_tokens=6)
    r.decoding.logit_bias[1234] = 100.0
    assert list((await gen(inference, r)).token_ids) == [1234] * 6


async def test_allowed_token_ids_restrict_the_vocabulary(inference):
    r = req(temperature=1.0, max_new_tokens=12)
    r.decoding.allowed_token_ids.extend([100, 200, 300])
    assert set((await gen(inference, r)).token_ids) <= {100, 200, 300}


async def test_structured_choice(inference):
    r = req(max_new_tokens=16, ignore_eos=False)
    r.decoding.choice.choices.extend(["yes", "no"])
    assert (await gen(inference, r)).text in ("yes", "no")


async def test_structured_regex(inference):
    r = req(max_new_tokens=16, ignore_eos=False)
    r.decoding.regex = "[0-9]{3}"
    assert re.fullmatch("[0-9]{3}", (await gen(inference, r)).text)


async def test_structured_json_schema(inference):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    r = req(max_new_tokens=64, ignore_eos=False)
    r.decoding.json = json.dumps(schema)
    # A random model pads JSON with whitespace until max tokens; the structure must still hold.
    compact = re.sub(r"\s", "", (await gen(inference, r)).text)
    assert re.fullmatch(r'\{"a":(true|false)(\})?', compact), compact


async def test_structured_json_object(inference):
    r = req(max_new_tokens=64, ignore_eos=False)
    r.decoding.json_object = True
    assert isinstance(json.loads((await gen(inference, r)).text), dict)


async def test_structured_grammar(inference):
    r = req(max_new_tokens=16, ignore_eos=False)
    r.decoding.grammar = 'root ::= "ab" | "cd"'
    assert (await gen(inference, r)).text in ("ab", "cd")


async def test_max_and_min_new_tokens(inference):
    base = list((await gen(inference, req(max_new_tokens=24))).token_ids)
    assert len(base) == 24
    r = req(max_new_tokens=24)
    r.stopping.stop_token_ids.append(base[0])
    out = await gen(inference, r)
    assert list(out.token_ids) == base[:1]
    assert out.finish_info.finish_reason == pb.FinishInfo.STOP
    assert out.finish_info.stop_token_id == base[0]
    r.stopping.min_new_tokens = 5
    assert len((await gen(inference, r)).token_ids) >= 5


async def test_stop_strings_with_and_without_including_them(inference):
    base = (await gen(inference, req(max_new_tokens=24))).text
    stop = base[6:10]
    r = req(max_new_tokens=24)
    r.stopping.stop_strings.append(stop)
    out = await gen(inference, r)
    assert out.finish_info.finish_reason == pb.FinishInfo.STOP
    assert out.finish_info.stop_string == stop
    assert out.text == base[: base.index(stop)]
    r.stopping.include_stop_strings = True
    assert (await gen(inference, r)).text == base[: base.index(stop) + len(stop)]


async def test_eos_stops_unless_ignored_and_special_tokens_can_be_kept(engine, inference):
    eos = engine.llm.get_tokenizer().eos_token_id
    r = req(max_new_tokens=8, ignore_eos=False)
    r.decoding.logit_bias[eos] = 100.0
    out = await gen(inference, r)
    assert out.finish_info.finish_reason == pb.FinishInfo.STOP
    assert out.finish_info.eos_token_id == eos
    assert out.finish_info.num_output_tokens == 1
    r.stopping.ignore_eos = True
    out = await gen(inference, r)
    assert out.finish_info.num_output_tokens == 8 and out.text == ""
    r.response.skip_special_tokens = False
    assert engine.llm.get_tokenizer().decode([eos]) in (await gen(inference, r)).text


async def test_output_options(inference):
    r = req(max_new_tokens=6)
    r.response.output_text = False
    r.response.output_token_ids = False
    out = await gen(inference, r)
    assert out.text == "" and not out.token_ids and out.num_tokens == 6 and not out.logprobs
    r = req(max_new_tokens=6, output_logprobs=True)
    out = await gen(inference, r)
    assert len(out.logprobs) == 6 and all(lp <= 0 for lp in out.logprobs)
    assert list(out.ranks) == [1] * 6, "greedy tokens have rank 1"
    r.response.output_candidates.top_n = 3
    out = await gen(inference, r)
    assert len(out.candidate_tokens) == 6
    assert all(len(c.tokens) >= 3 for c in out.candidate_tokens)
    assert [c.tokens[0].id for c in out.candidate_tokens] == list(out.token_ids)
    r.response.output_candidates.token_ids.ids.extend([5, 6])
    out = await gen(inference, r)
    assert all({5, 6} <= {t.id for t in c.tokens} for c in out.candidate_tokens)


async def test_prompt_options_and_truncation(engine, inference):
    ids = engine.llm.get_tokenizer().encode(PROMPT)
    r = req(max_new_tokens=2)
    r.response.prompt_token_ids = True
    r.response.prompt_logprobs = True
    info = (await inference.Generate(r)).prompt_info
    assert list(info.token_ids) == ids and info.num_prompt_tokens == len(ids)
    assert len(info.logprobs) == len(ids) and all(lp <= 0 for lp in info.logprobs[1:])
    r.response.prompt_candidates.top_n = 2
    info = (await inference.Generate(r)).prompt_info
    assert len(info.candidate_tokens) == len(ids)
    r.truncate_prompt_tokens = 5
    info = (await inference.Generate(r)).prompt_info
    assert list(info.token_ids) == ids[-5:] and info.num_prompt_tokens == 5


async def test_native_sampling_params_json_overrides(inference):
    r = req(max_new_tokens=16)
    r.native_sampling_params_json = json.dumps({"max_tokens": 3}).encode()
    assert (await gen(inference, r)).finish_info.num_output_tokens == 3


async def test_unset_temperature_is_greedy(inference):
    r = req(max_new_tokens=12)
    r.ClearField("temperature")
    assert list((await gen(inference, r)).token_ids) == list((await gen(inference, req(max_new_tokens=12))).token_ids)


def _with(mutate):
    r = req()
    mutate(r)
    return r


REFUSED = [
    ("empty text", lambda r: setattr(r, "text", ""), "text"),
    ("empty token ids", lambda r: r.token_ids.SetInParent(), "token_ids"),
    ("no prompt", lambda r: r.ClearField("text"), "prompt"),
    ("token id outside vocab", lambda r: r.token_ids.ids.extend([10**7]), "token_ids"),
    ("unknown model", lambda r: setattr(r, "model", "gpt-17"), "model"),
    ("prompt too long", lambda r: setattr(r, "text", "hello " * 2000), "prompt"),
    ("max tokens past context", lambda r: setattr(r.stopping, "max_new_tokens", 100000), "max_new_tokens"),
    ("n > 1 on unary", lambda r: setattr(r.sampling, "num_sequences", 2), "num_sequences"),
    ("session id", lambda r: setattr(r, "session_id", "s"), "session_id"),
    ("media", lambda r: r.media.add(url="http://x/y.png"), "media"),
    ("lora", lambda r: setattr(r, "lora_name", "adapter"), "lora_name"),
    ("kv transfer params", lambda r: r.kv.kv_transfer_params.update({"a": 1}), "kv_transfer_params"),
    ("ec transfer params", lambda r: r.kv.ec_transfer_params.update({"a": 1}), "ec_transfer_params"),
    ("prompt candidates by id", lambda r: r.response.prompt_candidates.token_ids.ids.append(1), "prompt_candidates"),
    ("bad native json", lambda r: setattr(r, "native_sampling_params_json", b"{nope"), "native_sampling_params_json"),
    (
        "native json not object",
        lambda r: setattr(r, "native_sampling_params_json", b"[1]"),
        "native_sampling_params_json",
    ),
    (
        "native unknown key",
        lambda r: setattr(r, "native_sampling_params_json", b'{"bogus": 1}'),
        "native_sampling_params_json",
    ),
    ("bad json schema", lambda r: setattr(r.decoding, "json", "{not json"), "decoding.json"),
    ("empty choice", lambda r: r.decoding.choice.SetInParent(), "decoding.choice"),
    ("priority without priority scheduling", lambda r: setattr(r, "priority", 5), "priority"),
    ("negative temperature", lambda r: setattr(r, "temperature", -1.0), "temperature"),
]


@pytest.mark.parametrize("mutate,field", [(m, f) for _, m, f in REFUSED], ids=[n for n, _, _ in REFUSED])
async def test_refused_with_invalid_argument_naming_the_field(engine, inference, mutate, field):
    await expect_invalid(inference, _with(mutate), field)
    assert engine.num_unfinished_requests() == 0
