"""vLLM's engine arguments for an rlserve EngineConfig: what `EngineAdapter` starts an engine
with, and what each frontend process of a server with several configures its client from."""

from __future__ import annotations

from typing import Any

from vllm import AsyncEngineArgs
from vllm.platforms import current_platform

from rlserve.config import EngineConfig

CPU_DEFAULT_KV_CACHE_GIB = 1.0
WORKER_EXTENSION = "rlserve.worker.extension.RlserveWorkerExtension"


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
        "disable_log_stats": not config.log_stats,
        "logprobs_mode": config.logprobs_mode,
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
    if config.enable_lora:
        kwargs.update(enable_lora=True, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank)
    return AsyncEngineArgs(**kwargs)
