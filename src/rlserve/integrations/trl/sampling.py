"""TRL's sampling arguments as an rlserve GenerateRequest, and the logprobs that come back in
TRL's shapes: what `RlserveVLLMClient.generate` sends and returns."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rlserve.api.vllm import inference_pb2 as pb
from rlserve.rl.rollout import StreamedSequence
from rlserve.sdk.client import generate_request


def sampling_request(
    *,
    n: int,
    repetition_penalty: float,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    max_tokens: int,
    logprobs: int | None,
    regex: str | None,
    generation_kwargs: Mapping[str, Any] | None,
    truncate_prompt_tokens: int | None,
) -> pb.GenerateRequest:
    """The GenerateRequest (without its prompt) for TRL's sampling arguments; what TRL puts
    in `generation_kwargs` goes as vLLM SamplingParams (native_sampling_params_json)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    sampling = pb.RandomSampling(num_sequences=n, top_p=top_p, min_p=min_p)
    if top_k > 0:
        sampling.top_k = top_k
    req = generate_request(
        [], max_new_tokens=max_tokens, temperature=temperature, output_logprobs=logprobs is not None, sampling=sampling
    )
    req.ClearField("token_ids")
    req.decoding.repetition_penalty = repetition_penalty
    if regex is not None:
        req.decoding.regex = regex
    if logprobs:
        req.response.output_candidates.top_n = logprobs
    if truncate_prompt_tokens:
        req.truncate_prompt_tokens = truncate_prompt_tokens
    if generation_kwargs:
        req.native_sampling_params_json = json.dumps(dict(generation_kwargs)).encode()
    return req


def ranked_logprobs(sequences: Sequence[StreamedSequence]) -> tuple[list, list]:
    """Per sequence, per token: the logprobs and their token ids by descending probability,
    the sampled token among them (TRL's shape: one entry when `logprobs=0`)."""
    all_lps: list = []
    all_ids: list = []
    for s in sequences:
        lps, ids = [], []
        for k, (token, lp) in enumerate(zip(s.token_ids, s.logprobs, strict=True)):
            top = dict(s.candidates[k]) if k < len(s.candidates) else {}
            ranked = sorted({**top, token: lp}.items(), key=lambda item: -item[1])
            ids.append([t for t, _ in ranked])
            lps.append([v for _, v in ranked])
        all_lps.append(lps)
        all_ids.append(ids)
    return all_lps, all_ids
