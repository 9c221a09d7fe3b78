"""A gloo process group between one trainer (rank 0) and the inference workers, built from
its own TCPStore so it never touches a process's default torch.distributed group.

Every rendezvous and every collective carries a deadline; a peer that dies surfaces as an
error at once (connection closed) or at the deadline, never as a hang.

torch's privates that this needs are named in one place, below (`TORCH_PRIVATES`): this
module is shared by the trainer and the workers, so they stay here rather than in
`rlserve.worker.vllm_compat`, which lists them in its refusal of another vLLM (vLLM pins torch).
"""

from __future__ import annotations

import datetime
import socket
from typing import Protocol, cast

import torch
import torch.distributed as dist

# torch's privates ------------------------------------------------------------------------

TORCH_PRIVATES = (
    "torch.distributed.ProcessGroupGloo._Options with _timeout and _devices (a gloo group bound to one "
    "address, wire/gloo_group)",
    "ProcessGroupGloo's own allreduce / broadcast, outside torch.distributed's default group (wire/gloo_group)",
)


class _GlooBackend(Protocol):
    """The collectives rlserve calls on its gloo backend itself: torch.distributed's functions
    act on groups of the process's default world, which this group is not part of. torch's
    stub declares neither method (the backend has both)."""

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work: ...

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work: ...


def _gloo_backend(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, local_address: str | None
) -> _GlooBackend:
    """A gloo backend over `store`, listening where gloo's default device does, or on
    `local_address`. torch binds gloo to an address only through `_Options` (its stub calls
    the class `Options`, with `devices`: at runtime `Options` is the base class, without them);
    if torch renames it, joining a group with a local address raises AttributeError."""
    if local_address is None:
        backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, missing from the stub
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
        backend = dist.ProcessGroupGloo(store, rank, world_size, options)
    return cast(_GlooBackend, backend)  # the stub lacks the collectives the backend has (see _GlooBackend)


class GlooGroup:
    def __init__(
        self, store: dist.Store, rank: int, world_size: int, timeout_s: float, local_address: str | None = None
    ) -> None:
        """Rendezvous through `store`; blocks until every member joined or `timeout_s`.
        `local_address`: where this member listens for its peers (gloo's default is what the
        host name resolves to, often 127.0.0.1: unreachable from any other host)."""
        self.rank, self.world_size = rank, world_size
        self._store = store
        self._pg = _gloo_backend(store, rank, world_size, datetime.timedelta(seconds=timeout_s), local_address)

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> GlooGroup:
        """A worker joins the trainer's store, and listens for its peers on the address its
        host reaches the trainer from."""
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(store, rank, world_size, timeout_s, local_address_towards(host, port))

    @staticmethod
    def host_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
        """The trainer's store, listening on `host` only (torch's own listens on every
        interface); port 0 picks a free one (read it from `.port`)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(max(64, world_size))
        except OSError:
            listener.close()
            raise
        return dist.TCPStore(
            host,
            listener.getsockname()[1],
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )

    def vote(self, ok: bool) -> bool:
        """All members agree to go on with a chunk, or all learn that someone refused."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        self.allreduce_min(flag)
        return bool(flag.item())

    def allreduce_min(self, tensor: torch.Tensor) -> None:
        """In place, on every member; blocks until done or the deadline."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        self._pg.allreduce([tensor], opts).wait()

    def broadcast_async(self, buffer: torch.Tensor) -> dist.Work:
        """Rank 0 sends `buffer`, every other rank receives into it; `.wait()` the result.
        Collectives complete in the order they were issued on every rank."""
        return self._pg.broadcast(buffer, 0)


def local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent: a UDP socket's
    connect only picks the route)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]
