"""rlserve's transports as vLLM `WeightTransferEngine`s (`rlserve_gloo`, `rlserve_shm`), so
vLLM's own frontends can drive them too (their calls block vLLM's engine loop, as every vLLM
backend does). rlserve's server drives the same `Receiver` through the worker extension
instead, with the long parts off the engine loop. The staging and the commit live in
`receiver.py` and `shadow.py`; an engine only knows how to parse its init_info and connect
its link.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from rlserve.config import DEFAULT_TRANSFER_TIMEOUT_S
from rlserve.wire.manifest import read_manifest
from rlserve.wire.protocol import ChunkInfo, InitInfo, ProtocolError
from rlserve.wire.shm import ShmInit
from rlserve.worker.gloo_link import SPARE
from rlserve.worker.receiver import Receiver
from rlserve.worker.served import ServedWeights
from rlserve.worker.shadow import ShadowUpdate
from rlserve.worker.shm_link import ShmLink


class _RlserveEngine(WeightTransferEngine):  # type: ignore[type-var]  # vLLM bounds its info types to its own
    update_info_cls = ChunkInfo  # type: ignore[assignment]  # rlserve's own info type, parsed by vLLM by class
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        pc = self.parallel_config
        self.manifest = read_manifest(vllm_config.model_config.model)
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self.receiver = Receiver(self.manifest, pc.data_parallel_index * pc.world_size + pc.rank, dtype)
        self._served: ServedWeights | None = None

    def parse_transport_init(self, raw: dict[str, Any], max_timeout_s: float) -> Any:
        """The typed init_info; raises ProtocolError."""
        raise NotImplementedError

    def connect(self, info: Any, op: str | None = None) -> None:
        """Make the link `info` describes this worker's transport (for rendezvous `op`)."""
        raise NotImplementedError

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        try:
            return self.parse_transport_init(init_dict, DEFAULT_TRANSFER_TIMEOUT_S)
        except ProtocolError as e:
            raise ValueError(f"invalid init_info: {e}") from e

    def parse_update_info(self, update_dict: dict[str, Any]) -> ChunkInfo:
        try:
            return ChunkInfo.parse(update_dict)
        except ProtocolError as e:
            raise ValueError(f"invalid update_info: {e}") from e

    def init_transfer_engine(self, init_info: Any) -> None:
        self.connect(init_info)

    def start_weight_update(self) -> None:
        if self._served is None:
            self._served = ServedWeights(self.model, self.manifest, self.parallel_config.tensor_parallel_size)
        self.receiver.start_session(ShadowUpdate(self.model, self._served))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after receiving; these are synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ChunkInfo) -> None:
        self.receiver.receive(update_info)

    def finish_weight_update(self) -> None:
        self.receiver.commit()

    def shutdown(self) -> None:
        self.receiver.shutdown()


class GlooWeightTransferEngine(_RlserveEngine):
    init_info_cls = InitInfo  # type: ignore[assignment]  # as update_info_cls

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        # The first rendezvous finds its helper started. vLLM's shutdown of this engine only
        # releases the trainer (it may init again): the spare lasts as long as the worker.
        SPARE.keep()

    def parse_transport_init(self, raw: dict[str, Any], max_timeout_s: float) -> InitInfo:
        return InitInfo.parse(raw, max_timeout_s)

    def connect(self, info: InitInfo, op: str | None = None) -> None:
        self.receiver.join(info, op)


class ShmWeightTransferEngine(_RlserveEngine):
    init_info_cls = ShmInit  # type: ignore[assignment]  # as update_info_cls

    def parse_transport_init(self, raw: dict[str, Any], max_timeout_s: float) -> ShmInit:
        return ShmInit.parse(raw, max_timeout_s)

    def connect(self, info: ShmInit, op: str | None = None) -> None:
        self.receiver.attach(lambda: ShmLink.open(info), info.timeout_s, op)
