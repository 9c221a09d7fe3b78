"""What an engine is, as rlserve reports it (server and model info, RL capabilities, KV event
sources): pure functions of vLLM's config, read by the engine adapter. No engine calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import vllm
from vllm.platforms import current_platform

from rlserve.types import KvEventSource, ModelInfo, ParallelismInfo, RlCapabilities, ServerInfo

if TYPE_CHECKING:
    from rlserve.engine.transport import WeightTransport


def server_info(vc: Any, instance_id: str, capabilities: RlCapabilities) -> ServerInfo:
    pc, sc = vc.parallel_config, vc.scheduler_config
    return ServerInfo(
        engine_version=vllm.__version__,
        # The API family, not a version: Dynamo's sidecar accepts only `vllm` here.
        api_version="vllm",
        instance_id=instance_id,
        parallelism=ParallelismInfo(
            tensor_parallel_size=pc.tensor_parallel_size,
            pipeline_parallel_size=pc.pipeline_parallel_size,
            data_parallel_size=pc.data_parallel_size,
            data_parallel_rank=pc.data_parallel_rank,
            decode_context_parallel_size=pc.decode_context_parallel_size,
            world_size=pc.world_size,
            data_parallel_size_local=pc.data_parallel_size_local,
        ),
        max_model_len=vc.model_config.max_model_len,
        kv_block_size=vc.cache_config.block_size,
        total_kv_blocks=vc.cache_config.num_gpu_blocks or 0,
        max_running_requests=sc.max_num_seqs,
        max_batched_tokens=sc.max_num_batched_tokens,
        rl_capabilities=capabilities,
        max_loras=vc.lora_config.max_loras if vc.lora_config is not None else 0,
        effective_attention_block_size=vc.cache_config.block_size,
    )


def weight_dtype(vc: Any) -> str:
    """What the model computes with, e.g. "float32"."""
    return str(vc.model_config.dtype).removeprefix("torch.")


def capabilities(vc: Any, transport: WeightTransport | None) -> RlCapabilities:
    spec = vc.speculative_config
    has_draft = spec is not None and getattr(spec, "draft_model_config", None) is not None
    return RlCapabilities(
        weight_transfer_enabled=transport is not None,
        weight_transfer_backend=transport.backend if transport is not None else "",
        sleep_mode_enabled=bool(vc.model_config.enable_sleep_mode) and current_platform.is_sleep_mode_available(),
        draft_weight_updates_enabled=transport is not None and not transport.stages_updates and has_draft,
    )


def model_info(vc: Any, served_names: tuple[str, ...]) -> ModelInfo:
    mc = vc.model_config
    return ModelInfo(
        model_id=mc.model,
        served_model_name=served_names[0],
        served_model_aliases=served_names[1:],
        supports_text_input=not mc.skip_tokenizer_init,
        supports_token_ids_input=True,
        supports_multimodal=mc.is_multimodal_model,
        supports_lora=vc.lora_config is not None,
    )


def kv_event_sources(configs: Mapping[int, Any]) -> tuple[KvEventSource, ...]:
    """From `AsyncLLM.get_kv_event_sources()`: per data-parallel rank, its events config."""
    return tuple(
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
        for dp_rank, cfg in sorted(configs.items())
        if getattr(cfg, "enable_kv_cache_events", False)
    )
