"""A worker's gloo membership, kept in a process of its own.

gloo aborts its whole process when a peer sends a message of the wrong size (a trainer with a
bug in its bucket plan, or a hostile one): that process must not be the vLLM worker. So each
worker starts a small helper (`python -m rlserve.transfer.gloo_helper`) that joins the
trainer's group, votes and receives each chunk straight into shared memory the worker maps
(no copy), and digests the tensors meanwhile (on another core than the worker's). The two
talk over a socket pair, one JSON line each way per operation. A helper that dies or stops
answering in time is a broken transport, never a dead worker.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from typing import Any

import torch

from rlserve.transfer.protocol import SHM_DIR, ChunkInfo, ErrorCode, InitInfo, WorkerError, plan_buckets

# Margin for the helper's own deadlines to fire first and report what went wrong.
ANSWER_MARGIN_S = 5.0
# Starting Python and importing torch in the helper.
START_S = 60.0


class GlooLink:
    def __init__(self, process: subprocess.Popen, sock: socket.socket) -> None:
        self._process = process
        self._sock = sock
        self._reader = sock.makefile("rb")

    @classmethod
    def join(cls, info: InitInfo, rank: int) -> GlooLink:
        """Start a helper and join the trainer's group through it; raises WorkerError."""
        ours, theirs = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", "rlserve.transfer.gloo_helper", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            # Its own process group, so a signal meant for the server is not the helper's to act
            # on; not its own session, which would put it in a new scheduler autogroup, starved
            # for tens of seconds while the engine keeps both cores busy.
            process_group=0,
        )
        theirs.close()
        link = cls(process, ours)
        request = {"op": "join", **info.to_json(), "rank": rank}
        try:
            link._ask(request, START_S + info.timeout_s)
        except BaseException:
            link.close()
            raise
        return link

    def exchange(
        self, info: ChunkInfo, accept: bool, timeout_s: float
    ) -> tuple[bool, dict[str, torch.Tensor], dict[str, str]]:
        """Vote (`accept`) with the trainer and, when everyone accepts, receive the chunk.
        Returns (everyone accepted, the tensors, their digests as the helper computed them
        from the bytes that arrived). Raises WorkerError (TIMEOUT: the transport is broken)."""
        path = SHM_DIR / f"rlserve-chunk-{os.getpid()}-{uuid.uuid4().hex}"
        size = max(1, sum(_bucket_sizes(info)))
        memory = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        try:
            reply = self._ask(
                {"op": "chunk", "accept": accept, "path": str(path), "size": size, "info": info.to_json()}, timeout_s
            )
        finally:
            path.unlink(missing_ok=True)  # both sides have it mapped; the name is not needed
        if not reply["go"]:
            return False, {}, {}
        digests = {meta.name: digest for meta, digest in zip(info.tensors, reply["checksums"])}
        return True, _views(memory, info), digests

    def close(self) -> None:
        try:
            self._sock.sendall(b'{"op": "close"}\n')
        except OSError:
            pass
        self._reader.close()
        self._sock.close()
        if self._process.poll() is None:
            try:
                self._process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def begin_session(self) -> None:
        pass

    def misfit(self, info: ChunkInfo) -> str | None:
        # Buckets of any size go over the wire; a segment offset means nothing here.
        return "segment_offset is for rlserve_shm" if info.segment_offset else None

    def _ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        try:
            self._sock.settimeout(timeout_s + ANSWER_MARGIN_S)
            self._sock.sendall(json.dumps(request).encode() + b"\n")
            line = self._reader.readline()
        except (OSError, TimeoutError) as e:
            self._kill()
            raise WorkerError(ErrorCode.TIMEOUT, f"the transfer helper did not answer in time: {e}") from e
        if not line:
            code = self._process.wait()
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            raise WorkerError(
                ErrorCode.TIMEOUT, f"the transfer helper ended ({how}): the trainer broke the protocol or went away"
            )
        reply = json.loads(line)
        if not reply["ok"]:
            raise WorkerError(ErrorCode(reply["code"]), reply["message"])
        return reply

    def _kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def _bucket_sizes(info: ChunkInfo) -> list[int]:
    return [bucket.num_bytes for bucket in plan_buckets(info.tensors, info.bucket_bytes)]


def bucket_offsets(info: ChunkInfo) -> list[int]:
    """Where each bucket starts in the chunk's shared memory: one after the other."""
    offsets, at = [], 0
    for size in _bucket_sizes(info):
        offsets.append(at)
        at += size
    return offsets


def _views(memory: torch.Tensor, info: ChunkInfo) -> dict[str, torch.Tensor]:
    """Each tensor of the chunk, viewed in place in the shared memory it arrived in."""
    out: dict[str, torch.Tensor] = {}
    for bucket, start in zip(plan_buckets(info.tensors, info.bucket_bytes), bucket_offsets(info)):
        for index, offset in bucket.placements:
            meta = info.tensors[index]
            begin = start + offset
            out[meta.name] = (
                memory[begin : begin + meta.num_bytes].view(getattr(torch, meta.dtype_name)).view(meta.shape)
            )
    return out
