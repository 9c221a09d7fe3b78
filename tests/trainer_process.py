"""A trainer in its own process, for the weight-transfer tests: loads weights from a
safetensors file, runs `WeightSync.init()` and `sync()` against a server, prints the stats as
JSON (one line per sync). With --repeat N it syncs N times, alternating the weights with
--other-weights and numbering the versions. With --die-after-buckets N it exits abruptly
after sending N buckets, as a trainer that crashes mid-transfer would (the only part of this
process that is staged); --die-after-shm-writes N does the same over rlserve_shm, after it
has written N chunks into its segment and before the server reads the last one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from safetensors.torch import load_file

from rlserve.sdk.client import Client
from rlserve.sdk.weight_sync import WeightSync
from rlserve.wire.gloo_group import GlooGroup


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--weights", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--pause-mode", default="keep")
    p.add_argument("--bucket-bytes", type=int, default=4 * 2**20)
    p.add_argument("--timeout-s", type=float, default=10.0)
    p.add_argument("--die-after-buckets", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--other-weights", default="")
    p.add_argument("--die-after-shm-writes", type=int, default=0)
    p.add_argument("--chunk-bytes", type=int, default=2**30)
    args = p.parse_args()
    if args.die_after_buckets:
        _die_after(args.die_after_buckets)
    if args.die_after_shm_writes:
        _die_after_shm_writes(args.die_after_shm_writes)
    weights = [load_file(args.weights)]
    if args.other_weights:
        weights.append(load_file(args.other_weights))
    with Client(args.target) as client:
        sync = WeightSync(
            client, timeout_s=args.timeout_s, bucket_bytes=args.bucket_bytes, chunk_bytes=args.chunk_bytes
        )
        sync.init()
        for i in range(args.repeat):
            version = args.version if args.repeat == 1 else f"{args.version}-{i}"
            stats = sync.sync(weights[i % len(weights)], version, pause_mode=args.pause_mode)
            print(json.dumps(dataclasses.asdict(stats)), flush=True)


def _die_after_shm_writes(num_writes: int) -> None:
    from rlserve.sdk.senders import ShmSender

    write = ShmSender.write
    written = 0

    def write_then_maybe_die(self, *args, **kwargs):
        nonlocal written
        write(self, *args, **kwargs)
        written += 1
        if written == num_writes:
            os._exit(17)

    ShmSender.write = write_then_maybe_die


def _die_after(num_buckets: int) -> None:
    send = GlooGroup.broadcast_async
    sent = 0

    def broadcast_then_maybe_die(self, buffer):
        nonlocal sent
        if sent == num_buckets:
            os._exit(17)
        sent += 1
        work = send(self, buffer)
        work.wait()
        return work

    GlooGroup.broadcast_async = broadcast_then_maybe_die


if __name__ == "__main__":
    main()
