"""TRL's AsyncGRPOTrainer protocols over rlserve: `RlserveWeightTransfer` (its
WeightTransferProtocol: each push one versioned, verified, all-or-nothing sync, staged where
the server offers it so that generation pauses only for the commit) and
`RlserveRolloutWorker` (its RolloutWorkerProtocol: a thread sampling groups through rlserve,
each sample tagged with the oldest weight version behind any of its tokens, as the server
reported it, which TRL's staleness check then reads). Needs TRL for `RolloutSample`."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from rlserve.api.vllm import inference_pb2 as pb
from rlserve.integrations.trl.client import Options, drained
from rlserve.rl.rollout import StreamedSequence, stream_sequences
from rlserve.sdk.client import AsyncClient, Client, generate_request
from rlserve.sdk.plan import TensorStream
from rlserve.sdk.weight_sync import SyncStats

# How often the rollout thread looks at its stop flag while the buffer is full.
PUT_POLL_S = 0.2


def version_number(version: str) -> int:
    """A served weight version as TRL's model_version: the pushes publish str(n); any other
    (the checkpoint the server started with) is 0, the trainer's first."""
    return int(version) if version.isdigit() else 0


class RlserveWeightTransfer:
    """`weight_transfer=` for AsyncGRPOTrainer. `metadata` ((name, dtype, shape) per tensor,
    as TRL's `weight_update_info`) lets each push stream; without it a push is gathered
    first. The n-th push publishes version str(n) (TRL's model_version after it)."""

    def __init__(
        self,
        target: str,
        *,
        metadata: Sequence[tuple[str, str, Sequence[int]]] | None = None,
        options: Options = Options(),
    ) -> None:
        self.options = options
        self.client = Client(target, credentials=options.credentials)
        self.weight_sync = options.weight_sync(self.client)
        self.metadata = list(metadata) if metadata is not None else None
        self.model_version = 0
        self.sync_stats: list[SyncStats] = []

    def init_weight_transfer(self) -> None:
        self.weight_sync.init(shm_capacity=self.options.chunk_bytes)

    def pause(self) -> None:
        """Nothing yet: the sync pauses generation itself, for the commit only (staged), or for
        the whole sync on a server that cannot stage."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """One sync of what `iterator` yields; raises WeightSyncError (the old version keeps
        serving). The iterator is drained whatever happens (its gathers are collectives)."""
        with drained(iterator) as items:
            weights: Any = TensorStream(self.metadata, items) if self.metadata is not None else items
            stats = self.weight_sync.sync(
                weights, str(self.model_version + 1), staged=self.options.staged, verify=self.options.verify
            )
        self.sync_stats.append(stats)
        self.model_version += 1

    def resume(self) -> None:
        """Nothing left to do: the sync resumed what it paused (a pause someone else made stays)."""

    def destroy(self) -> None:
        self.weight_sync.close()
        self.client.close()


RewardFunc = Callable[..., Sequence[float]]


class RlserveRolloutWorker:
    """`rollout_worker=` for AsyncGRPOTrainer: groups of `num_generations` completions of each
    prompt in `prompts` (token ids, cycled), scored by `reward_funcs` (TRL's signature:
    `f(prompts=, completions=, completion_ids=) -> rewards`), advantages normalised within
    the group, pushed to `rollout_buffer` as TRL's RolloutSample."""

    def __init__(
        self,
        target: str,
        prompts: Sequence[Sequence[int]],
        reward_funcs: Sequence[RewardFunc],
        tokenizer: Any,
        *,
        num_generations: int = 4,
        max_tokens: int = 16,
        temperature: float = 1.0,
        buffer_size: int = 64,
        options: Options = Options(),
    ) -> None:
        if not prompts:
            raise ValueError("no prompts")
        self.target, self.options = target, options
        self.prompts = [list(p) for p in prompts]
        self.reward_funcs, self.tokenizer = list(reward_funcs), tokenizer
        self.num_generations, self.max_tokens, self.temperature = num_generations, max_tokens, temperature
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=buffer_size)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.model_version = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._heartbeat = time.monotonic()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rlserve-trl-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.options.generate_timeout_s)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        """RuntimeError when the thread failed (its error chained) or made nothing for
        `stale_after_s` seconds."""
        if self._error is not None:
            raise RuntimeError("the rlserve rollout worker failed") from self._error
        age = time.monotonic() - self._heartbeat
        if age > stale_after_s:
            raise RuntimeError(f"the rlserve rollout worker made no rollout for {age:.0f} s (> {stale_after_s:.0f} s)")

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._produce())
        except BaseException as e:  # the trainer sees it through check_health
            self._error = e
        finally:
            loop.close()

    async def _produce(self) -> None:
        async with AsyncClient(self.target, credentials=self.options.credentials) as client:
            group_id = 0
            while not self._stop.is_set():
                prompt = self.prompts[group_id % len(self.prompts)]
                request = generate_request(
                    prompt,
                    max_new_tokens=self.max_tokens,
                    temperature=self.temperature,
                    output_logprobs=True,
                    sampling=pb.RandomSampling(num_sequences=self.num_generations),
                )
                group = await stream_sequences(client, request, self.num_generations, self.options.generate_timeout_s)
                for sample in self._samples(prompt, group, group_id):
                    await asyncio.to_thread(self._put, sample)
                self._heartbeat = time.monotonic()
                group_id += 1

    def _samples(self, prompt: list[int], group: list[StreamedSequence], group_id: int) -> list[Any]:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        texts = [s.text for s in group]
        prompt_text = self.tokenizer.decode(prompt)
        rewards = np.zeros(len(group))
        for f in self.reward_funcs:
            rewards += np.asarray(
                f(prompts=[prompt_text] * len(group), completions=texts, completion_ids=[s.token_ids for s in group]),
                dtype=np.float64,
            )
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        samples = []
        for s, reward, advantage in zip(group, rewards, advantages, strict=True):
            samples.append(
                RolloutSample(
                    prompt=[{"role": "user", "content": prompt_text}],
                    completion=[{"role": "assistant", "content": s.text}],
                    input_ids=np.asarray(prompt + s.token_ids, dtype=np.int64),
                    completion_mask=np.asarray([0] * len(prompt) + [1] * len(s.token_ids), dtype=np.int64),
                    old_log_probs=np.asarray([0.0] * len(prompt) + s.logprobs, dtype=np.float32),
                    advantage=float(advantage),
                    # The oldest weights behind any token, as the server reported them.
                    model_version=min((version_number(v) for v in s.versions), default=self.model_version),
                    group_id=group_id,
                    metrics={"reward": float(reward)},
                    enqueued_at=time.time(),
                )
            )
        return samples

    def _put(self, sample: Any) -> None:
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=PUT_POLL_S)
                return
            except queue.Full:
                continue
