"""Rollouts through rlserve: groups of sampled completions with the logprob and the weight
version behind every token, as the server reports them.

One GenerateStream per prompt asks for the whole group (num_sequences), so the engine
prefills the prompt once; tokens arrive per sequence and the final message of each carries
its weight-version spans. A token's version is read from those spans, never assumed: a
request kept across a weight update (pause KEEP) has tokens of two versions.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rlserve.api.vllm import inference_pb2 as pb
from rlserve.rl.tasks import Problem
from rlserve.sdk.client import generate_request


class GenerateStreams(Protocol):
    """What sampling needs of a client: GenerateStream as an async iterator. One server's
    `AsyncClient` is one; so is `sampler.FleetStreams`, across a fleet."""

    def stream(
        self, request: pb.GenerateRequest, /, *, timeout_s: float | None = None
    ) -> AsyncIterator[pb.GenerateResponse]: ...


@dataclass
class Rollout:
    """One sampled completion of `problem`'s prompt; `group` numbers the prompt in its batch."""

    problem: Problem
    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # the server's, one per completion token
    versions: list[str]  # the weight version that sampled each completion token
    text: str
    finish: str
    reward: float = 0.0
    advantage: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.completion_ids)


@dataclass(frozen=True)
class SamplingConfig:
    group_size: int = 8
    max_new_tokens: int = 16
    # At 1.0 a server's default (raw) logprobs are those of the distribution sampled from; at
    # any other temperature the loop needs a server with processed logprobs (it checks).
    temperature: float = 1.0
    timeout_s: float = 300.0


def versions_from_spans(spans: Sequence, num_tokens: int) -> list[str]:
    """One version per output token from the spans of a finished sequence; raises ValueError
    when the spans do not cover exactly tokens [0, num_tokens)."""
    versions: list[str] = []
    for span in sorted(spans, key=lambda s: s.start):
        if span.start != len(versions) or span.end < span.start:
            raise ValueError(f"weight-version spans do not tile the output: {list(spans)}")
        versions.extend([span.weight_version] * (span.end - span.start))
    if len(versions) != num_tokens:
        raise ValueError(f"weight-version spans cover {len(versions)} of {num_tokens} tokens")
    return versions


@dataclass
class StreamedSequence:
    """One sequence of a GenerateStream as the server sent it: its tokens, their logprobs (and
    top candidates, when asked for) and the weight version behind each; the prompt's token
    ids when the request asked for them."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[str]
    text: str
    finish: str
    candidates: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)


async def stream_sequences(
    client: GenerateStreams, request: pb.GenerateRequest, num_sequences: int, timeout_s: float | None
) -> list[StreamedSequence]:
    """The `num_sequences` sequences of one GenerateStream, in index order; RuntimeError when
    the stream ends with one unfinished, a token without its logprob (when asked for) or
    spans that do not cover the tokens."""
    # Per sequence: its token ids, their logprobs, its text pieces, its candidates.
    parts: dict[int, tuple[list[int], list[float], list[str], list]] = {
        i: ([], [], [], []) for i in range(num_sequences)
    }
    finals: dict[int, pb.SequenceOutput] = {}
    prompt_ids: list[int] = []
    async for message in client.stream(request, timeout_s=timeout_s):
        if message.HasField("prompt_info"):
            prompt_ids = list(message.prompt_info.token_ids)
        out = message.outputs
        ids, logprobs, texts, candidates = parts[out.index]
        ids.extend(out.token_ids)
        logprobs.extend(out.logprobs)
        texts.append(out.text)
        candidates.extend([(t.id, t.logprob) for t in c.tokens] for c in out.candidate_tokens)
        if out.HasField("finish_info"):
            finals[out.index] = out
    if len(finals) != num_sequences:
        raise RuntimeError(f"the stream ended with {len(finals)} of {num_sequences} sequences finished")
    sequences: list[StreamedSequence] = []
    for i in range(num_sequences):
        ids, logprobs, texts, candidates = parts[i]
        if request.response.output_logprobs and len(logprobs) != len(ids):
            raise RuntimeError(f"sequence {i}: {len(logprobs)} logprobs for {len(ids)} tokens")
        final = finals[i]
        sequences.append(
            StreamedSequence(
                token_ids=ids,
                logprobs=logprobs,
                versions=_versions(final, i, len(ids)),
                text="".join(texts),
                finish=pb.FinishInfo.FinishReason.Name(final.finish_info.finish_reason),
                candidates=candidates,
                prompt_ids=prompt_ids,
            )
        )
    return sequences


async def sample_group(
    client: GenerateStreams,
    problem: Problem,
    group: int,
    prompt_ids: list[int],
    config: SamplingConfig,
    seed: int | None,
) -> list[Rollout]:
    """`config.group_size` completions of one prompt, in sequence order."""
    request = _group_request(prompt_ids, config, seed)
    sequences = await stream_sequences(client, request, config.group_size, config.timeout_s)
    return [
        Rollout(
            problem=problem,
            group=group,
            prompt_ids=list(prompt_ids),
            completion_ids=seq.token_ids,
            logprobs=seq.logprobs,
            versions=seq.versions,
            text=seq.text,
            finish=seq.finish,
        )
        for seq in sequences
    ]


def _group_request(prompt_ids: list[int], config: SamplingConfig, seed: int | None) -> pb.GenerateRequest:
    """One request for the whole group (num_sequences): the engine prefills the prompt once."""
    sampling = pb.RandomSampling(num_sequences=config.group_size)
    if seed is not None:
        sampling.seed = seed
    return generate_request(
        prompt_ids,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        output_logprobs=True,
        sampling=sampling,
    )


def _versions(final: pb.SequenceOutput, index: int, num_tokens: int) -> list[str]:
    try:
        return versions_from_spans(final.weight_version_spans, num_tokens)
    except ValueError as e:  # a server that does not report spans (not rlserve), or a bug
        raise RuntimeError(f"sequence {index}: {e}") from e


async def sample_batch(
    client: GenerateStreams,
    problems: Sequence[Problem],
    prompt_ids: Sequence[list[int]],
    config: SamplingConfig,
    seed: int | None = None,
) -> list[Rollout]:
    """A group for every problem, all in flight at once (the engine batches them)."""
    groups = await asyncio.gather(
        *(
            sample_group(client, p, g, ids, config, None if seed is None else seed + g)
            for g, (p, ids) in enumerate(zip(problems, prompt_ids, strict=True))
        )
    )
    return [r for group in groups for r in group]
