"""The inference-worker side of `rlserve_gloo`: a vLLM `WeightTransferEngine` that stages what
it receives and commits it only at finish.

Per chunk: check the update_info against the checkpoint manifest, vote with the trainer (so a
refusal never leaves the trainer blocked), receive the buckets, verify every tensor's
checksum. At finish: load the staged tensors through vLLM's layer-wise reload path (on CPU
vLLM repacks linear weights after loading, so tensors are never written directly). An abort
or any failure before finish drops the staging and leaves the served weights untouched.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rlserve.transfer.gloo_group import GlooGroup
from rlserve.transfer.manifest import ManifestEntry, read_manifest
from rlserve.transfer.protocol import (
    CHECKSUM_MISMATCH,
    INVALID_UPDATE,
    TRANSFER_TIMEOUT,
    ChunkInfo,
    InitInfo,
    ProtocolError,
    plan_buckets,
    tensor_checksum,
)
from vllm.distributed.weight_transfer.base import WeightTransferEngine

logger = logging.getLogger(__name__)


class GlooWeightTransferEngine(WeightTransferEngine[InitInfo, ChunkInfo]):  # type: ignore[type-var]
    init_info_cls = InitInfo  # type: ignore[assignment]
    update_info_cls = ChunkInfo  # type: ignore[assignment]
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._group: GlooGroup | None = None
        self._manifest: dict[str, ManifestEntry] = read_manifest(vllm_config.model_config.model)
        self._staged: dict[str, torch.Tensor] | None = None
        self._checksums: dict[str, str] = {}
        self.num_bytes_received = 0
        # Digests of every tensor committed by an update, read by the worker extension.
        self.committed_checksums: dict[str, str] = {}

    # Transport ---------------------------------------------------------------------------

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:
        try:
            return InitInfo.parse(init_dict)
        except ProtocolError as e:
            raise ValueError(f"{INVALID_UPDATE}: {e}") from e

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """Join the trainer's group; the old group (if any) stays until the new one is up,
        so a failed re-init leaves the transport as it was."""
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        try:
            group = GlooGroup.join(
                init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
            )
        except Exception as e:  # torch raises DistNetworkError/DistStoreError on timeout
            raise RuntimeError(f"{TRANSFER_TIMEOUT}: rendezvous with the trainer failed: {e}") from e
        self.abort()
        self._group = group

    def shutdown(self) -> None:
        self._group = None
        self.abort()

    # Session -----------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        self._staged, self._checksums, self.num_bytes_received = {}, {}, 0

    def abort(self) -> None:
        """Drop whatever was staged; the served weights were never touched."""
        self._staged, self._checksums, self.num_bytes_received = None, {}, 0

    def parse_update_info(self, update_dict: dict[str, Any]) -> ChunkInfo:
        try:
            return ChunkInfo.parse(update_dict)
        except ProtocolError as e:
            raise ValueError(f"{INVALID_UPDATE}: {e}") from e

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after receiving; gloo is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ChunkInfo) -> None:
        if self._group is None or self._staged is None:
            raise RuntimeError(f"{INVALID_UPDATE}: no transport or no open update session")
        problem = self._check_against_manifest(update_info)
        try:
            if not self._group.vote(problem is None):
                if problem is None:
                    problem = "the trainer refused this chunk"
                raise ValueError(f"{INVALID_UPDATE}: {problem}")
            received = self._receive(self._group, update_info)
        except RuntimeError as e:  # gloo: timeout or peer gone
            raise RuntimeError(f"{TRANSFER_TIMEOUT}: receiving weights failed: {e}") from e
        bad = [t.name for t in update_info.tensors if received[t.name][1] != t.checksum]
        if bad:
            raise ValueError(f"{CHECKSUM_MISMATCH}: tensors {bad[:5]} do not match the trainer's checksums")
        for name, (tensor, checksum) in received.items():
            self._staged[name], self._checksums[name] = tensor, checksum

    def _check_against_manifest(self, info: ChunkInfo) -> str | None:
        seen: set[str] = set()
        for t in info.tensors:
            entry = self._manifest.get(t.name)
            if entry is None:
                return f"unknown tensor {t.name!r}: the checkpoint has no such name"
            if t.name in seen or (self._staged is not None and t.name in self._staged):
                return f"tensor {t.name!r} is sent twice in this update"
            if t.shape != entry.shape:
                return f"{t.name}: shape {list(t.shape)} != checkpoint shape {list(entry.shape)}"
            seen.add(t.name)
        return None

    def _receive(self, group: GlooGroup, info: ChunkInfo) -> dict[str, tuple[torch.Tensor, str]]:
        """Post every bucket's receive at once (the buckets are the staging memory), then
        checksum each bucket's tensors while later buckets are still arriving."""
        buckets = plan_buckets(info.tensors, info.bucket_bytes)
        buffers = [torch.empty(b.num_bytes, dtype=torch.uint8) for b in buckets]
        works = [group.broadcast_async(buf) for buf in buffers]
        out: dict[str, tuple[torch.Tensor, str]] = {}
        for bucket, buffer, work in zip(buckets, buffers, works):
            work.wait()
            self.num_bytes_received += bucket.num_bytes
            for index, offset in bucket.placements:
                meta = info.tensors[index]
                dtype = getattr(torch, meta.dtype_name)
                tensor = buffer[offset : offset + meta.num_bytes].view(dtype).view(meta.shape)
                out[meta.name] = (tensor, tensor_checksum(tensor))
        return out

    def finish_weight_update(self) -> None:
        """Commit: load everything staged through the layer-wise reload path."""
        staged, self._staged = self._staged, None
        if not staged:
            return
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        self.model.load_weights(iter(staged.items()))
        finalize_layerwise_reload(self.model, self.model_config)
        _refresh_tied_lm_head(self.model, self.model_config)
        self.committed_checksums.update(self._checksums)


def _refresh_tied_lm_head(model: torch.nn.Module, model_config: Any) -> None:
    """vLLM's layer-wise reload processes the embedding but not an lm_head tied to it, whose
    CPU GEMM kernel stays packed from the old weights (outputs then differ from a fresh
    engine's); re-running its post-load processing repacks it from the shared weight."""
    if not getattr(model_config.hf_config, "tie_word_embeddings", False):
        return
    lm_head = getattr(model, "lm_head", None)
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(lm_head)
