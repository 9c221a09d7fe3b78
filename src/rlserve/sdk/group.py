"""The transport of one sync's members (one server, or every server of a fleet) as one: built
by one rendezvous with every member, it moves each chunk to all of them at once (rlserve_gloo:
one vote and one broadcast reach every member's workers; rlserve_shm: one segment per
member), and is rebuilt whenever the members change. It knows the control RPCs; the bytes are
its `Sender`'s."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import grpc
import torch

from rlserve.api.rlserve.v1 import lifecycle_pb2
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.sdk.fanout import RPC_MARGIN_S, Failed, Member, Outcome, by_name, future, rpc_errors, step_timeout_s
from rlserve.sdk.plan import DEFAULT_CHUNK_BYTES
from rlserve.sdk.senders import Sender, open_sender
from rlserve.wire import shm
from rlserve.wire.protocol import ChunkInfo


class RendezvousFailed(Exception):
    """A member refused the rendezvous, or the trainer's side of it failed; `errors` by name."""

    def __init__(self, errors: Mapping[str, Outcome], rpc_error: grpc.RpcError | None = None) -> None:
        super().__init__("the rendezvous failed: " + by_name(errors))
        self.errors = dict(errors)
        # The first refusal as the server gave it.
        self.rpc_error = rpc_error


class TransferGroup:
    """`timeout_s` bounds the rendezvous and, scaled by size, each chunk (as `WeightSync`'s)."""

    def __init__(self, *, master_address: str, master_port: int, timeout_s: float, rpc_timeout_s: float) -> None:
        self._address, self._port = master_address, master_port
        self._timeout_s, self._rpc_timeout_s = timeout_s, rpc_timeout_s
        self._sender: Sender | None = None
        self._names: tuple[str, ...] = ()
        # A collective abandoned after a refusal ends only at its own deadline: room for it.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlserve-transfer")

    @property
    def sender(self) -> Sender | None:
        return self._sender

    def spans(self, names: Sequence[str], chunks: Sequence[ChunkInfo] = ()) -> bool:
        """Whether the transport is built, in step, with exactly these members (in this
        order), and carries `chunks`."""
        sender = self._sender
        return sender is not None and sender.joined and self._names == tuple(names) and sender.fits(chunks)

    def forget(self) -> None:
        sender, self._sender, self._names = self._sender, None, ()
        if sender is not None:
            sender.close()

    @staticmethod
    def span_of(chunks: Sequence[ChunkInfo]) -> int:
        """The room a transport needs for `chunks` (shared memory: the largest one's span)."""
        return max((shm.span(c) for c in chunks), default=0) or DEFAULT_CHUNK_BYTES

    def rendezvous(self, members: Sequence[Member], backend: str, *, span: int = DEFAULT_CHUNK_BYTES) -> None:
        """One transport to every member's workers, with room for chunks of `span` bytes
        (`span_of`); a member's refusal ends it at once (the others' are cancelled). Raises
        RendezvousFailed naming who refused, ValueError for a backend the SDK has no sender
        for."""
        self.forget()
        sender = open_sender(
            backend,
            [m.num_workers for m in members],
            master_address=self._address,
            master_port=self._port,
            timeout_s=self._timeout_s,
            span=span,
        )
        try:
            self._join(sender, members)
        except BaseException:
            sender.close()
            raise
        finally:
            sender.initialized()
        self._sender, self._names = sender, tuple(m.name for m in members)

    def _join(self, sender: Sender, members: Sequence[Member]) -> None:
        rpcs = {
            m.name: m.client.control.InitWeightTransferEngine.future(
                cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(sender.init_info(i)).encode()),
                timeout=self._timeout_s + RPC_MARGIN_S,
            )
            for i, m in enumerate(members)
        }
        join = self._pool.submit(sender.join)
        pending: set[Future] = {join, *(future(f) for f in rpcs.values())}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            errors = rpc_errors({n: f for n, f in rpcs.items() if f.done()})
            if errors:
                first = next(f.exception() for n, f in rpcs.items() if n in errors)
                for f in rpcs.values():
                    f.cancel()
                raise RendezvousFailed(errors, first)
            if join in done:
                try:
                    join.result()
                except RuntimeError as e:
                    raise RendezvousFailed({"trainer": Outcome.failure(f"the trainer's side failed: {e}")}) from e

    def send_chunk(
        self, members: Sequence[Member], chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor], bar: Any = None
    ) -> None:
        """Every member's UpdateWeights, and the sender's part while they run. Raises Failed
        naming the members that refused (or the trainer, when the transport broke)."""
        sender = self._sender
        assert sender is not None, "rendezvous first"
        sender.write(chunk, tensors, bar)
        request = cpb.UpdateWeightsRequest(update_info_json=json.dumps(chunk.to_json()).encode())
        timeout_s = step_timeout_s(self._timeout_s, chunk.num_bytes)
        rpcs = {m.name: m.client.control.UpdateWeights.future(request, timeout=timeout_s) for m in members}
        sent = self._pool.submit(sender.send, chunk, tensors, bar)
        pending: set[Future] = {sent, *(future(f) for f in rpcs.values())}
        while sent not in (done := wait(pending, return_when=FIRST_COMPLETED)[0]):
            pending -= done
            refused = rpc_errors({n: f for n, f in rpcs.items() if f.done()})
            if refused:
                # Refused before its workers took part: the send cannot complete, the
                # transport is out of step.
                sender.forget()
                if sender.waits_for_every_member and len(members) > 1:
                    # Ending that member's membership makes the others' collective fail
                    # now, not at its deadline.
                    for m in members:
                        if m.name in refused:
                            self._fence(m, sender)
                wait([future(f) for f in rpcs.values()])
                raise Failed("chunk", rpc_errors(rpcs) or refused)
        try:
            go = sent.result()
        except RuntimeError:
            sender.forget()
            wait([future(f) for f in rpcs.values()])
            raise Failed(
                "chunk", rpc_errors(rpcs) or {"trainer": Outcome.failure("the transfer to the servers broke")}
            ) from None
        # Every member took part (the vote and the broadcast): the transport is in step.
        wait([future(f) for f in rpcs.values()])
        errors = rpc_errors(rpcs)
        if errors or not go:
            raise Failed("chunk", errors or {"trainer": Outcome.failure("a server refused the chunk")})

    def _fence(self, member: Member, sender: Sender) -> None:
        """Give `member` a transport of its own (a one-server rendezvous): its workers leave
        the group, and the other members' collective with them fails at once instead of at
        its deadline. Best effort: without it they fail at the deadline."""
        with contextlib.suppress(Exception):
            # A session left open (a refusal that never reached the server) blocks the init.
            member.lifecycle.AbortWeightUpdate(lifecycle_pb2.AbortWeightUpdateRequest(), timeout=self._rpc_timeout_s)
            alone = open_sender(
                sender.backend, [member.num_workers], master_address=self._address, timeout_s=min(self._timeout_s, 30.0)
            )
            request = cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(alone.init_info()).encode())
            rpc = member.client.control.InitWeightTransferEngine.future(
                request, timeout=min(self._timeout_s, 30.0) + RPC_MARGIN_S
            )
            self._pool.submit(alone.join)
            rpc.result()

    def close(self) -> None:
        self.forget()
        self._pool.shutdown(wait=False, cancel_futures=True)
