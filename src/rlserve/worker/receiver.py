"""One inference worker's side of rlserve's transports (`rlserve_gloo`, `rlserve_shm`): its
link to the trainer (a gloo group kept in a helper process, see `gloo_link`, or a mapped
shared-memory segment, see `shm`), the open update session, and the commit.

Per chunk: check the update_info against the checkpoint manifest and the served dtype, let
the link deliver the chunk bucket by bucket (gloo: vote with the trainer, so a refusal never
leaves the trainer blocked, then receive; shm: copy out of the segment), verify each
bucket's checksums and hand its tensors to the session's `ShadowUpdate`, which loads and
processes complete layers beside the served model while later buckets arrive. The commit
swaps the shadows in. An abort or any failure before the commit drops the shadows and
leaves the served weights untouched (in the in-place mode, layers already installed stay:
the server reports the weights inconsistent). A collective that failed or was abandoned half
way leaves the group out of step with the trainer: it is then broken and only a new
InitWeightTransferEngine makes it usable.

Thread-safe: the rendezvous and the receiving run in transfer threads, everything else on
vLLM's engine loop.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from rlserve.config import chunk_deadline_s
from rlserve.wire import patch
from rlserve.wire.manifest import ManifestEntry, lora_config_misfit, lora_misfit, lora_tensor_misfit
from rlserve.wire.protocol import (
    ChunkInfo,
    Deliver,
    ErrorCode,
    InitInfo,
    TensorMeta,
    WorkerError,
    tensor_checksum,
)
from rlserve.worker.gloo_link import GlooLink
from rlserve.worker.notifier import Notifier
from rlserve.worker.shadow import ShadowUpdate

logger = logging.getLogger(__name__)


class Link(Protocol):
    """How a chunk reaches this worker: `GlooLink` or `ShmLink`."""

    def exchange(self, info: ChunkInfo, accept: bool, timeout_s: float, deliver: Deliver) -> bool:
        """Whether the trainer sends; if it does, `deliver` each bucket in order as it lands.
        An exception from `deliver` ends the chunk (the link stays in step with the trainer)
        and is raised. A WorkerError of the link's own means it is out of step."""
        ...

    def misfit(self, info: ChunkInfo) -> str | None:
        """Why this link cannot carry the chunk, if it cannot."""
        ...

    def close(self) -> None: ...

    def rest(self) -> None:
        """A session over it ended, or it was closed: the moment for work it put off (it may
        be called more than once)."""


