"""A trainer in its own process, for the weight-transfer tests: loads weights from a
safetensors file, runs `WeightSync.init()` and `sync()` against a server, prints the stats as
JSON (one line per sync). With --repeat N it syncs N times, alternating the weights with
--other-weights and numbering the versions. With --die-after-buckets N it exits abruptly
after sending N buckets, as a trainer that crashes mid-transfer would (the only part of this
process that is staged)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from safetensors.torch import load_file

from rlserve.client import Client
from rlserve.trainer import WeightSync
from rlserve.transfer.gloo_group import GlooGroup


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
    args = p.parse_args()
    if args.die_after_buckets:
        _die_after(args.die_after_buckets)
    weights = [load_file(args.weights)]
    if args.other_weights:
        weights.append(load_file(args.other_weights))
    with Client(args.target) as client:
        sync = WeightSync(client, timeout_s=args.timeout_s, bucket_bytes=args.bucket_bytes, chunk_bytes=2**30)
        sync.init()
        for i in range(args.repeat):
            version = args.version if args.repeat == 1 else f"{args.version}-{i}"
            stats = sync.sync(weights[i % len(weights)], version, pause_mode=args.pause_mode)
            print(json.dumps(dataclasses.asdict(stats)), flush=True)


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
