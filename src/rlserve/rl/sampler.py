"""Where a run's batches of rollouts come from: an event loop of its own with one streaming
client (one server's `AsyncClient`, or a fleet's `FleetStreams`), sampling a batch when the
trainer asks for one (synchronous) or from a thread that samples ahead while the trainer
trains (asynchronous). Owns the event loop, the client and the thread; not what a batch is
trained on."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import queue
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Protocol

from rlserve.api.vllm import inference_pb2 as pb
from rlserve.rl.config import GrpoConfig
from rlserve.rl.rollout import GenerateStreams, Rollout, sample_batch
from rlserve.rl.tasks import Problem, Task
from rlserve.sdk.fleet import AsyncFleet, Fleet

# A batch and the seconds it took to sample.
Batch = tuple[list[Rollout], float]
# How often the rollout thread looks at `stop` while it waits for the trainer, and how often
# the trainer looks whether the thread is still alive while it waits for a batch.
CREDIT_POLL_S, READY_POLL_S = 0.2, 0.5


class RolloutClient(GenerateStreams, Protocol):
    """A client the sampler opens on its event loop and closes there."""

    async def close(self) -> None: ...


class FleetStreams:
    """What the rollouts need of a client (`stream`, `close`), across a fleet: a prompt's
    completions go to one server (session affinity on the prompt: its prefix cache)."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = AsyncFleet(fleet)

    async def stream(
        self, request: pb.GenerateRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        prompt = request.text.encode() + request.token_ids.SerializeToString(deterministic=True)
        session = hashlib.blake2b(prompt, digest_size=8).hexdigest()
        routed = self._fleet.stream(request, session_id=session, timeout_s=timeout_s)
        try:
            async for one in routed:
                yield one.response
        finally:
            # AsyncFleet.stream is an async generator (typed as an AsyncIterator): closing it
            # here cancels the request at once when the caller leaves early.
            if isinstance(routed, AsyncGenerator):
                await routed.aclose()

    async def close(self) -> None:
        await self._fleet.close()


class Sampler:
    """Batches of rollouts of new problems from `task`, through the client `open_client()`
    makes on the sampler's event loop (a grpc.aio channel belongs to its loop)."""

    def __init__(
        self,
        open_client: Callable[[], RolloutClient],
        task: Task,
        prompt_ids: Callable[[Problem], list[int]],
        config: GrpoConfig,
    ) -> None:
        self._task, self._prompt_ids, self._config = task, prompt_ids, config
        self._loop = asyncio.new_event_loop()
        self._client = self._loop.run_until_complete(_opened(open_client))
        self._batches = itertools.count()

    def sample(self) -> Batch:
        """One batch, sampled on the sampler's event loop in the calling thread."""
        return self._loop.run_until_complete(self._one_batch())

    def adopt_thread(self) -> None:
        """Make the sampler's event loop the calling thread's (a thread that samples)."""
        asyncio.set_event_loop(self._loop)

    def close(self) -> None:
        self._loop.run_until_complete(self._client.close())
        self._loop.close()

    async def _one_batch(self) -> Batch:
        """A batch of new problems; aborted sequences (the server was paused with ABORT)
        are dropped, and a batch with nothing left is sampled again, up to three times."""
        cfg, t0 = self._config, time.perf_counter()
        for _ in range(3):
            problems = self._task.problems(cfg.prompts_per_step)
            ids = [self._prompt_ids(p) for p in problems]
            seed = cfg.seed * 1_000_003 + next(self._batches) * cfg.prompts_per_step
            rollouts = await sample_batch(self._client, problems, ids, cfg.sampling, seed)
            kept = [r for r in rollouts if r.finish != "ABORTED" and r.num_tokens]
            if kept:
                return kept, time.perf_counter() - t0
        raise RuntimeError("three batches in a row came back aborted: is the server being paused with ABORT?")


async def _opened(open_client: Callable[[], RolloutClient]) -> RolloutClient:
    return open_client()


class SampledAhead:
    """A thread that samples batches ahead of the trainer. A batch starts only when the trainer
    takes one: with `ahead` credits, at most that many batches are sampled ahead of the one in
    training, so no token is more than `ahead` versions old when it is trained on (the loss
    still drops any that are)."""

    def __init__(self, sampler: Sampler, ahead: int, stop: threading.Event) -> None:
        self._sampler, self._stop = sampler, stop
        self._credits = threading.Semaphore(ahead)
        self._ready: queue.Queue[Batch | Exception] = queue.Queue()
        self._producer = threading.Thread(target=self._produce, name="rlserve-rollouts", daemon=True)
        self._producer.start()

    def next(self) -> Batch:
        """The next batch sampled; raises what sampling raised, or RuntimeError when the thread
        stopped."""
        while True:
            with contextlib.suppress(queue.Empty):
                item = self._ready.get(timeout=READY_POLL_S)
                if isinstance(item, Exception):
                    raise item
                self._credits.release()
                return item
            if not self._producer.is_alive():
                raise RuntimeError("the rollout thread stopped")

    def close(self, timeout_s: float) -> None:
        """Stop the thread; the sampler is closed once it has, within `timeout_s`."""
        self._stop.set()
        self._producer.join(timeout=timeout_s)
        if not self._producer.is_alive():
            self._sampler.close()

    def _produce(self) -> None:
        self._sampler.adopt_thread()
        while not self._stop.is_set():
            if not self._credits.acquire(timeout=CREDIT_POLL_S):
                continue
            try:
                self._ready.put(self._sampler.sample())
            except Exception as e:  # handed to the trainer, which raises it
                self._ready.put(e)
                return


@contextlib.contextmanager
def batches(sampler: Sampler, config: GrpoConfig, stop: threading.Event) -> Iterator[Callable[[], Batch]]:
    """`next_batch() -> (rollouts, seconds the batch took to sample)`: sampled on demand
    (synchronous), or by a thread that samples ahead while the trainer trains (asynchronous,
    up to `max_staleness` batches, at least one). The sampler is closed on exit."""
    if not config.asynchronous:
        try:
            yield sampler.sample
        finally:
            sampler.close()
        return
    ahead = SampledAhead(sampler, max(1, config.max_staleness), stop)
    try:
        yield ahead.next
    finally:
        ahead.close(timeout_s=config.sampling.timeout_s)
