"""The engine adapter: owns one vLLM `AsyncLLM` and speaks rlserve's domain types to it.

It starts and stops the engine, validates and runs generation, aborts requests and reports
what the engine is (server/model info, capabilities). Every call to the engine races the
liveness monitor, so none outlives a dead engine. It holds no lifecycle state: pause, sleep
and weight updates are the lifecycle controller's, which calls down into this adapter.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm import SamplingParams, TokensPrompt
from vllm.exceptions import VLLMClientError
from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from rlserve.config import EngineConfig
from rlserve.engine import describe, vllm_compat
from rlserve.engine.args import engine_args
from rlserve.engine.liveness import EngineMonitor
from rlserve.engine.load import LoadBoard, NoPrometheus
from rlserve.engine.outputs import OutputTranslator, aborted_before_start
from rlserve.engine.process_group import SocketDir, engine_in_own_group
from rlserve.engine.sampling import ModelLimits, build_prompt_token_ids, build_sampling_params, refused_by_vllm
from rlserve.engine.shared import FrontendClient, log_engine_exits
from rlserve.engine.stream import RequestStream
from rlserve.engine.transport import WeightTransport, make_transport
from rlserve.errors import CapabilityMissing, EngineUnavailable, InvalidRequest, UnknownModel
from rlserve.types import (
    EngineLoad,
    EngineStatus,
    GenerateChunk,
    GenerateParams,
    KvEventSource,
    LoraAdapter,
    ModelInfo,
    PauseMode,
    RlCapabilities,
    ServerInfo,
)
from rlserve.wire.manifest import ManifestEntry, lora_files_misfit, read_manifest
from rlserve.wire.protocol import DTYPE_BYTES

logger = logging.getLogger(__name__)

# Held requests are accounted by an estimate of what they keep alive: a Python int per
# prompt token plus the prompt text.
BYTES_PER_HELD_TOKEN = 40
DRAIN_POLL_S = 0.01


@dataclass(frozen=True)
class PreparedRequest:
    """A request the engine will accept: validated, tokenized, its sampling params built."""

    params: GenerateParams
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    lora: LoraAdapter | None = None

    @property
    def num_bytes(self) -> int:
        return BYTES_PER_HELD_TOKEN * len(self.prompt_token_ids)


class EngineAdapter:
    def __init__(
        self,
        llm: AsyncLLM,
        config: EngineConfig,
        load: LoadBoard | None = None,
        instance_id: str = "",
        sockets: SocketDir | None = None,
    ) -> None:
        self._llm = llm
        self._sockets = sockets  # the engine's, if this adapter launched it
        self.load = load  # None: the engine was started without stats
        self._config = config
        # One per server: every frontend process of a server reports the same.
        self.instance_id = instance_id or uuid.uuid4().hex
        vc = llm.vllm_config
        self._limits = ModelLimits(
            max_model_len=vc.model_config.max_model_len,
            vocab_size=vc.model_config.get_vocab_size(),
            has_kv_connector=vc.kv_transfer_config is not None,
            has_priority_scheduling=vc.scheduler_config.policy == "priority",
            default_sampling=vc.model_config.get_diff_sampling_param(),
            verify=lambda sampling: sampling.verify(
                vc.model_config, vc.speculative_config, vc.structured_outputs_config, self._tokenizer
            ),
        )
        self._tokenizer = llm.get_tokenizer()
        self._is_multimodal = vc.model_config.is_multimodal_model
        self._eos_token_id = getattr(self._tokenizer, "eos_token_id", None)
        self.monitor = EngineMonitor(
            lambda: vllm_compat.call_every_engine(llm, "get_weight_version"),
            hang_timeout_s=config.hang_timeout_s,
            errored=lambda: llm.errored,
            dead_errors=(EngineDeadError,),
        )
        self._streams: set[RequestStream] = set()
        self._manifest: dict[str, ManifestEntry] | None = None  # the checkpoint's, read on first need
        self.monitor.on_dead(self._fail_streams)
        pc = vc.parallel_config
        self.transport: WeightTransport | None = make_transport(
            llm,
            config.weight_transfer_backend,
            self.monitor,
            pc.world_size * pc.data_parallel_size,
            in_place=config.weight_update_mode == "in-place",
        )

    @classmethod
    def start(cls, config: EngineConfig) -> EngineAdapter:
        """Start the engine (tens of seconds); raises what vLLM raises on a bad config."""
        load = LoadBoard() if config.log_stats else None
        sockets = SocketDir()
        with sockets.in_use(), engine_in_own_group():
            llm = AsyncLLM.from_engine_args(engine_args(config), stat_loggers=_stat_loggers(config, load))
        return cls(llm, config, load, sockets=sockets)

    @classmethod
    def connect(
        cls,
        config: EngineConfig,
        client: FrontendClient,
        vllm_config: Any | None = None,
        instance_id: str = "",
        forward_load: Callable[[EngineLoad], None] | None = None,
    ) -> EngineAdapter:
        """The engine client of frontend `client.index` on an engine `SharedEngine` launched.
        The engine sends each step's scheduler figures to one frontend: `forward_load` passes
        those this one gets on to frontend 0 (which keeps the newest per engine)."""
        load = LoadBoard(forward_load) if config.log_stats else None
        if vllm_config is None:
            vllm_config = vllm_compat.frontend_engine_config(engine_args(config), client.count, client.index)
        llm = AsyncLLM.from_vllm_config(
            vllm_config,
            stat_loggers=_stat_loggers(config, load),
            disable_log_stats=load is None,
            client_addresses=client.addresses,
            client_count=client.count,
            client_index=client.index,
        )
        return cls(llm, config, load, instance_id)

    @property
    def llm(self) -> AsyncLLM:
        """The vLLM engine itself, for tests and benchmarks that compare rlserve with it."""
        return self._llm

    def shutdown(self) -> None:
        self.monitor.stop()
        self._llm.shutdown()
        log_engine_exits(vllm_compat.engine_manager(self._llm))
        if self._sockets is not None:
            self._sockets.remove()

    async def close(self) -> None:
        """Before `shutdown`, on the event loop, once every request has ended."""
        if self.transport is not None:
            await self.transport.close()
        vllm_compat.cancel_output_handler(self._llm)

    # Generation ---------------------------------------------------------------------------

    async def validate(self, params: GenerateParams, lora: LoraAdapter | None = None) -> PreparedRequest:
        """Everything the engine would refuse is refused here, before the request is held or
        sent: InvalidRequest / UnknownModel naming the field."""
        self._check_model(params.model)
        prompt_ids = await build_prompt_token_ids(params, self._tokenizer, self._limits)
        sampling = build_sampling_params(params, len(prompt_ids), self._limits)
        return PreparedRequest(params, params.request_id or uuid.uuid4().hex, prompt_ids, sampling, lora)

    async def submit(self, request: PreparedRequest) -> RequestStream:
        """Hand the request to the engine; it runs from now on, also while nobody reads."""
        prompt: TokensPrompt = {"prompt_token_ids": request.prompt_token_ids}
        if request.params.cache_salt:
            prompt["cache_salt"] = request.params.cache_salt
        if self.monitor.is_dead:
            raise EngineUnavailable(self.monitor.reason)
        try:
            # Sending never waits on the engine, so a hung engine cannot hold this call.
            collector = await self._llm.add_request(
                request.request_id,
                prompt,
                request.sampling,
                priority=request.params.priority,
                lora_request=_lora_request(request.lora) if request.lora is not None else None,
            )
        except (TypeError, ValueError, VLLMClientError) as e:
            # The input processor's checks beyond SamplingParams.verify (features the engine
            # was not started with): client errors, raised before anything reached the engine.
            field = "sampling" if request.params.native_sampling_params is None else "native_sampling_params_json"
            raise refused_by_vllm(e, field) from e
        except EngineDeadError as e:
            self.monitor.declare_dead(str(e))
            raise EngineUnavailable(self.monitor.reason) from e
        translator = OutputTranslator(request.params, self._eos_token_id)
        return RequestStream(collector, translator, self._streams, self._abort_internal)

    def aborted_before_start(self, request: PreparedRequest) -> list[GenerateChunk]:
        """The terminal chunks of a request aborted while it was held (it never ran)."""
        return aborted_before_start(request.params, len(request.prompt_token_ids))

    async def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests by the client's ids; unknown ids are ignored."""
        ids = [i for i in request_ids if i]
        if ids:
            await self.monitor.guard(self._llm.abort(ids))

    async def abort_all(self) -> None:
        """Abort every request in the engine (shutdown); each ends with finish reason abort."""
        ids = [stream.internal_id for stream in self._streams]
        if ids and not self.monitor.is_dead:
            await self.monitor.guard(self._llm.abort(ids, internal=True))

    async def abort_internal(self, internal_ids: list[str]) -> None:
        """Abort requests by vLLM's internal ids, whichever frontend process submitted them
        (those of a frontend that is gone: nothing reads their outputs)."""
        if internal_ids and not self.monitor.is_dead:
            await self.monitor.guard(vllm_compat.abort_internal_requests(self._llm, internal_ids))

    async def _abort_internal(self, internal_id: str) -> None:
        """Abort one submitted request by vLLM's internal id, which is unique."""
        if not self.monitor.is_dead:
            await self._llm.abort(internal_id, internal=True)

    def _fail_streams(self, reason: str) -> None:
        """A hung engine sends nothing more: end every open stream with the reason (vLLM
        does the same itself when the engine process dies)."""
        streams = list(self._streams)
        self._streams.clear()
        for stream in streams:
            stream.fail(EngineUnavailable(reason))

    # Lifecycle operations: called only by the lifecycle controller, under its lock.

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """Return once every engine is idle (no step running, device synchronized): for WAIT
        once the engine has finished its requests, whether or not their clients read them.
        Unlike `AsyncLLM.pause_generation` there is no fixed sleep: the engine core's idle
        callback is the signal."""
        if clear_cache and self._is_multimodal:
            await self.monitor.guard(self._llm.renderer.clear_mm_cache_async())
        await self.monitor.guard(vllm_compat.pause_scheduler(self._llm, mode.value, clear_cache))

    async def resume(self) -> None:
        await self.monitor.guard(self._llm.resume_generation())

    async def sleep(self, level: int, mode: PauseMode) -> None:
        await self.monitor.guard(self._llm.sleep(level, mode.value))

    async def wake_up(self, tags: list[str] | None) -> bool:
        """Returns whether all memory is resident again (vLLM then resumes scheduling)."""
        return await self.monitor.guard(self._llm.wake_up(tags))

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block, also those of kept requests (they are recomputed on
        resume): after a weight update no old-weight state may be reused."""
        return await self.monitor.guard(vllm_compat.reset_prefix_cache_everywhere(self._llm))

    async def set_weight_version(self, version: str) -> None:
        await self.monitor.guard(self._llm.update_weight_version(version))

    async def weight_version(self) -> str:
        return await self.monitor.guard(self._llm.get_weight_version())

    async def engine_statuses(self) -> list[EngineStatus]:
        paused = await self.monitor.guard(vllm_compat.call_every_engine(self._llm, "is_scheduler_paused"))
        versions = await self.monitor.guard(vllm_compat.call_every_engine(self._llm, "get_weight_version"))
        first_rank = self._llm.vllm_config.parallel_config.data_parallel_rank
        return [EngineStatus(first_rank + i, bool(p), str(v)) for i, (p, v) in enumerate(zip(paused, versions))]

    def num_unfinished_requests(self) -> int:
        """Requests the engine has not finished (the frontend's own count)."""
        return self._llm.get_num_unfinished_requests()

    async def requests_done(self) -> None:
        """Until the engine has finished every request it has, whether or not their clients
        read them. vLLM offers no event for that, so the frontend's count is checked every
        `DRAIN_POLL_S`; only a KEEP -> WAIT pause waits like this."""
        while self.num_unfinished_requests():
            if self.monitor.is_dead:
                raise EngineUnavailable(self.monitor.reason)
            await asyncio.sleep(DRAIN_POLL_S)

    # Description --------------------------------------------------------------------------

    # LoRA adapters: called only by the lifecycle controller, under its lock. -----------------

    @property
    def lora_enabled(self) -> bool:
        return self._llm.vllm_config.lora_config is not None

    @property
    def max_loaded_loras(self) -> int:
        """How many adapters the engine keeps loaded (its CPU cache); 0 without LoRA."""
        lora = self._llm.vllm_config.lora_config
        return (lora.max_cpu_loras or lora.max_loras) if lora is not None else 0

    def require_lora(self) -> None:
        if not self.lora_enabled:
            raise CapabilityMissing("LoRA is off on this server: start it with --enable-lora")

    def check_lora(self, path: str) -> None:
        """Every tensor of the adapter fits a layer of the served checkpoint (vLLM itself
        accepts a misshapen lora_B and fails only when a request uses it). Reads headers
        only; InvalidRequest naming the first misfit."""
        self.require_lora()
        try:
            manifest = self._checkpoint_manifest()
        except (OSError, ValueError) as e:
            raise CapabilityMissing(f"adapters are checked against a safetensors checkpoint: {e}") from e
        lora = self._llm.vllm_config.lora_config
        try:
            problem = lora_files_misfit(Path(path), manifest, lora.max_lora_rank if lora is not None else 0)
        except (OSError, ValueError) as e:
            raise InvalidRequest("source_path", f"no readable adapter weights: {e}") from e
        if problem:
            raise InvalidRequest("source_path", problem)

    async def add_lora(self, adapter: LoraAdapter) -> None:
        """Load the adapter into the engine; InvalidRequest with vLLM's reason if it cannot."""
        self.require_lora()
        try:
            await self.monitor.guard(self._llm.add_lora(_lora_request(adapter)))
        except (EngineUnavailable, EngineDeadError):
            raise
        except Exception as e:  # vLLM reports a bad adapter (rank, modules, files) as it finds it
            raise InvalidRequest("source_path", f"vLLM cannot load this adapter: {e}") from e

    async def remove_lora(self, adapter: LoraAdapter) -> None:
        await self.monitor.guard(self._llm.remove_lora(adapter.lora_id))

    def _check_model(self, model: str) -> None:
        if model and model not in self._config.served_names:
            raise UnknownModel(model, self._config.served_names)

    def server_info(self) -> ServerInfo:
        return describe.server_info(self._llm.vllm_config, self.instance_id, self.capabilities())

    @property
    def logprobs_mode(self) -> str:
        """What output logprobs are, as the engine runs (vLLM's logprobs_mode)."""
        return str(self._llm.vllm_config.model_config.logprobs_mode)

    @property
    def weight_dtype(self) -> str:
        """What the model computes with, e.g. "float32"."""
        return describe.weight_dtype(self._llm.vllm_config)

    @property
    def weight_bytes(self) -> int:
        """The checkpoint's tensors in `weight_dtype`, in bytes; 0 when it cannot be read."""
        try:
            manifest = self._checkpoint_manifest()
        except (OSError, ValueError):
            return 0
        return sum(math.prod(e.shape) for e in manifest.values()) * DTYPE_BYTES.get(self.weight_dtype, 0)

    def _checkpoint_manifest(self) -> dict[str, ManifestEntry]:
        """Read on first need (headers only); raises OSError or ValueError."""
        if self._manifest is None:
            self._manifest = read_manifest(self._config.model)
        return self._manifest

    def capabilities(self) -> RlCapabilities:
        return describe.capabilities(self._llm.vllm_config, self.transport)

    def model_info(self) -> ModelInfo:
        return describe.model_info(self._llm.vllm_config, self._config.served_names)

    def kv_event_sources(self) -> tuple[KvEventSource, ...]:
        return describe.kv_event_sources(self._llm.get_kv_event_sources())


def _lora_request(adapter: LoraAdapter) -> LoRARequest:
    return LoRARequest(adapter.lora_name, adapter.lora_id, adapter.source_path)


def _stat_loggers(config: EngineConfig, load: LoadBoard | None) -> list[Any] | None:
    """The load board's logger, and vLLM's Prometheus logger only with --vllm-metrics."""
    if load is None:
        return None
    return [load.logger] if config.vllm_metrics else [load.logger, NoPrometheus]
