"""`--logprobs-mode` against a real engine and server. With processed_logprobs the logprob of
every token sampled at temperature 0.7 is the model's log softmax(logits / 0.7), the
distribution the token was drawn from; the default raw_logprobs gives log softmax(logits),
which is what biases an importance-sampling correction whenever the temperature is not 1. The
trainer's side of the comparison is the Hugging Face model on the same checkpoint, in fp32."""

from __future__ import annotations

from dataclasses import replace

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from rlserve.api.rlserve.v1 import lifecycle_pb2 as lpb
from rlserve.config import EngineConfig, ServeConfig
from rlserve.sdk.client import generate_request

from helpers import serving, sync_checkpoint

PROMPT_IDS = [17, 42, 256, 1024, 7, 99, 512, 3]
TEMPERATURE = 0.7


@pytest_asyncio.fixture(scope="module")
async def processed(engines, engine_config, tiny_model_dir):
    """A server over an engine that returns processed logprobs (with rlserve_gloo: test_trl
    trains through the same engine), serving the checkpoint."""
    fields = {"logprobs_mode": "processed_logprobs", "weight_transfer_backend": "rlserve_gloo"}
    engine = await engines.get(**fields)
    async with serving(engine, ServeConfig(engine=replace(engine_config, **fields))) as stubs:
        await sync_checkpoint(stubs.target, tiny_model_dir)
        yield stubs


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


async def sample(inference) -> tuple[list[int], list[float]]:
    request = generate_request(PROMPT_IDS, max_new_tokens=16, temperature=TEMPERATURE, output_logprobs=True)
    request.stopping.ignore_eos = True
    tokens, logprobs = [], []
    async for r in inference.GenerateStream(request):
        tokens += r.outputs.token_ids
        logprobs += r.outputs.logprobs
    return tokens, logprobs


def trainer_logprobs(model, tokens: list[int], temperature: float) -> torch.Tensor:
    """log p(token | prefix) of each sampled token under softmax(logits / temperature)."""
    ids = torch.tensor([PROMPT_IDS + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT_IDS) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


async def test_processed_logprobs_are_those_the_tokens_were_sampled_from(processed, model):
    assert (await processed.lifecycle.GetState(lpb.GetStateRequest())).logprobs_mode == "processed_logprobs"
    tokens, logprobs = await sample(processed.inference)
    served = torch.tensor(logprobs)
    assert len(tokens) == len(logprobs) == 16
    assert torch.allclose(served, trainer_logprobs(model, tokens, TEMPERATURE), atol=1e-3)
    # What the default mode would have said differs visibly: the ratio would not be 1.
    assert (served - trainer_logprobs(model, tokens, 1.0)).abs().max() > 1e-2


async def test_raw_logprobs_the_default_ignore_the_temperature(lifecycle, inference, model):
    assert (await lifecycle.GetState(lpb.GetStateRequest())).logprobs_mode == "raw_logprobs"
    tokens, logprobs = await sample(inference)
    served = torch.tensor(logprobs)
    assert torch.allclose(served, trainer_logprobs(model, tokens, 1.0), atol=1e-3)
    assert (served - trainer_logprobs(model, tokens, TEMPERATURE)).abs().max() > 1e-2


def test_a_mode_vllm_does_not_have_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineConfig(model=str(tiny_model_dir), logprobs_mode="sampled")
