"""The one gloo group of a fleet: the trainer (rank 0) and the workers of every member, each
member its own range of ranks in member order. It is built by one rendezvous with every
member, moves each chunk with one vote and one broadcast that reach every member, and is
rebuilt whenever the members change."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from rlserve.api.rlserve.v1 import lifecycle_pb2
from rlserve.api.vllm import control_pb2 as cpb
from rlserve.fleet.members import Failed, FleetError, Member, by_name, future, rpc_errors
from rlserve.trainer import RPC_MARGIN_S, TensorSender, step_timeout_s
from rlserve.transfer.protocol import ChunkInfo


class FleetGroup:
    """`timeout_s` bounds the rendezvous and, scaled by size, each chunk (as `WeightSync`'s)."""

    def __init__(self, *, master_address: str, master_port: int, timeout_s: float, rpc_timeout_s: float) -> None:
        self._address, self._port = master_address, master_port
        self._timeout_s, self._rpc_timeout_s = timeout_s, rpc_timeout_s
        self._sender: TensorSender | None = None
        self._names: tuple[str, ...] = ()
        # A collective abandoned after a refusal ends only at its own deadline: room for it.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlserve-fleet")

    def spans(self, names: Sequence[str]) -> bool:
        """Whether the group is built, unbroken, with exactly these members (in this order)."""
        return self._sender is not None and self._sender.joined and self._names == tuple(names)

    @property
    def master(self) -> tuple[str, int] | None:
        """Where the trainer's end of the group listens (address, port); None before a rendezvous."""
        if self._sender is None:
            return None
        info = self._sender.init_info()
        return info["master_address"], info["master_port"]

    def forget(self) -> None:
        self._sender, self._names = None, ()

    def rendezvous(self, members: Sequence[Member]) -> None:
        """One group with every member's workers; a member's refusal ends it at once (the
        others' rendezvous are cancelled). Raises FleetError naming who refused."""
        self.forget()
        sender = TensorSender(
            sum(m.num_workers for m in members),
            master_address=self._address,
            master_port=self._port,
            timeout_s=self._timeout_s,
        )
        offsets, offset = {}, 1
        for m in members:
            offsets[m.name], offset = offset, offset + m.num_workers
        rpcs = {
            m.name: m.client.control.InitWeightTransferEngine.future(
                cpb.InitWeightTransferEngineRequest(
                    init_info_json=json.dumps(sender.init_info(offsets[m.name])).encode()
                ),
                timeout=self._timeout_s + RPC_MARGIN_S,
            )
            for m in members
        }
        join = self._pool.submit(sender.join)
        pending: set[Future] = {join, *(future(f) for f in rpcs.values())}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            errors = rpc_errors({n: f for n, f in rpcs.items() if f.done()})
            if errors:
                for f in rpcs.values():
                    f.cancel()
                raise FleetError("the rendezvous failed: " + by_name(errors))
            if join in done:
                try:
                    join.result()
                except RuntimeError as e:
                    raise FleetError(f"the rendezvous failed on the trainer's side: {e}") from e
        self._sender, self._names = sender, tuple(m.name for m in members)

    def send_chunk(self, members: Sequence[Member], chunk: ChunkInfo, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every member's UpdateWeights, and one vote and broadcast for all of them. Raises
        Failed naming the members that refused (or the trainer, when the collective broke)."""
        sender = self._sender
        assert sender is not None, "rendezvous first"
        request = cpb.UpdateWeightsRequest(update_info_json=json.dumps(chunk.to_json()).encode())
        timeout_s = step_timeout_s(self._timeout_s, chunk.num_bytes)
        rpcs = {m.name: m.client.control.UpdateWeights.future(request, timeout=timeout_s) for m in members}
        vote = self._pool.submit(sender.vote, True)
        pending: set[Future] = {vote, *(future(f) for f in rpcs.values())}
        while vote not in (done := wait(pending, return_when=FIRST_COMPLETED)[0]):
            pending -= done
            refused = rpc_errors({n: f for n, f in rpcs.items() if f.done()})
            if refused:
                # Refused before its workers voted: the vote cannot complete. Ending that
                # member's membership makes the others' collective fail now, not at its deadline.
                sender.forget()
                for m in members:
                    if m.name in refused:
                        self._fence(m)
                wait([future(f) for f in rpcs.values()])
                raise Failed("chunk", rpc_errors(rpcs) or refused)
        try:
            go = vote.result()
            if go:
                sender.broadcast(chunk, tensors)
        except RuntimeError:
            sender.forget()
            wait([future(f) for f in rpcs.values()])
            raise Failed("chunk", rpc_errors(rpcs) or {"trainer": "the collective with the servers broke"}) from None
        # Every member took part in the vote (and the broadcast): the group is in step.
        wait([future(f) for f in rpcs.values()])
        errors = rpc_errors(rpcs)
        if errors or not go:
            raise Failed("chunk", errors or {"trainer": "a server refused the chunk"})

    def _fence(self, member: Member) -> None:
        """Give `member` a transport of its own (a one-server rendezvous): its workers leave
        the fleet's group, and the other members' collective with them fails at once
        instead of at its deadline. Best effort: without it they fail at the deadline."""
        with contextlib.suppress(Exception):
            # A session left open (a refusal that never reached the server) blocks the init.
            member.lifecycle.AbortWeightUpdate(lifecycle_pb2.AbortWeightUpdateRequest(), timeout=self._rpc_timeout_s)
            alone = TensorSender(member.num_workers, master_address=self._address, timeout_s=min(self._timeout_s, 30.0))
            request = cpb.InitWeightTransferEngineRequest(init_info_json=json.dumps(alone.init_info()).encode())
            rpc = member.client.control.InitWeightTransferEngine.future(request, timeout=alone.timeout_s + RPC_MARGIN_S)
            self._pool.submit(alone.join)
            rpc.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
