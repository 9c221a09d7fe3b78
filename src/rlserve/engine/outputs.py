"""Translate vLLM's `RequestOutput`s of one request into rlserve's `GenerateChunk`s.

One `OutputTranslator` per request: it remembers whether the prompt details went out and how
many tokens each sequence has produced, so finish info counts the whole sequence.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput

from rlserve.errors import EngineUnavailable
from rlserve.types import (
    Finish,
    FinishReason,
    GenerateChunk,
    GenerateParams,
    PromptDetails,
    SequenceChunk,
    TokenCandidate,
    TokenScores,
    WeightVersionSpan,
)

# Every finish vLLM reports but "error" (a retryable engine-side failure of the request, which
# ends the call with UNAVAILABLE): repetition detection is a stop the engine decided on.
FINISH_REASONS = {
    "length": FinishReason.LENGTH,
    "stop": FinishReason.STOP,
    "repetition": FinishReason.STOP,
    "abort": FinishReason.ABORTED,
}
NO_SCORES = TokenScores()


class OutputTranslator:
    def __init__(self, params: GenerateParams, eos_token_id: int | None) -> None:
        self._params = params
        self._eos_token_id = eos_token_id
        self._want_scores = params.return_logprobs or params.output_candidates is not None
        self._want_candidates = params.output_candidates is not None
        self._num_tokens: dict[int, int] = {}
        self._prompt_sent = False

    def translate(self, out: RequestOutput) -> Iterator[GenerateChunk]:
        for completion in out.outputs:
            chunk = self._sequence_chunk(completion, out.kv_transfer_params)
            if chunk is None and self._prompt_sent:
                continue
            prompt = None if self._prompt_sent else self._prompt_details(out)
            self._prompt_sent = True
            yield GenerateChunk(prompt, chunk or SequenceChunk(completion.index, "", ()))

    def _sequence_chunk(self, c: CompletionOutput, kv: dict | None) -> SequenceChunk | None:
        token_ids = tuple(c.token_ids)
        total = self._num_tokens.get(c.index, 0) + len(token_ids)
        self._num_tokens[c.index] = total
        finish = self._finish(c, total, kv) if c.finish_reason is not None else None
        if not token_ids and finish is None:
            return None
        scores = _scores(c.logprobs, token_ids, self._want_candidates) if self._want_scores else NO_SCORES
        spans = tuple(WeightVersionSpan(s.version, s.start, s.end) for s in c.weight_versions or ())
        return SequenceChunk(
            index=c.index,
            text=c.text if self._params.return_text else "",
            token_ids=token_ids,
            scores=scores,
            finish=finish,
            weight_version_spans=spans,
        )

    def _finish(self, c: CompletionOutput, total: int, kv: dict | None) -> Finish:
        reason = FINISH_REASONS.get(c.finish_reason)  # type: ignore[arg-type]  # vLLM types it str | None; None has no row
        if reason is None:
            raise EngineUnavailable(f"the engine failed the request ({c.finish_reason}); retry it")
        stop = c.stop_reason
        return Finish(
            num_output_tokens=total,
            reason=reason,
            stop_token_id=stop if isinstance(stop, int) else None,
            stop_string=stop if isinstance(stop, str) else None,
            eos_token_id=self._eos_token_id if c.finish_reason == "stop" and stop is None else None,
            kv_transfer_params=kv,
        )

    def _prompt_details(self, out: RequestOutput) -> PromptDetails:
        ids = tuple(out.prompt_token_ids or ())
        p = self._params
        scores = NO_SCORES
        if out.prompt_logprobs is not None:
            scores = _scores(out.prompt_logprobs, ids, p.prompt_candidates is not None)
        return PromptDetails(
            num_prompt_tokens=len(ids),
            token_ids=ids if p.return_prompt_token_ids else (),
            scores=scores,
        )


def _scores(logprobs: Sequence[Any] | None, token_ids: Sequence[int], with_candidates: bool) -> TokenScores:
    """Per-position logprob and rank of the chosen token; NaN/0 where vLLM has none (the
    first prompt token has no context)."""
    if logprobs is None:
        return NO_SCORES
    values: list[float] = []
    ranks: list[int] = []
    candidates: list[tuple[TokenCandidate, ...]] = []
    for token_id, position in zip(token_ids, logprobs):
        chosen = position.get(token_id) if position else None
        values.append(chosen.logprob if chosen is not None else math.nan)
        ranks.append((chosen.rank or 0) if chosen is not None else 0)
        if with_candidates:
            items = sorted((position or {}).items(), key=lambda kv: kv[1].rank or 0)
            candidates.append(tuple(TokenCandidate(t, lp.logprob, lp.rank or 0) for t, lp in items))
    return TokenScores(tuple(values), tuple(ranks), tuple(candidates))


def aborted_before_start(params: GenerateParams, num_prompt_tokens: int) -> list[GenerateChunk]:
    """What a request aborted before the engine saw it ends with: each sequence finished
    ABORTED with no tokens (the first chunk carries the prompt details, as always)."""
    prompt = PromptDetails(num_prompt_tokens=num_prompt_tokens)
    return [
        GenerateChunk(prompt if i == 0 else None, SequenceChunk(i, "", (), finish=Finish(0, FinishReason.ABORTED)))
        for i in range(params.num_sequences)
    ]
