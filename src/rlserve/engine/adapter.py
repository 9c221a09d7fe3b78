"""The engine adapter: owns one vLLM `AsyncLLM` and speaks rlserve's domain types to it.

It starts and stops the engine, runs generation, aborts requests and reports what the engine
is (server/model info, capabilities). It holds no lifecycle state: pause, sleep and weight
updates are the lifecycle controller's, which calls down into this adapter.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import vllm
from vllm import AsyncEngineArgs, TokensPrompt
from vllm.exceptions import VLLMClientError
from vllm.platforms import current_platform
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from rlserve import __version__
from rlserve.config import EngineConfig
from rlserve.engine.outputs import OutputTranslator
from rlserve.engine.weight_transfer import EngineWeightTransfer
from rlserve.engine.sampling import ModelLimits, build_prompt_token_ids, build_sampling_params
from rlserve.errors import EngineUnavailable, InvalidRequest, UnknownModel
from rlserve.types import (
    EngineStatus,
    GenerateChunk,
    GenerateParams,
    KvEventSource,
    ModelInfo,
    ParallelismInfo,
    RlCapabilities,
    ServerInfo,
)

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_GIB = 1.0
WORKER_EXTENSION = "rlserve.transfer.worker_extension.RlserveWorkerExtension"


def engine_args(config: EngineConfig) -> AsyncEngineArgs:
    kwargs: dict[str, Any] = {
        "model": config.model,
        "served_model_name": config.served_names[0],
        "dtype": config.dtype,
        "max_model_len": config.max_model_len,
        "data_parallel_size": config.data_parallel_size,
        "enforce_eager": config.enforce_eager,
        "enable_sleep_mode": config.enable_sleep_mode,
        "scheduling_policy": config.scheduling_policy,
        "seed": config.seed,
        "worker_extension_cls": WORKER_EXTENSION,
        # rlserve exports no metrics; vLLM's per-token stats would only cost frontend CPU.
        "disable_log_stats": True,
        **config.extra_engine_args,
    }
    kv_gib = config.kv_cache_gib
    if kv_gib is None and current_platform.is_cpu():
        # Without an explicit size vLLM CPU insists on 92% of the memory node being free.
        kv_gib = CPU_DEFAULT_KV_CACHE_GIB
    if kv_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
    if config.max_num_seqs is not None:
        kwargs["max_num_seqs"] = config.max_num_seqs
    if config.weight_transfer_backend:
        kwargs["weight_transfer_config"] = {"backend": config.weight_transfer_backend}
    return AsyncEngineArgs(**kwargs)


class EngineAdapter:
    def __init__(self, llm: AsyncLLM, config: EngineConfig) -> None:
        self._llm = llm
        self._config = config
        self._instance_id = uuid.uuid4().hex
        vc = llm.vllm_config
        self._limits = ModelLimits(
            max_model_len=vc.model_config.max_model_len,
            vocab_size=vc.model_config.get_vocab_size(),
            has_kv_connector=vc.kv_transfer_config is not None,
            has_priority_scheduling=vc.scheduler_config.policy == "priority",
            default_sampling=vc.model_config.get_diff_sampling_param(),
        )
        self._tokenizer = llm.get_tokenizer()
        self.weights = EngineWeightTransfer(llm)
        self._is_multimodal = vc.model_config.is_multimodal_model
        self._eos_token_id = getattr(self._tokenizer, "eos_token_id", None)

    @classmethod
    def start(cls, config: EngineConfig) -> EngineAdapter:
        """Start the engine (tens of seconds); raises what vLLM raises on a bad config."""
        llm = AsyncLLM.from_engine_args(engine_args(config))
        return cls(llm, config)

    @property
    def llm(self) -> AsyncLLM:
        return self._llm

    def shutdown(self) -> None:
        self._llm.shutdown()

    async def generate(
        self, params: GenerateParams, admit: Callable[[], Awaitable[None]] | None = None
    ) -> AsyncIterator[GenerateChunk]:
        """Run one request; raises InvalidRequest/UnknownModel before anything is yielded,
        EngineUnavailable when the engine dies. Cancelling the iteration aborts the request.
        `admit` is awaited after validation and before the engine sees the request (the
        lifecycle controller holds requests there while generation is paused)."""
        self._check_model(params.model)
        prompt_ids = build_prompt_token_ids(params, self._tokenizer, self._limits)
        sampling = build_sampling_params(params, len(prompt_ids), self._limits)
        if not params.is_stream and sampling.n > 1:
            raise InvalidRequest("native_sampling_params_json", "n > 1 needs GenerateStream")
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        if params.cache_salt:
            prompt["cache_salt"] = params.cache_salt
        if admit is not None:
            await admit()
        translator = OutputTranslator(params, self._eos_token_id)
        stream = self._llm.generate(prompt, sampling, params.request_id or uuid.uuid4().hex, priority=params.priority)
        try:
            async for out in stream:
                for chunk in translator.translate(out):
                    yield chunk
        except VLLMClientError as e:
            raise InvalidRequest("", str(e)) from e
        except ValueError as e:
            raise InvalidRequest("", str(e)) from e
        except EngineDeadError as e:
            raise EngineUnavailable("the engine died; restart the server") from e
        finally:
            await stream.aclose()

    async def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests by the client's ids; unknown ids are ignored."""
        ids = [i for i in request_ids if i]
        if ids:
            await self._llm.abort(ids)

    # Lifecycle operations: called only by the lifecycle controller, under its lock.

    async def pause(self, mode: str, clear_cache: bool) -> None:
        """Return once every engine is idle (no step running, device synchronized). Unlike
        `AsyncLLM.pause_generation` there is no fixed sleep: the engine core's idle callback
        is the signal. Aborted requests' final outputs may still be in flight to their
        streams when this returns."""
        if clear_cache and self._is_multimodal:
            await self._llm.renderer.clear_mm_cache_async()
        await self._llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self._llm.resume_generation()

    async def sleep(self, level: int, mode: str) -> None:
        await self._llm.sleep(level, mode)

    async def wake_up(self, tags: list[str] | None) -> bool:
        """Returns whether all memory is resident again (vLLM then resumes scheduling)."""
        return await self._llm.wake_up(tags)

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block, also those of kept requests (they are recomputed on
        resume): after a weight update no old-weight state may be reused."""
        return await self._llm.engine_core.reset_prefix_cache_async(reset_running_requests=True)

    async def set_weight_version(self, version: str) -> None:
        await self._llm.update_weight_version(version)

    async def weight_version(self) -> str:
        return await self._llm.get_weight_version()

    async def engine_statuses(self) -> list[EngineStatus]:
        core = self._llm.engine_core
        paused = await core.call_utility_all_async("is_scheduler_paused")
        versions = await core.call_utility_all_async("get_weight_version")
        first_rank = self._llm.vllm_config.parallel_config.data_parallel_rank
        return [EngineStatus(first_rank + i, bool(p), str(v)) for i, (p, v) in enumerate(zip(paused, versions))]

    def num_unfinished_requests(self) -> int:
        return self._llm.get_num_unfinished_requests()

    def _check_model(self, model: str) -> None:
        if model and model not in self._config.served_names:
            raise UnknownModel(model, self._config.served_names)

    def server_info(self) -> ServerInfo:
        vc = self._llm.vllm_config
        pc, sc = vc.parallel_config, vc.scheduler_config
        return ServerInfo(
            engine_version=vllm.__version__,
            api_version=f"rlserve/{__version__}",
            instance_id=self._instance_id,
            parallelism=ParallelismInfo(
                tensor_parallel_size=pc.tensor_parallel_size,
                pipeline_parallel_size=pc.pipeline_parallel_size,
                data_parallel_size=pc.data_parallel_size,
                data_parallel_rank=pc.data_parallel_rank,
                decode_context_parallel_size=pc.decode_context_parallel_size,
                world_size=pc.world_size,
                data_parallel_size_local=pc.data_parallel_size_local,
            ),
            max_model_len=self._limits.max_model_len,
            kv_block_size=vc.cache_config.block_size,
            total_kv_blocks=vc.cache_config.num_gpu_blocks or 0,
            max_running_requests=sc.max_num_seqs,
            max_batched_tokens=sc.max_num_batched_tokens,
            rl_capabilities=self.capabilities(),
        )

    def capabilities(self) -> RlCapabilities:
        vc = self._llm.vllm_config
        wt = vc.weight_transfer_config
        spec = vc.speculative_config
        has_draft = spec is not None and getattr(spec, "draft_model_config", None) is not None
        return RlCapabilities(
            weight_transfer_enabled=wt is not None,
            weight_transfer_backend=wt.backend if wt is not None else "",
            sleep_mode_enabled=bool(vc.model_config.enable_sleep_mode) and current_platform.is_sleep_mode_available(),
            draft_weight_updates_enabled=wt is not None and has_draft,
        )

    def model_info(self) -> ModelInfo:
        mc = self._llm.vllm_config.model_config
        names = self._config.served_names
        return ModelInfo(
            model_id=mc.model,
            served_model_name=names[0],
            served_model_aliases=names[1:],
            supports_text_input=not mc.skip_tokenizer_init,
            supports_token_ids_input=True,
            supports_multimodal=mc.is_multimodal_model,
        )

    def kv_event_sources(self) -> tuple[KvEventSource, ...]:
        sources = []
        for dp_rank, cfg in sorted(self._llm.get_kv_event_sources().items()):
            if not getattr(cfg, "enable_kv_cache_events", False):
                continue
            sources.append(
                KvEventSource(
                    transport=cfg.publisher,
                    endpoint=cfg.endpoint,
                    topic=cfg.topic,
                    replay_endpoint=cfg.replay_endpoint or "",
                    data_parallel_rank=dp_rank,
                    buffer_steps=cfg.buffer_steps,
                    hwm=cfg.hwm,
                    max_queue_size=cfg.max_queue_size,
                )
            )
        return tuple(sources)
