"""The process that holds one worker's gloo membership (see `gloo_link`): `python -m
rlserve.worker.gloo_helper FD`, where FD is its end of a socket pair with the worker. It
says when it has started (a spare starts ahead of its join), then answers each request with
JSON lines: join the trainer's group; vote and receive a chunk (a message per bucket or per
tensor, as the chunk says) into the worker's landing area (mapped once, when the worker
names a new one), one line per bucket with its digests as soon as it has landed, then a
last line; leave the group (the worker keeps this helper as its spare: it says "started"
again, ready for the next join); close.
Everything that can go wrong with the trainer goes wrong here, not in the vLLM worker."""

from __future__ import annotations

import contextlib
import os

# First, before torch loads: vLLM pins its worker to one core, this process inherits that pin,
# and sharing that core with a busy worker starves it. (Run only as a program.)
with contextlib.suppress(OSError):
    os.sched_setaffinity(0, range(os.cpu_count() or 1))

import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from rlserve.wire.gloo_group import GlooGroup  # noqa: E402
from rlserve.wire.protocol import (  # noqa: E402
    ChunkInfo,
    ErrorCode,
    InitInfo,
    landing_offsets,
    plan_buckets,
    tensor_checksum,
    wire_view,
)


def serve(sock: socket.socket) -> None:
    group: GlooGroup | None = None
    landing: torch.Tensor | None = None
    reader = sock.makefile("rb")
    sock.sendall(b'{"ok": true, "started": true}\n')  # torch is in: a join waits only for the trainer
    while line := reader.readline():
        request = json.loads(line)
        op = request["op"]
        if op == "close":
            return
        try:
            if op == "join":
                info = InitInfo.parse({k: request[k] for k in InitInfo.__dataclass_fields__}, request["timeout_s"])
                group = GlooGroup.join(
                    info.master_address, info.master_port, request["rank"], info.world_size, info.timeout_s
                )
                reply: dict[str, Any] = {"ok": True}
            elif op == "leave":
                group = landing = None  # drops the group's store and connections, and the mapping
                reply = {"ok": True, "started": True}
            elif op == "chunk":
                if group is None:
                    raise RuntimeError("no group")
                if request["path"]:
                    landing = torch.from_file(request["path"], shared=True, size=request["size"], dtype=torch.uint8)
                if landing is None or landing.numel() < request["size"]:
                    raise RuntimeError("no landing area of that size was named")
                reply = receive(group, request, landing, sock)
            else:
                reply = {"ok": False, "code": ErrorCode.WRONG_STATE.value, "message": f"unknown operation {op!r}"}
        except Exception as e:  # gloo: timeout, a peer gone, store errors
            reply = {"ok": False, "code": ErrorCode.TIMEOUT.value, "message": f"{type(e).__name__}: {e}"}
        sock.sendall(json.dumps(reply).encode() + b"\n")
        if not reply["ok"]:
            return  # a failed collective leaves the group out of step: this helper is done


def receive(group: GlooGroup, request: dict[str, Any], landing: torch.Tensor, sock: socket.socket) -> dict[str, Any]:
    if not group.vote(bool(request["accept"])):
        return {"ok": True, "go": False}
    info = ChunkInfo.parse(request["info"])
    buckets = plan_buckets(info.tensors, info.bucket_bytes)
    starts, _ = landing_offsets(buckets)
    buffers = [landing[start : start + bucket.num_bytes] for bucket, start in zip(buckets, starts)]
    # Post every receive at once; digest and report each bucket while later ones arrive.
    works = [
        [group.broadcast_async(buffer[offset : offset + size]) for _, offset, size in info.messages_of(bucket)]
        for bucket, buffer in zip(buckets, buffers)
    ]
    for i, (bucket, buffer, messages) in enumerate(zip(buckets, buffers, works)):
        for work in messages:
            work.wait()
        checksums = []
        for index, offset in bucket.placements:
            meta = info.tensors[index]
            landed = wire_view(buffer[offset : offset + meta.num_bytes], meta)
            checksums.append(tensor_checksum(landed, expect=meta.checksum))
        sock.sendall(json.dumps({"ok": True, "go": True, "bucket": i, "checksums": checksums}).encode() + b"\n")
    return {"ok": True, "go": True, "done": True}


if __name__ == "__main__":
    # The worker went away: with a line of ours unread (a spare's "started"), its end resets.
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        serve(socket.socket(fileno=int(sys.argv[1])))
