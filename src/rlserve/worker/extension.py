"""Methods rlserve adds to every vLLM worker (vLLM's `worker_extension_cls`), which rlserve's
server calls through `collective_rpc` to drive `rlserve_gloo` and `rlserve_shm` with typed replies.

Each returns a `Reply` as a dict and never raises for an expected failure. The two long
operations, the rendezvous and receiving a chunk, run in a thread of their own and report
through `notify.Notifier` when they end, so vLLM's engine loop keeps stepping (and answering
other calls) while the trainer connects or sends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from rlserve.wire.manifest import read_manifest
from rlserve.wire.protocol import ChunkInfo, ErrorCode, ProtocolError, Reply, WorkerError
from rlserve.worker import vllm_compat
from rlserve.worker.notifier import Notifier
from rlserve.worker.served import ServedWeights
from rlserve.worker.shadow import ShadowUpdate

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from rlserve.worker.receiver import Receiver

logger = logging.getLogger(__name__)


@runtime_checkable
class RlserveBackend(Protocol):
    """What the extension uses of the worker's weight-transfer engine when it is one of
    rlserve's (`rlserve.worker.engines`)."""

    receiver: Receiver
    model: torch.nn.Module

    def parse_transport_init(self, raw: dict[str, Any], max_timeout_s: float) -> Any: ...

    def connect(self, info: Any, op: str | None = None) -> None: ...


