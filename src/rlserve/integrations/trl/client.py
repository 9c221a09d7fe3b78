"""`RlserveVLLMClient`: the duck of TRL's `VLLMClient` (trl 1.16, and the per-tensor method
set TRL used before trl#6765), over rlserve's gRPC API. Generation is one GenerateStream per
prompt (the whole group, `num_sequences=n`), all in flight at once, each completion's
per-token weight versions kept (`last_versions`). A weight push is one `WeightSync.sync` per
step, versioned `str(step)`, streamed as TRL yields the tensors, all or nothing: a refused
or failed sync raises `WeightSyncError` in the training loop and the server keeps serving
the old version. Every wait is bounded. Owns its channels and its weight sync; not TRL."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

from rlserve.api.rlserve.v1 import lifecycle_pb2, lifecycle_pb2_grpc
from rlserve.api.vllm import control_pb2
from rlserve.api.vllm import inference_pb2 as pb
from rlserve.integrations.trl.sampling import ranked_logprobs, sampling_request
from rlserve.rl.rollout import StreamedSequence, stream_sequences
from rlserve.sdk.client import AsyncClient, ChannelCredentials, Client
from rlserve.sdk.plan import DEFAULT_BUCKET_BYTES, TensorStream
from rlserve.sdk.weight_sync import SyncStats, WeightSync

# Tensors held by the trainer per chunk while a step's weights stream (the whole model at
# most once in flight, never a second copy of it).
STREAM_CHUNK_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Options:
    """How the adapter reaches and syncs its server (`install(...)` sets them)."""

    credentials: ChannelCredentials | None = None
    transport: str = "auto"  # "gloo", "shm" or the server's
    master_address: str = "127.0.0.1"  # the trainer's address, as the server's workers reach it
    master_port: int = 0  # 0: a free port for each rendezvous
    staged: bool | None = None  # None: stage where the server offers it
    verify: bool = True
    generate_timeout_s: float = 600.0
    sync_timeout_s: float = 120.0
    rpc_timeout_s: float = 30.0
    chunk_bytes: int = STREAM_CHUNK_BYTES
    tokenizer: Any = None  # for chat(): the trainer's; None: loaded from the served model id

    def weight_sync(self, client: Client) -> WeightSync:
        """The SDK's weight sync to `client`'s server, as these options say."""
        return WeightSync(
            client,
            master_address=self.master_address,
            master_port=self.master_port,
            timeout_s=self.sync_timeout_s,
            rpc_timeout_s=self.rpc_timeout_s,
            chunk_bytes=self.chunk_bytes,
            bucket_bytes=min(self.chunk_bytes, DEFAULT_BUCKET_BYTES),
            transport=self.transport,
        )


def target_of(base_url: str | None, host: str, server_port: int) -> str:
    """The gRPC target in TRL's server settings: `grpc://host:port`, `http://host:port` (the
    port is rlserve's gRPC port), `host:port`, or host and port apart."""
    if base_url is None:
        return f"{host}:{server_port}"
    if "://" not in base_url:
        base_url = "grpc://" + base_url
    parsed = urlparse(base_url)
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"an rlserve server is host:port (grpc://127.0.0.1:50051), got {base_url!r}")
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"{host}:{parsed.port}"


