"""`rlserve_gloo` as a vLLM `WeightTransferEngine`, so vLLM's own frontends can drive it too
(their calls block vLLM's engine loop, as every vLLM backend does). rlserve's server drives
the same `GlooReceiver` through the worker extension instead, with the long parts off the
engine loop. All the transport logic lives in `receiver.py`.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from rlserve.config import DEFAULT_TRANSFER_TIMEOUT_S
from rlserve.transfer.manifest import read_manifest
from rlserve.transfer.protocol import ChunkInfo, InitInfo, ProtocolError
from rlserve.transfer.receiver import GlooReceiver
from rlserve.transfer.served import ServedWeights


class GlooWeightTransferEngine(WeightTransferEngine[InitInfo, ChunkInfo]):  # type: ignore[type-var]
    init_info_cls = InitInfo  # type: ignore[assignment]
    update_info_cls = ChunkInfo  # type: ignore[assignment]
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        pc = self.parallel_config
        self.manifest = read_manifest(vllm_config.model_config.model)
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self.receiver = GlooReceiver(self.manifest, pc.data_parallel_index * pc.world_size + pc.rank, dtype)

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:
        try:
            return InitInfo.parse(init_dict, DEFAULT_TRANSFER_TIMEOUT_S)
        except ProtocolError as e:
            raise ValueError(f"invalid init_info: {e}") from e

    def parse_update_info(self, update_dict: dict[str, Any]) -> ChunkInfo:
        try:
            return ChunkInfo.parse(update_dict)
        except ProtocolError as e:
            raise ValueError(f"invalid update_info: {e}") from e

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        self.receiver.join(init_info)

    def start_weight_update(self) -> None:
        self.receiver.start_session()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after receiving; gloo is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ChunkInfo) -> None:
        self.receiver.receive(update_info)

    def finish_weight_update(self) -> None:
        served = ServedWeights(self.model, self.manifest, self.parallel_config.tensor_parallel_size)
        self.receiver.commit(self.model, self.model_config, served)

    def shutdown(self) -> None:
        self.receiver.shutdown()
