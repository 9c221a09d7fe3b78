"""One inference worker's side of rlserve's transports (`rlserve_gloo`, `rlserve_shm`): its
link to the trainer (a gloo group kept in a helper process, see `gloo_link`, or a mapped
shared-memory segment, see `shm`), the open update session's staging, and the commit into
the model.

Per chunk: check the update_info against the checkpoint manifest and the served dtype, let
the link deliver the chunk (gloo: vote with the trainer, so a refusal never leaves the
trainer blocked, then receive the buckets; shm: copy out of the segment), verify every
tensor's checksum, stage. At commit: complete partially sent layers from the served weights,
then load everything through vLLM's layer-wise reload path (on CPU vLLM repacks linear
weights after loading, so tensors are never written directly). An abort or any failure
before the commit drops the staging and leaves the served weights untouched. A collective
that failed or was abandoned half way leaves the group out of step with the trainer: it is
then broken and only a new InitWeightTransferEngine makes it usable.

Thread-safe: the rendezvous and the receiving run in transfer threads, everything else on
vLLM's engine loop.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from rlserve.transfer.gloo_link import GlooLink
from rlserve.transfer.manifest import ManifestEntry, lora_config_misfit, lora_misfit, lora_tensor_misfit
from rlserve.transfer.notify import Notifier
from rlserve.transfer.protocol import ChunkInfo, ErrorCode, InitInfo, WorkerError
from rlserve.transfer.served import ServedWeights

logger = logging.getLogger(__name__)


class Link(Protocol):
    """How a chunk reaches this worker: `GlooLink` or `ShmLink`."""

    def exchange(
        self, info: ChunkInfo, accept: bool, timeout_s: float
    ) -> tuple[bool, dict[str, torch.Tensor], dict[str, str]]:
        """(whether the trainer sends, the tensors received, their digests). A WorkerError
        means the link is out of step with the trainer."""
        ...

    def misfit(self, info: ChunkInfo) -> str | None:
        """Why this link cannot carry the chunk, if it cannot."""
        ...

    def begin_session(self) -> None:
        """A new update session starts: what the link keeps per session is dropped."""
        ...

    def close(self) -> None: ...


class Receiver:
    def __init__(self, manifest: Mapping[str, ManifestEntry], rank_in_server: int, served_dtype: str) -> None:
        self._manifest = manifest
        self._rank_in_server = rank_in_server
        self._served_dtype = served_dtype
        self.notifier = Notifier(rank_in_server)
        self._lock = threading.Lock()
        self._link: Link | None = None
        self._timeout_s = 0.0
        self._broken = ""
        self._init_op: str | None = None
        self._staged: dict[str, torch.Tensor] | None = None
        # A session for a LoRA adapter (checked as one, written out instead of loaded): its
        # maximal rank; None for a session of model weights.
        self._lora_rank: int | None = None
        self._receiving = False

    # Rendezvous --------------------------------------------------------------------------

    def begin_init(self, op: str) -> None:
        """`op` becomes the one rendezvous whose group will be kept; an older one still
        running is discarded when it ends."""
        with self._lock:
            self._init_op = op

    def cancel_init(self, op: str) -> None:
        with self._lock:
            if self._init_op == op:
                self._init_op = None

    def join(self, info: InitInfo, op: str | None = None) -> None:
        """Join the trainer's gloo group (blocks up to info.timeout_s)."""
        self.attach(lambda: GlooLink.join(info, info.rank_offset + self._rank_in_server), info.timeout_s, op)

    def attach(self, connect: Callable[[], Link], timeout_s: float, op: str | None = None) -> None:
        """Make the link `connect()` returns the transport (for rendezvous `op`, if given).
        On success the new link replaces the old one; on failure the old one stays."""
        link = connect()
        with self._lock:
            if op is not None and op != self._init_op:
                link.close()
                raise WorkerError(ErrorCode.TIMEOUT, "the rendezvous was cancelled or superseded")
            if self._receiving:
                link.close()
                raise WorkerError(ErrorCode.WRONG_STATE, "a chunk is still being received on the old transport")
            old, self._link = self._link, link
            self._broken, self._staged, self._init_op, self._timeout_s = "", None, None, timeout_s
        if old is not None:
            old.close()

    def shutdown(self) -> None:
        with self._lock:
            link, self._link, self._staged = self._link, None, None
        if link is not None:
            link.close()

    # Session -----------------------------------------------------------------------------

    def start_session(self, lora_max_rank: int | None = None) -> None:
        """A fresh session (of a LoRA adapter up to `lora_max_rank`, or of model weights):
        whatever an earlier one left behind is dropped."""
        with self._lock:
            self._check_transport()
            if self._receiving:
                raise WorkerError(ErrorCode.WRONG_STATE, "a chunk of an earlier session is still being received")
            self._staged, self._lora_rank = {}, lora_max_rank
            assert self._link is not None
            self._link.begin_session()

    def abort(self) -> None:
        """Drop the staging; the served weights were never touched. A chunk still on the wire
        leaves the group out of step with the trainer."""
        with self._lock:
            self._staged = None
            if self._receiving:
                self._broken = "an update was aborted while a chunk was on the wire"

    def receive(self, info: ChunkInfo, timeout_s: float | None = None) -> None:
        """Receive one chunk, bounded by `timeout_s` (default: the transport's timeout per
        started 256 MiB, as the server bounds it)."""
        with self._lock:
            self._check_transport()
            if self._staged is None:
                raise WorkerError(ErrorCode.WRONG_STATE, "no update session is open")
            if self._receiving:
                raise WorkerError(ErrorCode.WRONG_STATE, "another chunk is being received")
            link, staged_names = self._link, set(self._staged)
            self._receiving = True
        assert link is not None
        if timeout_s is None:
            timeout_s = self._timeout_s * (1 + info.num_bytes // (256 * 2**20))
        try:
            staged = self._receive(link, info, staged_names, timeout_s)
        finally:
            with self._lock:
                self._receiving = False
        with self._lock:
            if self._staged is None:
                raise WorkerError(ErrorCode.WRONG_STATE, "the update was aborted while the chunk arrived")
            self._staged.update(staged)

    def _receive(
        self, link: Link, info: ChunkInfo, staged_names: set[str], timeout_s: float
    ) -> dict[str, torch.Tensor]:
        problem = self._check_against_manifest(info, staged_names) or link.misfit(info)
        try:
            go, received, digests = link.exchange(info, problem is None, timeout_s)
        except WorkerError as e:  # the helper ended or fell silent: out of step with the trainer
            with self._lock:
                self._broken = f"the transport with the trainer failed ({e})"
            raise
        if not go:
            raise WorkerError(ErrorCode.INVALID_INFO, problem or "the trainer refused this chunk")
        bad = [meta.name for meta in info.tensors if digests[meta.name] != meta.checksum]
        if bad:
            raise WorkerError(ErrorCode.CHECKSUM_MISMATCH, f"tensors {bad[:5]} do not match the trainer's checksums")
        return received

    def _check_against_manifest(self, info: ChunkInfo, staged_names: set[str]) -> str | None:
        seen: set[str] = set()
        for t in info.tensors:
            if t.name in seen or t.name in staged_names:
                return f"tensor {t.name!r} is sent twice in this update"
            if self._lora_rank is not None:
                problem = lora_tensor_misfit(t.name, t.shape, self._manifest, self._lora_rank)
                if problem:
                    return problem
            else:
                entry = self._manifest.get(t.name)
                if entry is None:
                    return f"unknown tensor {t.name!r}: the checkpoint has no such name"
                if t.shape != entry.shape:
                    return f"{t.name}: shape {list(t.shape)} != checkpoint shape {list(entry.shape)}"
            if t.dtype_name != self._served_dtype:
                return (
                    f"{t.name} is {t.dtype_name}, the server computes in {self._served_dtype}: send it as "
                    f"{self._served_dtype} (converted, it would serve other bytes than were sent)"
                )
            seen.add(t.name)
        return None

    def _check_transport(self) -> None:
        if self._link is None:
            raise WorkerError(ErrorCode.WRONG_STATE, "no transport; call InitWeightTransferEngine first")
        if self._broken:
            raise WorkerError(ErrorCode.WRONG_STATE, f"the transport is broken ({self._broken}); re-initialize it")

    # Commit ------------------------------------------------------------------------------

    def write_lora(self, directory: str, adapter_config: Mapping[str, Any]) -> int:
        """End a LoRA session: write the staged adapter (checked whole) as a PEFT directory
        `directory`/<this worker's rank> that vLLM loads from; returns how many tensors it
        has. The model is not touched."""
        with self._lock:
            if self._receiving:
                raise WorkerError(ErrorCode.WRONG_STATE, "a chunk is still being received")
            staged, rank, self._staged = self._staged, self._lora_rank, None
        if staged is None or rank is None:
            raise WorkerError(ErrorCode.WRONG_STATE, "no LoRA update session is open")
        metas = {n: ManifestEntry(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in staged.items()}
        problem = lora_misfit(metas, self._manifest, rank) or lora_config_misfit(adapter_config, metas)
        if problem:
            raise WorkerError(ErrorCode.INVALID_INFO, problem)
        path = Path(directory) / str(self._rank_in_server)
        path.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for n, t in staged.items()}, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(dict(adapter_config)))
        return len(staged)

    def commit(self, model: torch.nn.Module, model_config: Any, served: ServedWeights) -> int:
        """Load the staged tensors, completing partly sent layers from `served`; returns how
        many tensors were loaded. `served` is told that the weights changed."""
        with self._lock:
            if self._receiving:
                raise WorkerError(ErrorCode.WRONG_STATE, "a chunk is still being received")
            if self._lora_rank is not None:
                raise WorkerError(ErrorCode.WRONG_STATE, "this session carries a LoRA adapter, not model weights")
            staged, self._staged = self._staged, None
        if staged is None:
            raise WorkerError(ErrorCode.WRONG_STATE, "no update session is open")
        if not staged:
            return 0
        weights = {**served.complete(staged), **staged}
        try:
            _load(model, model_config, weights)
        except Exception as e:
            logger.exception("loading the staged weights failed")
            raise WorkerError(ErrorCode.COMMIT_FAILED, f"loading the staged weights failed: {e}") from e
        finally:
            served.invalidate()
        return len(weights)


def _load(model: torch.nn.Module, model_config: Any, weights: Mapping[str, torch.Tensor]) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    try:
        model.load_weights(iter(weights.items()))
    finally:
        # Also after a failure: unwrap the loaders and put back what was not loaded, so the
        # next complete update starts from a model in a loadable state.
        finalize_layerwise_reload(model, model_config)
    _refresh_tied_lm_head(model, model_config)


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
