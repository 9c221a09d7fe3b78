"""Who is calling: set by the server's access check for the duration of one RPC, read where
a mutation is audited. A context variable, so it follows the call into the tasks it starts
(a mutation that outlives its caller is still audited as theirs) without being threaded
through every signature. Nothing here imports grpc."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    identity: str  # a token's name, a client certificate's common name, or "anonymous"
    role: str  # "read", "admin", or "" when authentication is off
    peer: str  # the transport's view, e.g. "ipv4:10.0.0.5:51234" or "unix:"

    @property
    def peer_host(self) -> str:
        """The peer's address without the port ("" for a Unix socket)."""
        kind, _, rest = self.peer.partition(":")
        if kind == "ipv4":
            return rest.rpartition(":")[0]
        if kind == "ipv6":
            return rest.rpartition(":")[0].strip("[]")
        return ""

    def describe(self) -> str:
        return f"{self.identity}({self.role or 'no auth'})@{self.peer}"


NOBODY = Caller("internal", "", "")
CURRENT: contextvars.ContextVar[Caller] = contextvars.ContextVar("rlserve_caller", default=NOBODY)