class RlserveVLLMClient:
    """TRL's `VLLMClient`, answered by an rlserve server. `base_url` names it as in TRL's
    `vllm_server_base_url` (see `target_of`); `group_port` is TRL's and unused (rlserve picks a
    free port per rendezvous unless `Options.master_port` says otherwise)."""

    options = Options()

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        server_port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 0.0,
    ) -> None:
        self.target = target_of(base_url, host, server_port)
        self.base_url = f"grpc://{self.target}"
        self.host = self.target.rsplit(":", 1)[0]
        self.group_port = group_port
        self.client = Client(self.target, credentials=self.options.credentials)
        self._lifecycle = lifecycle_pb2_grpc.LifecycleStub(self.client.channel)
        self._loop = asyncio.new_event_loop()
        self._aio: AsyncClient | None = None
        self.weight_sync: WeightSync | None = None
        self.communicator: WeightSync | None = None  # TRL's name for it
        # The next sync publishes str(step): TRL syncs once per optimizer step that
        # generates, so it counts steps from 0 (set it when resuming from a checkpoint).
        self.step = 0
        self.sync_stats: list[SyncStats] = []
        # Per completion of the last generate (prompt-major): the weight version behind each token.
        self.last_versions: list[list[str]] = []
        self._batch: list[tuple[str, torch.Tensor]] | None = None  # inside weight_update()
        self._pending: list[tuple[str, torch.Tensor]] = []  # per-tensor pushes, not yet committed
        self.check_server(connection_timeout)
        self.model = self.client.model_info().model_id

    # -- the server --------------------------------------------------------------------------

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0) -> None:
        """Until the server serves, for up to `total_timeout` s (one look at 0); ConnectionError
        saying why not after that."""
        deadline = time.monotonic() + total_timeout
        while True:
            problem = self.client.health_problem(timeout_s=max(1.0, min(5.0, total_timeout)))
            if not problem:
                return
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"the rlserve server at {self.target} does not serve after {total_timeout} s: {problem}"
                )
            time.sleep(min(retry_interval, max(0.0, deadline - time.monotonic())))

    def get_server_info(self) -> dict[str, Any]:
        """The server's configuration, keyed as vLLM's `/server_info` is where TRL reads it
        (`model_config.logprobs_mode`, `weight_transfer_config`), rlserve's under `rlserve`."""
        timeout = self.options.rpc_timeout_s
        info = self.client.control.GetServerInfo(control_pb2.GetServerInfoRequest(), timeout=timeout)
        state = self._lifecycle.GetState(lifecycle_pb2.GetStateRequest(), timeout=timeout)
        caps, par = info.rl_capabilities, info.parallelism
        return {
            "model_config": {
                "model": self.model,
                "logprobs_mode": state.logprobs_mode,
                "max_model_len": info.max_model_len,
                "dtype": state.weight_dtype,
            },
            "parallel_config": {
                "tensor_parallel_size": par.tensor_parallel_size,
                "data_parallel_size": max(1, par.data_parallel_size),
                "world_size": par.world_size,
            },
            "weight_transfer_config": (
                {"backend": caps.weight_transfer_backend} if caps.weight_transfer_enabled else None
            ),
            "rlserve": {
                "weight_version": state.weight_version,
                "staged_weight_updates": state.staged_weight_updates,
                "engine_version": info.engine_version,
            },
        }

    def get_world_size(self) -> int:
        par = self.client.server_info().parallelism
        return int(par.world_size) * max(1, par.data_parallel_size)

    # -- generation --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        features: Sequence[dict | None] | None = None,
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict | None = None,
        **legacy: Any,
    ) -> dict[str, Any]:
        """`n` completions of every prompt (text or token ids), prompt-major, as TRL's client
        returns them (`logprobs`: per token the sampled one and the top `logprobs`, by
        descending probability), plus `weight_versions` per token. Older TRL's `images`, `truncate_prompt_tokens` and
        `guided_decoding_regex` are taken too."""
        if features is not None or legacy.get("images") is not None:
            raise NotImplementedError("image prompts: rlserve's TRL adapter takes text and token ids")
        regex = structured_outputs_regex or legacy.pop("guided_decoding_regex", None)
        unknown = set(legacy) - {"images", "truncate_prompt_tokens"}
        if unknown:
            raise TypeError(f"generate() got unexpected arguments {sorted(unknown)}")
        self._commit_pending()
        request = sampling_request(
            n=n,
            repetition_penalty=repetition_penalty,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            max_tokens=max_tokens,
            logprobs=logprobs,
            regex=regex,
            generation_kwargs=generation_kwargs,
            truncate_prompt_tokens=legacy.get("truncate_prompt_tokens"),
        )
        groups = self._loop.run_until_complete(self._generate(list(prompts), request, n))
        sequences = [s for group in groups for s in group]
        self.last_versions = [s.versions for s in sequences]
        lps, lp_ids = ranked_logprobs(sequences) if logprobs is not None else (None, None)
        return {
            # A text prompt's ids come from the server; token ids are the caller's own.
            "prompt_ids": [g[0].prompt_ids if isinstance(p, str) else list(p) for g, p in zip(groups, prompts)],
            "completion_ids": [s.token_ids for s in sequences],
            "logprobs": lps,
            "logprob_token_ids": lp_ids,
            "weight_versions": self.last_versions,
        }

    def chat(
        self,
        messages: Sequence[Sequence[dict]],
        chat_template_kwargs: dict | None = None,
        tools: list | None = None,
        chat_template: str | None = None,
        max_concurrent_requests: int = 64,
        **sampling: Any,
    ) -> dict[str, Any]:
        """`generate` (its sampling arguments, TRL's: `n`, `temperature`, `max_tokens`, ...) on
        the conversations rendered with the chat template on the trainer's side (rlserve takes
        token ids): the tokenizer of `Options.tokenizer`, else the served model's. Every
        conversation is in flight at once (`max_concurrent_requests` is TRL's, unused)."""
        tokenizer = self._tokenizer()
        prompts = [
            list(
                tokenizer.apply_chat_template(
                    list(conversation),
                    tools=tools or None,
                    chat_template=chat_template,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                    **(chat_template_kwargs or {}),
                )
            )
            for conversation in messages
        ]
        return self.generate(prompts, **sampling)

    def image_features(self, images: Any, max_concurrent_requests: int = 64) -> list:
        raise NotImplementedError("image prompts: rlserve's TRL adapter takes text and token ids")

    def get_sequence_logprobs(self, sequences: Any, prompt_lengths: Any, *args: Any, **kwargs: Any) -> dict:
        raise NotImplementedError("teacher scoring (prompt logprobs) is not in rlserve's TRL adapter yet")

    async def _generate(self, prompts: list, request: pb.GenerateRequest, n: int) -> list[list[StreamedSequence]]:
        if self._aio is None:
            self._aio = AsyncClient(self.target, credentials=self.options.credentials)
        client, timeout_s = self._aio, self.options.generate_timeout_s

        async def one(prompt: str | Sequence[int]) -> list[StreamedSequence]:
            req = pb.GenerateRequest()
            req.CopyFrom(request)
            if isinstance(prompt, str):
                req.text = prompt
                req.response.prompt_token_ids = True  # TRL returns them
            else:
                req.token_ids.ids.extend(int(t) for t in prompt)
            return await stream_sequences(client, req, n, timeout_s)

        streams = [asyncio.ensure_future(one(p)) for p in prompts]
        try:
            return list(await asyncio.gather(*streams))
        except BaseException:
            # One failed: the others' requests end now (cancelled on the server), not run on
            # in a loop nobody drives until the next call.
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            raise

    def _tokenizer(self) -> Any:
        if self.options.tokenizer is None:
            from transformers import AutoTokenizer

            self.options = dataclasses.replace(self.options, tokenizer=AutoTokenizer.from_pretrained(self.model))
        return self.options.tokenizer

    # -- weights -----------------------------------------------------------------------------

    def init_communicator(self, device: Any = 0) -> None:
        """The rendezvous with the server's workers over its transport (gloo or shared memory,
        the server's choice unless `Options.transport` says): tensors go from the CPU, on any
        device the trainer has. Raises the server's refusal, or WeightSyncError when it has
        no transport the SDK sends over."""
        if self.weight_sync is None:
            self.weight_sync = self.options.weight_sync(self.client)
            self.communicator = self.weight_sync
        self.weight_sync.init(shm_capacity=self.options.chunk_bytes)

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        """The `update_named_param(s)` calls inside are one sync, made on leaving the block
        (none when the block raises: nothing changes)."""
        if self._batch is not None:
            raise RuntimeError("weight_update() blocks do not nest")
        self._batch = []
        try:
            yield
            batch = self._batch
        finally:
            self._batch = None
        self._sync(batch)

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        """Part of the next sync: inside `weight_update()` the block's; otherwise (TRL before
        trl#6765, a call per tensor) committed together at `reset_prefix_cache()` or the next
        generation, never tensor by tensor."""
        (self._batch if self._batch is not None else self._pending).append((name, weights))

    def update_named_params(
        self, metadata: Sequence[tuple[str, str, Sequence[int]]], named_params: Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """One sync of the tensors `metadata` announces, streamed from `named_params` as TRL
        yields them (one chunk held at a time)."""
        if self._batch is not None:
            self._batch.extend(named_params)
            return
        self._commit_pending()
        with drained(named_params) as items:
            self._sync(TensorStream(list(metadata), items))

    def update_model_params(self, model: torch.nn.Module) -> None:
        metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]
        self.update_named_params(metadata, ((n, p.data) for n, p in model.named_parameters()))

    def reset_prefix_cache(self) -> None:
        """Commits per-tensor pushes still pending; every commit resets the prefix cache
        itself (tokens cached under old weights are never reused)."""
        self._commit_pending()

    def close_communicator(self) -> None:
        if self.weight_sync is not None:
            self.weight_sync.close()
        self.weight_sync = self.communicator = None

    def close(self) -> None:
        self.close_communicator()
        if self._aio is not None:
            self._loop.run_until_complete(self._aio.close())
            self._aio = None
        self._loop.close()
        self.client.close()

    def _commit_pending(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self._sync(pending)

    def _sync(self, weights: TensorStream | list[tuple[str, torch.Tensor]]) -> None:
        """One versioned sync (none of an empty list)."""
        if not weights:
            return
        if self.weight_sync is None:
            self.init_communicator()
        assert self.weight_sync is not None
        stats = self.weight_sync.sync(weights, str(self.step), staged=self.options.staged, verify=self.options.verify)
        self.sync_stats.append(stats)
        self.step += 1


@contextlib.contextmanager
def drained(named_params: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """The tensors TRL yields, run to their end whatever happens to the sync: under FSDP,
    DeepSpeed or PEFT its iterator gathers (every rank takes part) and merges adapters that it
    unmerges only at its end."""
    items = iter(named_params)
    try:
        yield items
    finally:
        for _ in items:
            pass