class RlserveWorkerExtension:
    """Mixed into vLLM's Worker class; `self` is the worker (`vllm_compat.VllmWorker`)."""

    # The worker's, declared for the type checker: vLLM's check for names the extension would
    # shadow reads the class's attributes, which annotations do not make.
    vllm_config: VllmConfig
    model_runner: Any

    def rlserve_begin_init(self, op: str, notify_address: str, init_info: dict[str, Any], timeout_s: float) -> dict:
        """Start connecting to the trainer (joining its gloo group, or mapping its shared
        memory); the outcome arrives as a notice for `op`."""

        def work() -> Reply:
            engine.connect(info, op)
            return Reply(True)

        try:
            engine = self._rlserve_engine()
            receiver = engine.receiver
            info = engine.parse_transport_init(init_info, timeout_s)
        except (WorkerError, ProtocolError) as e:
            return _failure(e).to_dict()
        receiver.begin_init(op)
        _in_thread(f"rlserve-init-{op[:8]}", receiver.notifier, op, notify_address, work)
        return Reply(True).to_dict()

    def rlserve_cancel_init(self, op: str) -> dict:
        return _run(lambda: self._rlserve_receiver().cancel_init(op))

    def rlserve_begin_session(self, in_place: bool = False) -> dict:
        """A session of model weights, built in shadows (`in_place`: installed layer by layer
        as they arrive)."""

        def begin() -> None:
            engine = self._rlserve_engine()
            update = ShadowUpdate(engine.model, self._rlserve_served(), in_place=in_place)
            engine.receiver.start_session(update)

        return _run(begin)

    def rlserve_begin_lora_session(self) -> dict:
        """A session whose chunks make a LoRA adapter (up to the engine's max LoRA rank)."""
        lora = vllm_compat.worker_vllm_config(self).lora_config
        if lora is None:
            return Reply.failure(ErrorCode.WRONG_STATE, "LoRA is off in this engine").to_dict()
        return _run(lambda: self._rlserve_receiver().start_session(lora_max_rank=lora.max_lora_rank))

    def rlserve_write_lora(self, directory: str, adapter_config: dict[str, Any]) -> dict:
        """Write the session's adapter into `directory`/<this worker's rank in the server>."""

        def write() -> Reply:
            return Reply(True, data={"num_tensors": self._rlserve_receiver().write_lora(directory, adapter_config)})

        return _run(write)

    def rlserve_begin_chunk(self, op: str, notify_address: str, update_info: dict[str, Any], timeout_s: float) -> dict:
        """Start receiving one chunk; the outcome arrives as a notice for `op`."""

        def work() -> Reply:
            receiver.receive(info, timeout_s)
            return Reply(True, data={"shadow_bytes": receiver.held_bytes()})

        try:
            receiver = self._rlserve_receiver()
            info = ChunkInfo.parse(update_info)
        except (WorkerError, ProtocolError) as e:
            return _failure(e).to_dict()
        _in_thread(f"rlserve-chunk-{op[:8]}", receiver.notifier, op, notify_address, work)
        return Reply(True).to_dict()

    def rlserve_prepare(self) -> dict:
        """Complete and process the staged layers, so that the commit only swaps."""

        def prepare() -> Reply:
            with vllm_compat.current_config(self):
                receiver = self._rlserve_receiver()
                return Reply(True, data={"num_tensors": receiver.prepare(), "shadow_bytes": receiver.held_bytes()})

        return _run(prepare)

    def rlserve_commit(self) -> dict:
        """Swap the update in (on the engine loop: the engine is paused)."""

        def commit() -> None:
            with vllm_compat.current_config(self):
                self._rlserve_receiver().commit()
            # As vLLM's own finish does: loaded weights bypass the model runner's reload.
            vllm_compat.reset_lora_state(self)

        return _run(commit)

    def rlserve_abort_session(self) -> dict:
        return _run(lambda: self._rlserve_receiver().abort())

    def rlserve_digest(self, budget_s: float) -> dict:
        """Digest the served weights for up to `budget_s`; `data.done` once all are."""

        def digest() -> Reply:
            served = self._rlserve_served()
            done = served.advance(budget_s)
            data: dict[str, Any] = {"done": done}
            if done:
                data.update(per_tensor=dict(served.digests), inconsistent=sorted(served.inconsistent))
            return Reply(True, data=data)

        return _run(digest)

    def rlserve_forget_digests(self) -> dict:
        """The served weights changed outside rlserve's backends (an in-place backend's update)."""
        return _run(lambda: self._rlserve_served().invalidate())

    # Helpers (no RPC calls these) -------------------------------------------------------

    def _rlserve_served(self) -> ServedWeights:
        """This worker's served-weight digests, kept between calls (cached until a commit)."""
        served = vllm_compat.parked(self, "served_weights")
        if not isinstance(served, ServedWeights):
            config = vllm_compat.worker_vllm_config(self)
            names = read_manifest(config.model_config.model)
            served = ServedWeights(vllm_compat.worker_model(self), names, config.parallel_config.tensor_parallel_size)
            vllm_compat.park(self, "served_weights", served)
        return served

    def _rlserve_engine(self) -> RlserveBackend:
        engine = vllm_compat.worker_transfer_engine(self)
        if not isinstance(engine, RlserveBackend):
            raise WorkerError(ErrorCode.WRONG_STATE, "the worker's weight-transfer backend is not one of rlserve's")
        return engine

    def _rlserve_receiver(self) -> Receiver:
        return self._rlserve_engine().receiver


def _in_thread(name: str, notifier: Notifier, op: str, notify_address: str, work: Callable[[], Reply]) -> None:
    # The thread stays on the worker's core(s), where vLLM pinned the worker: there the main
    # thread's spin after each message it reads yields the core to it; on another core the
    # two contend for the GIL, and a chunk took 2-5x as long (docs/performance.md).
    def run() -> None:
        try:
            reply = work()
        except (WorkerError, ProtocolError) as e:
            reply = _failure(e)
        except Exception as e:  # a bug: report it rather than leave the server waiting
            logger.exception("%s failed", name)
            reply = Reply(False, None, f"{type(e).__name__}: {e}")
        notifier.send(notify_address, op, reply)

    threading.Thread(target=run, name=name, daemon=True).start()


def _failure(error: Exception) -> Reply:
    if isinstance(error, WorkerError):
        return Reply.failure(error.code, str(error))
    return Reply.failure(ErrorCode.INVALID_INFO, str(error))


def _run(call: Callable[[], Reply | None]) -> dict:
    try:
        reply = call()
    except (WorkerError, ProtocolError) as e:
        reply = _failure(e)
    return (reply or Reply(True)).to_dict()
