"""A worker's end of the completion notices (the server's end and the format:
`rlserve.engine.notices`): one JSON line per notice over the server's Unix socket, sent from
the worker's transfer threads."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading

from rlserve.wire.protocol import Reply

logger = logging.getLogger(__name__)


class Notifier:
    """A worker's end: connects on first use, thread-safe, never raises to its caller (a
    notice that cannot be delivered shows up at the server as a missing notice)."""

    def __init__(self, worker: int) -> None:
        self._worker = worker
        self._lock = threading.Lock()
        self._address = ""
        self._socket: socket.socket | None = None

    def send(self, address: str, op: str, reply: Reply) -> None:
        line = json.dumps({"op": op, "worker": self._worker, "reply": reply.to_dict()}).encode() + b"\n"
        with self._lock:
            try:
                self._connect(address).sendall(line)
            except OSError as e:
                logger.warning("could not notify the server of %s: %s", op, e)
                self._drop()

    def _connect(self, address: str) -> socket.socket:
        if self._socket is None or address != self._address:
            self._drop()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(address)
            sock.sendall(json.dumps({"worker": self._worker}).encode() + b"\n")
            self._socket, self._address = sock, address
        return self._socket

    def _drop(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.close()
        self._socket = None