@dataclass
class _Session:
    # Model weights: the shadows they are built in. None for a LoRA adapter's session.
    update: ShadowUpdate | None
    # A LoRA adapter's session: its maximal rank and the tensors received (copies).
    lora_rank: int | None = None
    lora: dict[str, torch.Tensor] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)
    # The whole new value of each tensor a patch may later build on: kept at the commit.
    bases: dict[str, torch.Tensor] = field(default_factory=dict)
    # Prepared for the commit: no further chunk belongs to it.
    prepared: bool = False


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
        self._session: _Session | None = None
        self._receiving = False
        # The served value of every tensor a patch has built on, as last committed: reading it
        # back from the model (through a CPU kernel) costs more than the patch saves.
        self._bases: dict[str, torch.Tensor] = {}

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
            refusal = None
            if op is not None and op != self._init_op:
                refusal = WorkerError(ErrorCode.TIMEOUT, "the rendezvous was cancelled or superseded")
            elif self._receiving:
                refusal = WorkerError(ErrorCode.WRONG_STATE, "a chunk is still being received on the old transport")
            if refusal is None:
                old, self._link = self._link, link
                dropped, self._session = self._session, None
                self._broken, self._init_op, self._timeout_s = "", None, timeout_s
        if refusal is not None:
            link.close()
            link.rest()
            raise refusal
        if old is not None:
            old.close()  # first: a gloo helper it closes may become the spare the session's end would start
        self._close_session(dropped)

    def shutdown(self) -> None:
        with self._lock:
            link, self._link = self._link, None
            dropped, self._session = self._session, None
        if not self._receiving:
            self._close_session(dropped)
        if link is not None:
            link.close()
            link.rest()

    # Session -----------------------------------------------------------------------------

    def start_session(self, update: ShadowUpdate | None = None, lora_max_rank: int | None = None) -> None:
        """A fresh session, of model weights built in `update`, or of a LoRA adapter up to
        `lora_max_rank`: whatever an earlier one left behind is dropped."""
        if (update is None) == (lora_max_rank is None):
            raise ValueError("a session carries model weights or a LoRA adapter")
        with self._lock:
            self._check_transport()
            if self._receiving:
                raise WorkerError(ErrorCode.WRONG_STATE, "a chunk of an earlier session is still being received")
            dropped, self._session = self._session, _Session(update, lora_max_rank)
        self._close_session(dropped)

    def abort(self) -> None:
        """Drop the session. A chunk still on the wire leaves the group out of step with the
        trainer."""
        with self._lock:
            dropped, self._session = self._session, None
            receiving = self._receiving
            if receiving:
                self._broken = "an update was aborted while a chunk was on the wire"
        # A chunk being received closes its session itself when it ends.
        if not receiving:
            self._close_session(dropped)

    def receive(self, info: ChunkInfo, timeout_s: float | None = None) -> None:
        """Receive one chunk, bounded by `timeout_s` (default: the transport's timeout per
        started 256 MiB, as the server bounds it)."""
        with self._lock:
            self._check_transport()
            session = self._session
            if session is None:
                raise WorkerError(ErrorCode.WRONG_STATE, "no update session is open")
            if self._receiving:
                raise WorkerError(ErrorCode.WRONG_STATE, "another chunk is being received")
            if session.prepared:
                raise WorkerError(ErrorCode.WRONG_STATE, "the update is prepared for its commit: no more chunks")
            link = self._link
            self._receiving = True
        assert link is not None
        if timeout_s is None:
            timeout_s = chunk_deadline_s(self._timeout_s, info.num_bytes)
        try:
            self._receive(link, info, session, timeout_s)
        finally:
            with self._lock:
                self._receiving = False
                dropped = self._session is not session
            if dropped:  # aborted or replaced while it arrived
                self._close_session(session)

    def _receive(self, link: Link, info: ChunkInfo, session: _Session, timeout_s: float) -> None:
        problem = self._check_against_manifest(info, session) or link.misfit(info)
        metas = {meta.name: meta for meta in info.tensors}
        refusals: list[WorkerError] = []  # ours, raised through the link: not the link failing

        def deliver(tensors: dict[str, torch.Tensor], digests: dict[str, str]) -> None:
            try:
                self._take(session, tensors, digests, metas)
            except WorkerError as e:
                refusals.append(e)
                raise

        try:
            go = link.exchange(info, problem is None, timeout_s, deliver)
        except WorkerError as e:
            if e not in refusals:  # the helper ended or fell silent: out of step with the trainer
                with self._lock:
                    self._broken = f"the transport with the trainer failed ({e})"
            raise
        if not go:
            raise WorkerError(ErrorCode.INVALID_INFO, problem or "the trainer refused this chunk")

    def _take(
        self,
        session: _Session,
        tensors: dict[str, torch.Tensor],
        digests: dict[str, str],
        metas: Mapping[str, TensorMeta],
    ) -> None:
        """One bucket that arrived: checked against the trainer's digests (a patch once
        applied), then loaded into the shadows (or kept, for an adapter)."""
        patches = {name: blob for name, blob in tensors.items() if metas[name].num_changed is not None}
        bad = [name for name in tensors if name not in patches and digests[name] != metas[name].checksum]
        if bad:
            raise WorkerError(ErrorCode.CHECKSUM_MISMATCH, f"tensors {bad[:5]} do not match the trainer's checksums")
        with self._lock:
            if self._session is not session:
                raise WorkerError(ErrorCode.WRONG_STATE, "the update was aborted while the chunk arrived")
            kept = {name: self._bases[name] for name in tensors if name in self._bases}
        if patches:
            if session.update is None:
                raise WorkerError(ErrorCode.INVALID_INFO, "a LoRA adapter is sent whole, not as patches")
            patched = _patched(session.update, patches, kept, metas)
            session.bases.update(patched)
            tensors = {**tensors, **patched}
        # A kept base sent whole this time: its new value, copied (the landing area is reused).
        session.bases.update({name: tensors[name].clone() for name in kept if name not in patches})
        session.names.update(tensors)
        if session.update is None:
            session.lora.update({name: t.clone() for name, t in tensors.items()})
            return
        # Anything else raised here is unexpected (a bug, memory): it ends the chunk as INTERNAL.
        session.update.load(tensors)

    def _check_against_manifest(self, info: ChunkInfo, session: _Session) -> str | None:
        seen: set[str] = set()
        for t in info.tensors:
            if t.name in seen or t.name in session.names:
                return f"tensor {t.name!r} is sent twice in this update"
            if session.lora_rank is not None:
                problem = lora_tensor_misfit(t.name, t.shape, self._manifest, session.lora_rank)
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
        """End a LoRA session: write the adapter (checked whole) as a PEFT directory
        `directory`/<this worker's rank> that vLLM loads from; returns how many tensors it
        has. The model is not touched."""
        session = self._claim_session()
        if session.lora_rank is None:
            raise WorkerError(ErrorCode.WRONG_STATE, "no LoRA update session is open")
        staged = session.lora
        metas = {n: ManifestEntry(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in staged.items()}
        problem = lora_misfit(metas, self._manifest, session.lora_rank) or lora_config_misfit(adapter_config, metas)
        if problem:
            raise WorkerError(ErrorCode.INVALID_INFO, problem)
        path = Path(directory) / str(self._rank_in_server)
        path.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for n, t in staged.items()}, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(dict(adapter_config)))
        return len(staged)

    def held_bytes(self) -> int:
        """What the open session holds beside the served weights: its shadows (model
        weights) or the adapter's tensors received; 0 without a session."""
        with self._lock:
            session = self._session
        if session is None:
            return 0
        if session.update is None:
            return sum(t.nbytes for t in session.lora.values())
        return session.update.held_bytes()

    def prepare(self) -> int:
        """Phase one of the commit: complete and process every staged layer beside the served
        model (`ShadowUpdate.prepare`); the session stays open for `commit()` or `abort()`.
        Returns how many checkpoint tensors the commit will set or keep. A failure leaves
        the served weights as they were (in place: as far as they were installed)."""
        with self._lock:
            if self._receiving:
                raise WorkerError(ErrorCode.WRONG_STATE, "a chunk is still being received")
            session = self._session
        if session is None or session.update is None:
            raise WorkerError(ErrorCode.WRONG_STATE, "no model-weight update session is open")
        try:
            count = session.update.prepare()
        except WorkerError:
            raise
        except Exception as e:
            logger.exception("preparing the commit failed")
            raise WorkerError(ErrorCode.COMMIT_FAILED, f"preparing the commit failed: {e}") from e
        session.prepared = True
        return count

    def commit(self) -> int:
        """Swap the session's shadows in, completing partly sent layers from the served
        weights; returns how many checkpoint tensors were set or kept."""
        session = self._claim_session()
        if session.update is None:
            raise WorkerError(ErrorCode.WRONG_STATE, "this session carries a LoRA adapter, not model weights")
        committed = False
        try:
            count = session.update.commit()
            committed = True
            return count
        except Exception as e:
            logger.exception("committing the update failed")
            raise WorkerError(ErrorCode.COMMIT_FAILED, f"committing the update failed: {e}") from e
        finally:
            self._close_session(session, committed)

    def _close_session(self, session: _Session | None, committed: bool = False) -> None:
        """A session is over: drop its shadows; keep the bases of what it committed, forget
        those of what went live half way (in place, or a failed commit). The link is at rest."""
        if session is None or session.update is None:
            return
        session.update.close()
        with self._lock:
            if committed:
                self._bases.update(session.bases)
            elif session.update.went_live:
                for name in session.names:
                    self._bases.pop(name, None)
            link = self._link
        if link is not None:
            link.rest()

    def _claim_session(self) -> _Session:
        with self._lock:
            if self._receiving:
                raise WorkerError(ErrorCode.WRONG_STATE, "a chunk is still being received")
            session, self._session = self._session, None
        if session is None:
            raise WorkerError(ErrorCode.WRONG_STATE, "no update session is open")
        return session


def _patched(
    update: ShadowUpdate,
    patches: Mapping[str, torch.Tensor],
    kept: Mapping[str, torch.Tensor],
    metas: Mapping[str, TensorMeta],
) -> dict[str, torch.Tensor]:
    """Each patched tensor whole: its base (kept from the last commit, else the served value)
    with the patch applied, checked against the trainer's digest of the tensor it meant (a
    patch made on other weights fails here)."""
    out: dict[str, torch.Tensor] = {}
    for name, blob in patches.items():
        meta = metas[name]
        assert meta.num_changed is not None
        base = kept.get(name)
        try:
            tensor = patch.apply(base if base is not None else update.served_value(name), blob, meta.num_changed)
        except ValueError as e:
            raise WorkerError(ErrorCode.INVALID_INFO, f"{name}: {e}") from e
        if tensor_checksum(tensor, expect=meta.checksum) != meta.checksum:
            raise WorkerError(
                ErrorCode.CHECKSUM_MISMATCH,
                f"{name}: the patched tensor is not the trainer's (the patch was made on other weights than served)",
            )
        out[name] = tensor
    return out
